"""Reaching a daemon: which one, starting it, and the link both the trainer and its workers use.

Holds the choice of daemon when a trainer names none (``placement``), starting one on demand
(``launcher``), the :class:`~dalid.client.link.link.Link` interface and ``dial``, and its two
implementations: a ZeroMQ connection to a daemon process (``connection``, which tells a
daemon that lives from one that is gone with its watch, ``watch``) and a daemon core served
in this process (``inproc``). A batch leaves the client through a link and its results
come back through one.

Imports ``dalid.protocol`` and ``dalid.client.errors`` only; every other part of the client
builds on it (the layers are ``[tool.importlinter]`` in pyproject.toml).
"""
