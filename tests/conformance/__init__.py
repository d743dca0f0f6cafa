"""DALI's own proxy tests, run on DALI's proxy and on ``dalid.client.proxy`` alike."""
