"""Submitting batches over one link: ids chosen here, one acknowledgment outstanding.

Note [Submitting without waiting]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A worker hands its batch reference on as soon as ``submit_batch`` is sent, and still never has
more than one unacknowledged batch on a link: the submitter chooses the batch's id (SPEC.md,
"Submitting a batch"), and waits for the last batch's acknowledgment before it sends the next
(:meth:`Submitter.settle`), raising a refusal of the submission there. A deferred batch waits
for its acknowledgment at once. A worker's links say goodbye at its exit, after the batches
it sent (``WorkerLinks.close_all``). Why, and the tests that hold it:
docs/design/worker-submission.md.
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
        acknowledgment is waited for, and its refusal raised (Note [Submitting without waiting])."""
        self.settle()
        request_id = self.link.send(request)
        if request.deferred:
            self.link.reply(request_id, request.OP)
        else:
            self._unsettled = (request_id, request.batch_id)

    def settle(self) -> None:
        """Waits for the acknowledgment of the last batch sent: a link's backpressure (Note
        [Submitting without waiting])."""
        if self._unsettled is None:
            return
        request_id, batch_id = self._unsettled
        self._unsettled = None
        reply = self.link.reply(request_id, SubmitBatch.OP)
        if isinstance(reply, BatchFailed):
            log.debug("batch %d failed, which its trainer raises: %s", batch_id, reply.message)
