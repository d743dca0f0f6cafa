"""What a request does, without sockets: ``core.py`` handles a connection's and a job's life,
with opening a job in ``opening.py`` and its end in ``endings.py``; ``batch_requests.py`` a job's
pipelines and batches (a batch is checked against its registration, ``members.py``, and handed
to its pipeline here), ``registration.py`` registers pipelines within the DALI threads and
pipelines of ``budget.py``, ``reclaiming.py`` ends an idle job for a new job or pipeline a full
limit refuses, ``status.py`` answers status; what is not a reply leaves through the daemon's
``push`` (``push.py``).

Imported by ``intake/`` (the daemon's loop gives it each message) and by tests that drive a core
in-process; it imports the stages below: ``jobs/``, ``runs/``, ``pipelines/``, ``samples/``,
``outputs/``.
"""
