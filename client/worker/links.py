"""A worker process's links to its daemons, one per job, and what becomes of a batch one refused.

:data:`worker_links` is this process's links by (socket, job), each the :class:`Submitter` of
its batches; a daemon restart takes a job's link away and a later hello gives it back, welcomed
into the new job of that job's trainer. :func:`left_to_trainer` decides whether a batch the
daemon could not take is the trainer's to submit. This is a worker's side of Note [Daemon
restarts] in ``reconnect/reconnector.py``: a worker leaving batches to the trainer, and
rejoining; the trainer's side is there.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import threading
import time
from pathlib import Path

from dalid.protocol import ErrorCode, Role

from ..errors import DaemonUnavailable, ProtocolMismatch, RequestError
from ..link.advice import Advice
from ..link.connection import this_pid
from ..link.link import Link, dial
from .submitter import Submitter
from .target import ProxyTarget

log = logging.getLogger("dalid.client")

# A worker whose link to a job's daemon failed tries a new hello at its next batch (the daemon
# may be back already), then, while hellos fail, at most once per REJOIN_EVERY_S; a hello waits
# at most REJOIN_HELLO_TIMEOUT_S, so that its DataLoader never stalls long.
REJOIN_EVERY_S = 0.5
REJOIN_HELLO_TIMEOUT_S = 1.0

_LinkKey = tuple[Path, int, str]


class WorkerLinks:
    """This process's worker links, one per (socket, job); reset in a forked child.

    A link's key is the job the proxy names; after a daemon restart the link may be welcomed
    into the new job of that job's trainer (rejoining: Note [Daemon restarts]).
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._links: dict[_LinkKey, Submitter] = {}
        # The process whose exit closes its links, once it opened one (see ``close_all``).
        self._closes_at_exit: int | None = None
        # Jobs whose daemon was found gone, with when to try a hello again: until one is
        # welcomed, their batches are left for the trainer to submit.
        self._lost: dict[_LinkKey, float] = {}

    def get(self, target: ProxyTarget) -> Submitter | None:
        """This process's link to the target's job, as the submitter of its batches; None
        while a job found unreachable waits for its next try (see ``lose``)."""
        with self._lock:
            if self._pid != this_pid():
                # Inherited across fork: the parent's sockets are not ours to use or close.
                self._links = {}
                self._lost = {}
                self._pid = os.getpid()
            key = (target.socket, target.job_id, target.job_token)
            submitter = self._links.get(key)
            if submitter is not None and not submitter.link.closed:
                return submitter
            retry_at = self._lost.get(key)
            if retry_at is not None and time.monotonic() < retry_at:
                return None
            link = dial(
                target.socket,
                Role.WORKER,
                device=target.device,
                name=f"worker {os.getpid()}",
                job_id=target.job_id,
                job_token=target.job_token,
                hello_timeout=5.0 if retry_at is None else REJOIN_HELLO_TIMEOUT_S,
                advice=Advice(reconnects=target.reconnect),
            )
            self._links[key] = submitter = Submitter(link)
            if self._closes_at_exit != self._pid:
                self._closes_at_exit = self._pid
                # A DataLoader worker ends in os._exit (multiprocessing runs its finalizers, not
                # atexit): the goodbye sends, in order, a batch submitted just before it that
                # the socket had not written yet, and tells the daemon the worker left now
                # rather than when it next looks for dead processes.
                multiprocessing.util.Finalize(None, self.close_all, exitpriority=0)
            if retry_at is not None:
                del self._lost[key]
                log.info(
                    "rejoined job %d as job %d of the daemon on %s (pid %d); this process "
                    "submits its batches again",
                    target.job_id,
                    link.welcome.job_id,
                    target.socket,
                    link.welcome.daemon_pid,
                )
            return submitter

    def close_job(self, socket: Path, job_id: int, job_token: str, goodbye: bool = True) -> None:
        """Closes this process's link to a job (``goodbye=False``: its daemon is gone)."""
        with self._lock:
            submitter = self._links.pop((socket, job_id, job_token), None)
            if submitter is not None and self._pid == os.getpid():
                submitter.link.close(goodbye=goodbye)

    def close_all(self) -> None:
        """Closes this process's links with a goodbye each (at its exit). Idempotent."""
        with self._lock:
            links, self._links = self._links, {}
            if self._pid != os.getpid():
                return  # inherited across fork: not ours to use or close
        for submitter in links.values():
            submitter.link.close()

    def lose(self, target: ProxyTarget, retry_after: float, goodbye: bool = False) -> bool:
        """Drops the link to a job its daemon cannot take batches for (gone, or restarted and
        not yet joined by the trainer); batches go to the trainer unsent until a hello, tried
        ``retry_after`` seconds from now or later, is welcomed. ``goodbye``: the daemon lives.
        Whether the job was reachable until now."""
        self.close_job(target.socket, target.job_id, target.job_token, goodbye=goodbye)
        key = (target.socket, target.job_id, target.job_token)
        with self._lock:
            known = key in self._lost
            self._lost[key] = time.monotonic() + retry_after
        return not known


worker_links = WorkerLinks()


def left_to_trainer(
    target: ProxyTarget, error: DaemonUnavailable | RequestError, link: Link | None
) -> bool:
    """Whether a batch that ``link`` (None: not opened) could not submit is the trainer's to
    submit (a worker's side of Note [Daemon restarts]); if so, this process stops using that
    job's link until a later hello is welcomed. False: the error is the caller's to raise."""
    rejoined = link is not None and link.welcome.job_token != target.job_token
    if not target.reconnect or not _not_taken_yet(error, rejoined):
        return False
    gone = isinstance(error, DaemonUnavailable)
    # A link that worked until now may find a restarted daemon at the next batch.
    retry_after = 0.0 if gone and link is not None else REJOIN_EVERY_S
    if worker_links.lose(target, retry_after, goodbye=not gone):
        log.info(
            "%s; the trainer submits this process's batches of job %d until this process "
            "rejoins the job",
            error,
            target.job_id,
        )
    return True


def _not_taken_yet(error: DaemonUnavailable | RequestError, rejoined: bool) -> bool:
    """Whether a batch refused with ``error`` is the trainer's to submit: its daemon is gone,
    or was restarted and the trainer has not reconnected to it, or (on a link that rejoined
    the trainer's new job) not yet registered the pipeline again."""
    if isinstance(error, ProtocolMismatch):
        return False
    if isinstance(error, DaemonUnavailable):
        return True
    return error.code is ErrorCode.UNKNOWN_JOB or (
        rejoined and error.code is ErrorCode.UNKNOWN_PIPELINE
    )
