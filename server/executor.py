"""One thread per registered pipeline: runs queued batches and hands their outputs on.

The executor keeps up to ``prefetch_queue_depth`` batches inside DALI so that decoding of the
next batch overlaps the copy-out of the previous one. A batch keeps its input frames until its
outputs are collected, because external_source with ``no_copy=True`` reads them in place.
Outputs go into the job's output stores (``outputs.py``), whatever memory they lie in.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dalid.protocol import BadSample, BatchFailed, BatchReady, ErrorCode, OnError, SubmitBatch

from .badsamples import dali_message, find_bad, oversized_images, plan, select, summary
from .outputs import JobOutputs, OutputFailure
from .pool import PoolClosed
from .runner import PipelineBuildError, PipelineRunner, PipelineSpec, sample_arrays
from .scheduler import JobSlots, ServiceClock

log = logging.getLogger("dalid.server")


@dataclass
class PendingBatch:
    batch_id: int
    request: SubmitBatch
    arrays: dict[str, list[np.ndarray]] = field(default_factory=dict)
    # Whether the batch counts against its job's in-flight limit (deferred ones do not).
    counted: bool = False
    # When it went into DALI (monotonic seconds), for its service time.
    entered: float = 0.0


Answer = Callable[[PendingBatch, "BatchReady | BatchFailed"], None]
"""answer(batch, result): sends a batch's result on; called from the executor's thread."""


class PipelineExecutor:
    """Builds one pipeline and runs its batches, in a thread of its own.

    Building happens in that thread too, so a slow build never holds up the daemon's other
    jobs: ``make_runner`` builds it, and ``on_built`` receives the built pipeline's spec, or the
    PipelineBuildError, once it is done; ``spec`` is None until then. ``answer`` sends batch
    results. Each batch runs in a slot of ``slots`` (the daemon's fair share between jobs;
    None: no limit). ``outputs`` take the outputs of its batches. A batch that fails, or has
    images over ``max_image_pixels``, is answered by the pipeline's on_error policy
    (:mod:`dalid.server.badsamples`).
    """

    def __init__(
        self,
        pipeline_id: int,
        make_runner: Callable[[], PipelineRunner],
        *,
        outputs: JobOutputs,
        answer: Answer,
        on_built: Callable[[PipelineSpec | PipelineBuildError], None],
        slots: JobSlots | None = None,
        max_image_pixels: int = 0,
    ) -> None:
        self.pipeline_id = pipeline_id
        self.spec: PipelineSpec | None = None
        self._make_runner = make_runner
        self.runner: PipelineRunner | None = None
        self.failed = False
        self._outputs = outputs
        # The stream DALI hands outputs over on (the default executor only), or None: the host.
        self._stream: int | None = None
        self._max_image_pixels = max_image_pixels
        self._answer = answer
        self._slots = slots
        self._slots_held = 0
        self._clock = ServiceClock()
        self._on_built = on_built
        self._queue: queue.Queue[PendingBatch | None] = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"dalid-pipeline-{pipeline_id}", daemon=True
        )
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def submit(self, batch: PendingBatch) -> None:
        self._queue.put(batch)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stops the thread, dropping batches not yet run; whether it stopped. Idempotent."""
        self._stopping.set()
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("pipeline %d did not stop within %.0f s", self.pipeline_id, timeout)
                return False
        return True

    # --- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            runner = self._make_runner()
        except PipelineBuildError as error:
            self.failed = True
            self._on_built(error)
            return
        if runner.spec.exec_dynamic:
            # The default executor hands outputs over on the outputs' stream, without a host
            # sync (None on a CPU daemon).
            self._stream = self._outputs.stream
        self.runner = runner
        self.spec = runner.spec
        self._on_built(runner.spec)
        try:
            self._loop(runner)
        finally:
            runner.close()

    def _loop(self, runner: PipelineRunner) -> None:
        # Every batch in ``in_flight`` holds a slot of the scheduler, taken before DALI gets it
        # and given back once DALI is done with it.
        in_flight: collections.deque[PendingBatch] = collections.deque()
        retry: collections.deque[PendingBatch] = collections.deque()
        depth = runner.spec.prefetch_queue_depth

        def start_over(
            failed: PendingBatch, code: ErrorCode, error: Exception | None, bad: dict[int, str]
        ) -> None:
            # After a failure the DALI pipeline is dead, and looking for bad samples needs an
            # idle one: rebuild, answer this batch, then run the batches that were inside the
            # old pipeline again, in their order (they take their slots anew).
            self._give_slots(len(in_flight))
            retry.extendleft(reversed(in_flight))
            in_flight.clear()
            self._clock.interrupted()
            if error is not None or runner.scheduled:
                runner.rebuild()
            self._recover(runner, failed, code, error, bad)

        try:
            while not self._stopping.is_set():
                while len(in_flight) < depth:
                    batch = self._next_batch(retry, block=not in_flight)
                    if batch is None:
                        break
                    if not self._take_slot(batch, block=not in_flight):
                        # Another job's turn: finish what is in flight first.
                        retry.appendleft(batch)
                        if not in_flight:
                            self._stopping.wait(0.05)
                        break
                    failure: Exception | None = None
                    oversized: dict[int, str] = {}
                    try:
                        oversized = self._prepare(batch)
                        if not oversized:
                            batch.entered = time.monotonic()
                            runner.schedule(batch.arrays)
                    except Exception as error:
                        failure = error
                    if failure is not None or oversized:
                        self._give_slots(1)
                        start_over(batch, ErrorCode.INVALID_BATCH, failure, oversized)
                        continue
                    in_flight.append(batch)
                if self._stopping.is_set() or not in_flight:
                    continue
                batch = in_flight.popleft()
                try:
                    outputs = runner.collect(self._stream)
                except Exception as error:
                    self._give_slots(1)
                    start_over(batch, ErrorCode.PIPELINE_ERROR, error, {})
                    continue
                samples = batch.request.batch_size
                service = self._clock.batch_done(samples, batch.entered, time.monotonic())
                if self._slots is not None:
                    self._slots.charge(service)
                # The copy-out may wait for the trainer to free buffers: not in a slot. With
                # more batches ready, ask for the next slot in this job's turn right away.
                more = bool(retry) or self._queue.qsize() > 0
                self._give_slots(1, next_cost=self._clock.cost(samples) if more else None)
                self._write(batch, outputs)
                del outputs
                runner.release()
        except PoolClosed:
            pass
        except Exception as error:
            # Most likely the pipeline could not be rebuilt. Answer every batch it holds so that
            # no trainer waits forever, and refuse new ones (see DaemonCore._executor).
            log.exception("pipeline %d stopped working", self.pipeline_id)
            self.failed = True
            message = f"the pipeline stopped working and takes no more batches: {error}"
            for batch in [*in_flight, *retry, *self._drain()]:
                self._fail(batch, ErrorCode.PIPELINE_ERROR, message)
        finally:
            self._give_slots(self._slots_held)
            if self._slots is not None:
                self._slots.forfeit()

    def _take_slot(self, batch: PendingBatch, block: bool) -> bool:
        if self._slots is None:
            return True
        cost = self._clock.cost(batch.request.batch_size)
        if not self._slots.acquire(cost, block=block, cancelled=self._stopping.is_set):
            return False
        self._slots_held += 1
        return True

    def _give_slots(self, count: int, next_cost: float | None = None) -> None:
        if self._slots is None:
            return
        for _ in range(min(count, self._slots_held)):
            self._slots.release(next_cost)
            self._slots_held -= 1

    def _drain(self) -> list[PendingBatch]:
        batches: list[PendingBatch] = []
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return batches
            if batch is not None:
                batches.append(batch)

    def _next_batch(
        self, retry: collections.deque[PendingBatch], block: bool
    ) -> PendingBatch | None:
        if retry:
            return retry.popleft()
        try:
            return self._queue.get(block=block)
        except queue.Empty:
            return None

    def _prepare(self, batch: PendingBatch) -> dict[int, str]:
        """Views the batch's frames as arrays; the image samples over the pixel limit."""
        if not batch.arrays:
            batch.arrays = {item.name: sample_arrays(item) for item in batch.request.inputs}
        return oversized_images(batch.arrays, self._max_image_pixels)

    def _recover(
        self,
        runner: PipelineRunner,
        batch: PendingBatch,
        code: ErrorCode,
        error: Exception | None,
        bad: dict[int, str],
    ) -> None:
        """Answers a batch that failed, or has ``bad`` samples, on the idle ``runner``.

        Finds the samples that fail on their own and applies the pipeline's on_error policy
        (see :mod:`dalid.server.badsamples`). Leaves ``runner`` idle and working.
        """
        arrays = batch.arrays
        # Whether the pipeline has run since it was last built: a batch that fails then gets a
        # fresh one, as after any failure, so the trials leave no trace (the dimensionality
        # external_source remembers, say).
        ran = False

        def trial(positions: list[int]) -> Exception | None:
            nonlocal ran
            try:
                runner.schedule(select(arrays, positions))
                runner.collect()
            except Exception as failure:
                runner.rebuild()
                ran = False
                return failure
            runner.release()
            ran = True
            return None

        def fail(code: ErrorCode, message: str, report: Sequence[BadSample] = ()) -> None:
            if ran:
                runner.rebuild()
            self._fail(batch, code, message, report)

        size = batch.request.batch_size
        candidates = [position for position in range(size) if position not in bad]
        if arrays:
            bad.update(find_bad(candidates, trial, whole_failed=None if bad else error))
        if not bad:
            assert error is not None
            fail(code, dali_message(error))
            return
        assert self.spec is not None  # built before any batch runs
        policy = self.spec.on_error
        positions, report = plan(policy, size, bad)
        if not positions:
            every = "" if policy is OnError.RAISE else "every sample of the batch is bad: "
            fail(ErrorCode.BAD_SAMPLES, every + summary(report), report)
            return
        try:
            runner.schedule(select(arrays, positions))
            outputs = runner.collect(self._stream)
        except Exception as failure:
            runner.rebuild()
            self._fail(batch, ErrorCode.PIPELINE_ERROR, dali_message(failure), report)
            return
        log.warning(
            "pipeline %d batch %d: %s %s",
            self.pipeline_id,
            batch.batch_id,
            "skipped" if policy is OnError.SKIP else "replaced",
            summary(report),
        )
        self._write(batch, outputs, report)
        del outputs
        runner.release()

    def _write(
        self,
        batch: PendingBatch,
        outputs: tuple[Any, ...],
        bad_samples: Sequence[BadSample] = (),
    ) -> None:
        try:
            descriptors, event = self._outputs.write_batch(
                outputs, stream_ordered=self._stream is not None, cancelled=self._stopping.is_set
            )
        except OutputFailure as failure:
            self._fail(batch, failure.code, str(failure))
            return
        # The regions are now leased to the trainer (Note [Output buffer lifetime]).
        self._answer(
            batch,
            BatchReady(
                batch.batch_id,
                self.pipeline_id,
                descriptors,
                retired_slabs=self._outputs.take_retired(),
                event=event,
                bad_samples=tuple(bad_samples),
            ),
        )

    def _fail(
        self,
        batch: PendingBatch,
        code: ErrorCode,
        message: str,
        bad_samples: Sequence[BadSample] = (),
    ) -> None:
        log.warning("pipeline %d batch %d failed: %s", self.pipeline_id, batch.batch_id, message)
        self._answer(
            batch,
            BatchFailed(batch.batch_id, self.pipeline_id, code, message, tuple(bad_samples)),
        )
