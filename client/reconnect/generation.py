"""What a session holds of one daemon: its link, the outputs mapped from it, and its results.

A :class:`Generation` lasts as long as the daemon it was dialled to: it is closed with a
goodbye when the session ends, or abandoned as a whole when that daemon is found gone (Note
[Daemon restarts] in ``reconnector.py``), and the session's :class:`Reconnector` opens
the next one.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Any

from dalid.protocol import (
    BATCH_IDS_PER_CONNECTION,
    BatchFailed,
    BatchReady,
    Envelope,
    Error,
    WorkerLeft,
)

from ..link.launcher import Dial
from ..link.link import Link
from ..outputs.outputs import Outputs
from ..worker.links import worker_links

log = logging.getLogger("dalid.client")


class Generation:
    """What a session holds of one daemon: its link, the outputs mapped from it, and the
    results it sent that wait to be delivered. Closed once, or abandoned with the daemon."""

    def __init__(
        self,
        link: Link,
        outputs: Outputs,
        results: dict[int, BatchReady | BatchFailed],
        senders_left: dict[int, None],
    ) -> None:
        self.link = link
        self.outputs = outputs
        # Filled by the link while the session waits for another result. Neither may hold the
        # session itself, or its finalizer would never run.
        self.results = results
        # The ids of the batches the trainer submits itself, from its link's range.
        self._batch_ids = itertools.count(link.welcome.batch_id_base + 1)
        # The batch id ranges (as ``batch_id // BATCH_IDS_PER_CONNECTION``) of workers that
        # left, the latest last, filled by the link with ``results``; and the batches whose
        # results the session let go of for it, with their pipelines (Delivery._drop_abandoned).
        self.senders_left: dict[int, None] = senders_left
        self.dropped: dict[int, int] = {}

    def next_batch_id(self) -> int:
        return next(self._batch_ids)

    @classmethod
    def open(cls, dial: Dial, **options: Any) -> Generation:
        """Dials the daemon and maps its outputs; the generation owns the link from here on."""
        results: dict[int, BatchReady | BatchFailed] = {}
        senders_left: dict[int, None] = {}
        link = dial(on_push=functools.partial(_keep_result, results, senders_left), **options)
        try:
            outputs = Outputs.for_daemon(link)
        except BaseException:
            link.close()
            raise
        return cls(link, outputs, results, senders_left)

    def abandon(self) -> None:
        """Lets go of a daemon that is gone: no goodbye, and nothing more is sent to it.

        Mappings close as at the end of a job: tensors that view them keep them; their
        releases are dropped with this object (Note [Daemon restarts]).
        """
        welcome = self.link.welcome
        worker_links.close_job(self.link.path, welcome.job_id, welcome.job_token, False)
        self.link.abort()
        self.outputs.unmap()
        self.outputs.close()

    def close(self) -> None:
        welcome = self.link.welcome
        worker_links.close_job(self.link.path, welcome.job_id, welcome.job_token)
        # GPU slabs are unmapped before the goodbye, which names those tensors still view
        # (protocol/SPEC.md, "Outputs", rule 11).
        kept = self.outputs.unmap()
        self.link.close(kept_slabs=kept)
        self.outputs.close()


# How many workers that left a session remembers (a few epochs' worth of DataLoader workers).
SENDERS_REMEMBERED = 256


def _keep_result(
    results: dict[int, BatchReady | BatchFailed],
    senders_left: dict[int, None],
    envelope: Envelope,
) -> None:
    """Keeps a batch result that arrived while the session waited for another, and the ranges
    of workers that left."""
    message = envelope.message
    if isinstance(message, BatchReady | BatchFailed):
        results[message.batch_id] = message
    elif isinstance(message, WorkerLeft):
        senders_left[message.first_batch_id // BATCH_IDS_PER_CONNECTION] = None
        if len(senders_left) > SENDERS_REMEMBERED:
            del senders_left[next(iter(senders_left))]
    elif isinstance(message, Error):
        log.warning("dalid daemon: %s", message.message)
