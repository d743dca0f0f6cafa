"""One thread per registered pipeline: runs queued batches and writes outputs into the pool.

The executor keeps up to ``prefetch_queue_depth`` batches inside DALI so that decoding of the
next batch overlaps the copy-out of the previous one. A batch keeps its input frames until its
outputs are collected, because external_source with ``no_copy=True`` reads them in place.

CPU outputs go to the job's shared-memory pool; on a GPU daemon, GPU outputs go to its device
pool, copied on the job's stream and followed by one interprocess event per batch (Note [GPU
output lifetime] in ``cuda.py``).
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dalid.protocol import (
    BatchFailed,
    BatchReady,
    ErrorCode,
    Message,
    OutputDescriptor,
    SubmitBatch,
)

from .cuda import CudaBackend, CudaSlab
from .pool import PoolClosed, PoolTooSmall, Region, RegionPool
from .runner import PipelineBuildError, PipelineRunner, PipelineSpec, sample_arrays

log = logging.getLogger("dalid.server")


@dataclass
class PendingBatch:
    batch_id: int
    request: SubmitBatch
    arrays: dict[str, list[np.ndarray]] = field(default_factory=dict)


class BatchFailure(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _dtype_name(dali_dtype: Any) -> str:
    from nvidia.dali.types import to_numpy_type

    return np.dtype(to_numpy_type(dali_dtype)).name


class PipelineExecutor:
    """Builds one pipeline and runs its batches, in a thread of its own.

    Building happens in that thread too, so a slow build never holds up the daemon's other
    jobs: ``make_runner`` builds it, and ``on_built`` receives the built pipeline's spec, or the
    PipelineBuildError, once it is done; ``spec`` is None until then. ``deliver`` sends batch
    results. ``gpu_pool`` and ``cuda`` (a GPU daemon's) take the GPU outputs.
    """

    def __init__(
        self,
        pipeline_id: int,
        make_runner: Callable[[], PipelineRunner],
        *,
        pool: RegionPool,
        deliver: Callable[[Message], None],
        on_built: Callable[[PipelineSpec | PipelineBuildError], None],
        gpu_pool: RegionPool | None = None,
        cuda: CudaBackend | None = None,
    ) -> None:
        self.pipeline_id = pipeline_id
        self.spec: PipelineSpec | None = None
        self._make_runner = make_runner
        self.runner: PipelineRunner | None = None
        self.failed = False
        self._pool = pool
        self._gpu_pool = gpu_pool
        self._cuda = cuda
        self._stream: int | None = None
        self._deliver = deliver
        self._on_built = on_built
        self._queue: queue.Queue[PendingBatch | None] = queue.Queue()
        self._stopping = threading.Event()
        self.batches_done = 0
        self.samples_done = 0
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
        if self._cuda is not None and runner.spec.exec_dynamic:
            # The default executor hands outputs over on our stream, without a host sync.
            self._stream = self._cuda.stream
        self.runner = runner
        self.spec = runner.spec
        self._on_built(runner.spec)
        try:
            self._loop(runner)
        finally:
            runner.close()

    def _loop(self, runner: PipelineRunner) -> None:
        in_flight: collections.deque[PendingBatch] = collections.deque()
        retry: collections.deque[PendingBatch] = collections.deque()
        depth = runner.spec.prefetch_queue_depth

        def start_over(failed: PendingBatch, code: ErrorCode, error: Exception) -> None:
            # After a failure the DALI pipeline is dead: fail this batch, rebuild, and run the
            # batches that were inside the old pipeline again, in their order.
            self._fail(failed, code, _dali_message(error))
            retry.extendleft(reversed(in_flight))
            in_flight.clear()
            runner.rebuild()

        try:
            while not self._stopping.is_set():
                while len(in_flight) < depth:
                    batch = self._next_batch(retry, block=not in_flight)
                    if batch is None:
                        break
                    try:
                        self._schedule(runner, batch)
                    except Exception as error:
                        start_over(batch, ErrorCode.INVALID_BATCH, error)
                        continue
                    in_flight.append(batch)
                if self._stopping.is_set() or not in_flight:
                    continue
                batch = in_flight.popleft()
                try:
                    outputs = runner.collect(self._stream)
                except Exception as error:
                    start_over(batch, ErrorCode.PIPELINE_ERROR, error)
                    continue
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

    @staticmethod
    def _schedule(runner: PipelineRunner, batch: PendingBatch) -> None:
        if not batch.arrays:
            batch.arrays = {item.name: sample_arrays(item) for item in batch.request.inputs}
        runner.schedule(batch.arrays)

    def _write(self, batch: PendingBatch, outputs: tuple[Any, ...]) -> None:
        try:
            tensors = [self._dense(index, output) for index, output in enumerate(outputs)]
            on_gpu = [type(output).__name__ == "TensorListGPU" for output in outputs]
            shapes = [tuple(int(x) for x in tensor.shape()) for tensor in tensors]
            dtypes = [_dtype_name(output.dtype) for output in outputs]
            sizes = [
                math.prod(shape) * np.dtype(dtype).itemsize
                for shape, dtype in zip(shapes, dtypes, strict=True)
            ]
            regions = self._allocate(sizes, on_gpu)
            try:
                event = self._copy(regions, tensors, on_gpu)
            except Exception:
                self._release(regions)
                raise
            descriptors = [
                OutputDescriptor(
                    region_id=region.region_id,
                    slab=region.slab.name,
                    slab_size=region.slab.size,
                    offset=region.offset,
                    nbytes=region.nbytes,
                    dtype=dtype,
                    shape=shape,
                    layout=output.layout() or "",
                    device=region.slab.device,
                    # Exported: the daemon frees the slab only once the trainer unmapped it.
                    ipc_handle=region.slab.export() if isinstance(region.slab, CudaSlab) else "",
                )
                for region, output, shape, dtype in zip(
                    regions, outputs, shapes, dtypes, strict=True
                )
            ]
        except BatchFailure as failure:
            self._fail(batch, failure.code, str(failure))
            return
        self.batches_done += 1
        self.samples_done += batch.request.batch_size
        retired = self._pool.take_retired()
        if self._gpu_pool is not None:
            retired += self._gpu_pool.take_retired()
        # The regions are now leased to the trainer (Note [Output buffer lifetime]).
        self._deliver(
            BatchReady(
                batch.batch_id,
                self.pipeline_id,
                tuple(descriptors),
                retired_slabs=tuple(retired),
                event=event,
            )
        )

    def _dense(self, index: int, output: Any) -> Any:
        """The output as one tensor; a batch whose samples differ in shape cannot be one."""
        if not output.is_dense_tensor():
            shapes = output.shape()
            raise BatchFailure(
                ErrorCode.INVALID_OUTPUT,
                f"output {index} has samples of different shapes ({shapes[:4]}...): "
                "a batch is delivered as one tensor, so resize, crop or pad to one shape",
            )
        if type(output).__name__ == "TensorListGPU" and self._gpu_pool is None:
            raise BatchFailure(
                ErrorCode.INVALID_OUTPUT,
                f"output {index} is on the GPU, and this daemon delivers CPU outputs only",
            )
        return output.as_tensor()

    def _allocate(self, sizes: list[int], on_gpu: list[bool]) -> list[Region]:
        """One region per output, from the pool of its device; all or none."""
        cpu_sizes = [size for size, gpu in zip(sizes, on_gpu, strict=True) if not gpu]
        gpu_sizes = [size for size, gpu in zip(sizes, on_gpu, strict=True) if gpu]
        try:
            cpu = self._pool.allocate(cpu_sizes, cancelled=self._stopping.is_set)
            try:
                gpu = (
                    self._gpu_pool.allocate(gpu_sizes, cancelled=self._stopping.is_set)
                    if self._gpu_pool is not None and gpu_sizes
                    else []
                )
            except BaseException:
                self._pool.release([region.region_id for region in cpu])
                raise
        except PoolTooSmall as error:
            raise BatchFailure(ErrorCode.RESOURCE_EXHAUSTED, str(error)) from None
        cpu_left, gpu_left = iter(cpu), iter(gpu)
        return [next(gpu_left) if g else next(cpu_left) for g in on_gpu]

    def _release(self, regions: list[Region]) -> None:
        ids = [region.region_id for region in regions]
        unknown = self._pool.release(ids)
        if unknown and self._gpu_pool is not None:
            self._gpu_pool.release(unknown)

    def _copy(self, regions: list[Region], tensors: list[Any], on_gpu: list[bool]) -> str:
        """Copies every output into its region; the batch event's handle ("" without GPU)."""
        cuda = self._cuda
        if cuda is not None and self._stream is not None and not all(on_gpu):
            # CPU outputs that DALI copied from the GPU are ready in our stream's order only:
            # a host wait here, in the daemon, for pipelines with outputs on both devices.
            cuda.synchronize()
        for region, tensor in zip(regions, tensors, strict=True):
            if region.nbytes:
                region.slab.copy_into(region.offset, tensor)
        if cuda is None or not any(on_gpu):
            return ""
        event = cuda.record_batch()
        if self._stream is None:
            # The legacy executor reuses its output buffers once released, without regard to
            # our stream: let the copies finish first.
            cuda.synchronize()
        return event

    def _fail(self, batch: PendingBatch, code: ErrorCode, message: str) -> None:
        log.warning("pipeline %d batch %d failed: %s", self.pipeline_id, batch.batch_id, message)
        self._deliver(BatchFailed(batch.batch_id, self.pipeline_id, code, message))


def _dali_message(error: BaseException) -> str:
    """DALI's message without its C++ context lines and the lines it repeats."""
    lines: list[str] = []
    for line in str(error).strip().splitlines():
        if line.strip() and "C++ context" not in line and line not in lines:
            lines.append(line)
    return "\n".join(lines) or type(error).__name__
