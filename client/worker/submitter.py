"""Submitting batches over one link: ids chosen here, one acknowledgment outstanding.

Note [Submitting without waiting]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A DataLoader worker's collate used to wait for the daemon's ``batch_accepted`` before handing
its batch reference on: about half of a tiny batch's round trip. Now the submitter chooses the
id (its link's ``welcome.batch_id_base`` plus a counter: SPEC.md, "Submitting a batch"), sends,
and returns at once. What the wait gave is kept another way:

1. Backpressure. The daemon still holds back the acknowledgment of a batch over its job's
   in-flight limit; a link sends its next batch only once its last one was acknowledged
   (:meth:`Submitter.settle`). So a worker waits at its next batch, after it read and
   collated that batch's samples, instead of at this one, and the daemon holds at most one
   unacknowledged batch per link, as before.
2. Refusals. A batch the daemon refuses once sent fails: ``batch_failed`` goes to the trainer,
   which raises it when it reaches that batch, and is this link's acknowledgment, which the
   worker passes over (the trainer owns the error). An ``error`` acknowledgment refuses the
   submission itself (its id, or the connection), which no trainer hears of: it is raised here
   at the next batch.
3. Deferred batches wait for their acknowledgment at once: the trainer may schedule only a batch
   the daemon holds, and a refusal is raised by the worker, as before.
4. A batch sent is not yet written: the socket writes it in its own thread, a batch of a MiB in
   several writes as the daemon reads. A worker process ends in ``os._exit``, which would lose
   it, so its links say goodbye at its exit (``WorkerLinks.close_all`` in links.py); the
   goodbye follows the batch on the same socket.
"""

from __future__ import annotations

import itertools
import logging

from dalid.protocol import BatchFailed, SubmitBatch

from ..link.link import Link

log = logging.getLogger("dalid.client")


class Submitter:
    """Submits batches over ``link``, which it does not own (its opener closes it)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._counter = itertools.count(1)
        # The request id and batch id of the last batch sent, until it is acknowledged.
        self._unsettled: tuple[int, int] | None = None

    def next_batch_id(self) -> int:
        """An id of this link's range that no batch has had (SPEC.md, "Submitting a batch")."""
        return self.link.welcome.batch_id_base + next(self._counter)

    def submit(self, request: SubmitBatch) -> None:
        """Sends ``request`` once the last batch was acknowledged. A deferred batch's
        acknowledgment is waited for, and its refusal raised (point 3 of the note)."""
        self.settle()
        request_id = self.link.send(request)
        if request.deferred:
            self.link.reply(request_id, request.OP)
        else:
            self._unsettled = (request_id, request.batch_id)

    def settle(self) -> None:
        """Waits for the acknowledgment of the last batch sent (point 1 of the note)."""
        if self._unsettled is None:
            return
        request_id, batch_id = self._unsettled
        self._unsettled = None
        reply = self.link.reply(request_id, SubmitBatch.OP)
        if isinstance(reply, BatchFailed):
            log.debug("batch %d failed, which its trainer raises: %s", batch_id, reply.message)
