"""The trainer's side of a batch: wait for its result, turn it into tensors, hand regions back.

:class:`Delivery` is what a :class:`~dalid.client.session.Session` does with the batch
references the DataLoader yields: it submits again what a restarted daemon lost
(:mod:`dalid.client.reconnect`), schedules deferred batches, tells the daemon which batch the
trainer waits for and how long it has waited, waits for each result and has the output backends
turn its regions into tensors (:mod:`dalid.client.outputs`: views of the daemon's memory, or for
staged GPU outputs copies on this process's GPU); the regions of tensors that died go back to
the daemon while it waits.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

import torch

from dalid.protocol import (
    BATCH_IDS_PER_CONNECTION,
    BatchFailed,
    BatchReady,
    Envelope,
    ErrorCode,
    ReleaseRegions,
    ScheduleBatch,
    TrainerProgress,
    WantBatch,
)

from .badsamples import SampleReport
from .errors import BatchError
from .reconnect.generation import Generation
from .reconnect.reconnector import Reconnector
from .refs import DALIPipelineRunRef

log = logging.getLogger("dalid.client")

# How often the trainer tells the daemon how long it has waited for batches (for `dalid status`):
# after its first wait, with the next batch, then every 5 s at most, in the release it sends then
# where there is one (to a daemon that says it reads it there). Each second, and each its own
# message, it was with eight jobs most of the messages the daemon's I/O thread took besides the
# batches' own.
PROGRESS_INTERVAL_S = 5.0
# A wait this long is reported while it lasts; a shorter one with the next batch. With eight jobs
# on a loaded CPU daemon, waits of several seconds were common, and a report from each during
# them was a message of its own.
LONG_WAIT_REPORTED_S = 30.0
# How many batches let go of (their workers left) a session remembers, to answer a late ask.
MAX_DROPPED = 4096

# A batch this late usually means the daemon's output pool is full of buffers the trainer still
# holds through live tensors; say so once.
SLOW_BATCH_WARNING_S = 30.0


class _Progress:
    """How long the trainer has waited for batches, reported to the daemon now and then."""

    def __init__(self) -> None:
        self.waited = 0.0
        self.batches = 0
        self.reported_at = 0.0

    def due(self, waiting_for: float = 0.0) -> TrainerProgress | None:
        """The report to send now, if there is something to tell (the daemon starts from no
        wait) and the last one is old enough (taken as sent); ``waiting_for``: the wait so far."""
        now = time.monotonic()
        if now - self.reported_at < PROGRESS_INTERVAL_S or not self.waited + waiting_for:
            return None
        self.reported_at = now
        return TrainerProgress(self.waited + waiting_for, self.batches)

    def during_wait(self, waiting_for: float) -> TrainerProgress | None:
        """The report to send while a wait of ``waiting_for`` lasts: none until it is long, so
        that `dalid status` shows a trainer stuck waiting; a shorter wait's goes with the next
        batch's releases."""
        return self.due(waiting_for) if waiting_for >= LONG_WAIT_REPORTED_S else None


class Delivery:
    """The batches of one session, from their references to their tensors; the session's
    daemon (``daemon``, generation after generation) is what it waits on."""

    def __init__(self, daemon: Reconnector) -> None:
        self._daemon = daemon
        self._progress = _Progress()

    def outputs_of(
        self, runs: Iterable[DALIPipelineRunRef], reports: list[SampleReport]
    ) -> dict[int, tuple[torch.Tensor, ...]]:
        """Tensors for each run (keyed by ``id(run)``), in the order the runs are given; the
        bad samples they were delivered without, or with replaced, go to ``reports``."""
        runs = list(runs)
        for run in runs:
            self._daemon.check(run)
        start = len(reports)

        def attempt() -> dict[int, tuple[torch.Tensor, ...]]:
            del reports[start:]  # an attempt cut short by a reconnection reports nothing
            return self._deliver(runs, reports)

        produced: dict[int, tuple[torch.Tensor, ...]] = self._daemon.call(attempt)
        for run in runs:
            self._daemon.delivered(run)
        return produced

    def _deliver(
        self, runs: list[DALIPipelineRunRef], reports: list[SampleReport]
    ) -> dict[int, tuple[torch.Tensor, ...]]:
        for run in runs:
            self._daemon.submit_if_lost(run)
        link = self._daemon.link
        for run in runs:
            if not run.is_scheduled:
                link.request(ScheduleBatch(run.batch_id))  # type: ignore[arg-type]
                run.is_scheduled = True
        produced: dict[int, tuple[torch.Tensor, ...]] = {}
        for run in runs:
            result = self._wait(run.batch_id)  # type: ignore[arg-type]
            if isinstance(result, BatchFailed) and self._daemon.resubmit_refused(run, result):
                result = self._wait(run.batch_id)  # type: ignore[arg-type]
            if isinstance(result, BatchFailed):
                raise BatchError(
                    result.code,
                    result.message,
                    result.batch_id,
                    result.pipeline_id,
                    result.bad_samples,
                )
            produced[id(run)] = self._tensors(result)
            reports.extend(
                SampleReport(
                    result.batch_id,
                    result.pipeline_id,
                    bad.position,
                    bad.message,
                    None if bad.replaced_by < 0 else bad.replaced_by,
                )
                for bad in result.bad_samples
            )
        return produced

    def _tensors(self, result: BatchReady) -> tuple[torch.Tensor, ...]:
        outputs = self._daemon.generation.outputs
        outputs.retire(result.retired_slabs)
        try:
            tensors = outputs.tensors(result)
        except FileNotFoundError as error:
            # Only a daemon that died, its memory removed by its successor, loses a slab it has
            # just named (protocol/SPEC.md, "Outputs", rule 6).
            raise self._daemon.link.gone_error(
                f"its output memory {error.filename} was removed"
            ) from None
        if result.copied:
            # Copies left on the device are copied already: their regions go back now, for the
            # daemon's next copies (SPEC.md, "Outputs", rule 4).
            self.flush_releases()
        return tensors

    def _wait(self, batch_id: int) -> BatchReady | BatchFailed:
        progress = self._progress
        progress.batches += 1
        generation = self._daemon.generation
        link = self._daemon.link
        if generation.senders_left:
            self._drop_abandoned(generation, batch_id)
        # The regions of tensors that died go back before each batch, not only while waiting:
        # the daemon holds a few batches of the job at once, released ones included.
        result = generation.results.pop(batch_id, None)
        if result is not None:
            self.flush_releases(progress=progress.due())
            return result
        pipeline_id = generation.dropped.get(batch_id)
        if pipeline_id is not None:
            self.flush_releases()
            return BatchFailed(
                batch_id,
                pipeline_id,
                ErrorCode.UNKNOWN_BATCH,
                f"batch {batch_id} was let go of: the DataLoader worker that sent it left before "
                "the trainer asked for it (its iterator was dropped, or the worker died)",
            )
        # The daemon runs it before the job's other batches (SPEC.md, "Batches in flight").
        self.flush_releases(want=batch_id, progress=progress.due())

        def is_result(envelope: Envelope) -> bool:
            message = envelope.message
            return isinstance(message, BatchReady | BatchFailed) and message.batch_id == batch_id

        started = time.monotonic()
        warned = False

        def idle() -> None:
            nonlocal warned
            self.flush_releases(progress=progress.during_wait(time.monotonic() - started))
            if not warned and time.monotonic() - started > SLOW_BATCH_WARNING_S:
                warned = True
                log.warning(
                    "batch %d has not arrived after %.0f s; this job still holds %d output "
                    "buffers through live tensors. If you keep outputs across steps, keep "
                    "copies (tensor.clone()) so the daemon can reuse its buffers.",
                    batch_id,
                    SLOW_BATCH_WARNING_S,
                    self._daemon.generation.outputs.live_regions,
                )

        envelope = link.receive_until(is_result, None, idle=idle)
        assert envelope is not None and isinstance(envelope.message, BatchReady | BatchFailed)
        # Reported with the next batch's releases (at most PROGRESS_INTERVAL_S from now).
        progress.waited += time.monotonic() - started
        return envelope.message

    def _drop_abandoned(self, generation: Generation, asked: int) -> None:
        """Lets go of the results that workers which left will never have asked for (SPEC.md,
        "Batches in flight"): a worker leaves once the trainer has asked for every batch it
        sent, unless its iterator was dropped (``for batch in loader: break``) or it died. Each
        result's regions go back as those of any tensors that die; the batch being asked for
        now is kept."""
        left = generation.senders_left
        abandoned = [
            batch_id
            for batch_id in generation.results
            if batch_id != asked and batch_id // BATCH_IDS_PER_CONNECTION in left
        ]
        for batch_id in abandoned:
            result = generation.results.pop(batch_id)
            generation.dropped[batch_id] = result.pipeline_id
            if len(generation.dropped) > MAX_DROPPED:
                del generation.dropped[next(iter(generation.dropped))]
            if isinstance(result, BatchReady):
                generation.outputs.retire(result.retired_slabs)
                # Wrapped and dropped at once: released as any tensors that died.
                self._tensors(result)

    def flush_releases(
        self, want: int | None = None, progress: TrainerProgress | None = None
    ) -> None:
        """Tells the daemon of the regions whose tensors died (and the slabs unmapped), of the
        batch ``want`` the trainer is about to wait for and of its ``progress``: each in the
        last release, where there is one and the daemon reads it there (a message fewer), else
        on its own after them."""
        link = self._daemon.link
        releases = self._daemon.generation.outputs.releases()
        messages: list[ReleaseRegions | WantBatch | TrainerProgress] = list(releases)
        last = releases[-1] if releases else None
        if want is not None:
            if last is not None and link.welcome.want_in_release:
                last = dataclasses.replace(last, want_batch=want)
            else:
                messages.append(WantBatch(want))
        if progress is not None:
            if last is not None and link.welcome.progress_in_release:
                last = dataclasses.replace(last, progress=progress)
            else:
                messages.append(progress)
        if last is not None:
            messages[len(releases) - 1] = last
        for message in messages:
            link.notify(message)
