"""The trainer's side of daemon restarts: a session's daemon, generation after generation.

Holds what a session has of the daemon it talks to now (``generation``: its link, its mapped
outputs, the results waiting to be delivered) and what outlives that daemon (``reconnector``:
the pipelines' registrations, the jobs on earlier daemons, the batches to submit again). The
protocol both sides keep is Note [Daemon restarts] in ``reconnector.py``; a worker's side of it
is ``dalid.client.worker.links``.

Imports ``dalid.protocol``, ``link``, ``outputs``, ``worker``, ``errors`` and ``refs``; imported
by the session and its delivery (``session.py``, ``delivery.py``) only.
"""
