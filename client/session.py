"""A training job's session with a daemon: register pipelines, receive outputs as tensors."""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from dalid.protocol import (
    BatchFailed,
    BatchReady,
    Device,
    Envelope,
    Error,
    Limits,
    PipelineRegistered,
    RegisterPipeline,
    ReleaseRegions,
    Role,
    ScheduleBatch,
    parse_device,
    socket_path,
)

from .connection import Connection, no_daemon_message
from .cuda import CudaMappings, TorchDevice, local_device
from .errors import BatchError, DaemonUnavailable, DeviceMismatch, InputError
from .launcher import start_daemon
from .memory import SlabMappings
from .named import RepositoryPipeline
from .refs import DALIPipelineRunRef
from .structure import replace_refs
from .transform import Proxy, ProxyTarget, worker_links

log = logging.getLogger("dalid.client")

# A batch this late usually means the daemon's output pool is full of buffers the trainer still
# holds through live tensors; say so once.
SLOW_BATCH_WARNING_S = 30.0


class _Resources:
    """What a session owns, closed once, by ``Session.close`` or by a finalizer at GC.

    GPU outputs: ``cuda_index`` is the daemon's GPU as this process numbers it (None until
    known); ``cuda`` is made when the first GPU output arrives, so CPU users never touch CUDA.
    """

    def __init__(
        self, connection: Connection, mappings: SlabMappings, cuda_index: int | None
    ) -> None:
        self.connection = connection
        self.mappings = mappings
        self.cuda_index = cuda_index
        self.cuda: CudaMappings | None = None
        # Retired slabs of a GPU daemon to report unmapped, before any GPU output was mapped.
        self.never_mapped: list[str] = []

    def gpu(self) -> CudaMappings:
        if self.cuda is None:
            uuid = self.connection.welcome.device_uuid
            if not uuid:
                raise DeviceMismatch("the daemon sent a GPU output but named no GPU in its welcome")
            index = self.cuda_index if self.cuda_index is not None else local_device(uuid)
            self.cuda = CudaMappings(TorchDevice(index))
        return self.cuda

    def close(self) -> None:
        worker_links.close_job(self.connection.path, self.connection.welcome.job_id)
        # GPU slabs are unmapped before the goodbye, which names those tensors still view
        # (Note [GPU output lifetime] in dalid.server.cuda).
        kept = self.cuda.close_mappings() if self.cuda is not None else ()
        self.connection.close(kept_slabs=kept)
        self.mappings.close()
        if self.cuda is not None:
            self.cuda.close()


def _graph(pipeline: Any) -> Any:
    """The pipeline with its Python graph built, without building the pipeline itself.

    Building would need the pipeline's device in the trainer (a GPU pipeline needs CUDA there);
    the graph is all the client needs. DALI's own proxy reads the same private attributes.
    """
    if getattr(pipeline, "_deserialized", False):
        raise InputError(
            "the pipeline was deserialized, so its external_source names are unknown: pass the "
            "pipeline object built from its definition"
        )
    if not pipeline._py_graph_built:
        pipeline._build_graph()
    return pipeline


def external_source_names(pipeline: Any) -> list[str]:
    """The names of a pipeline's external_source operators, in definition order."""
    from nvidia.dali.external_source import ExternalSource

    return [op.name for op in _graph(pipeline)._ops if isinstance(op._op, ExternalSource)]


def output_count(pipeline: Any) -> int:
    """How many outputs the pipeline's graph returns."""
    return int(_graph(pipeline)._num_outputs)


def _check_pipeline(pipeline: Any) -> None:
    from nvidia.dali import Pipeline

    if not isinstance(pipeline, Pipeline):
        raise InputError(f"expected an NVIDIA DALI pipeline, got {type(pipeline).__name__}")


def pipeline_device(pipeline: Any) -> Device:
    """The device a pipeline was defined for: its device_id, or ``"cpu"`` when it has none."""
    _check_pipeline(pipeline)
    return "cpu" if pipeline.device_id is None else int(pipeline.device_id)


class Session:
    """A job connected to the daemon for one device. Use as a context manager or ``close()``.

    CPU outputs arrive as CPU tensors that view the daemon's shared memory. GPU outputs (from a
    daemon started with ``--device N``) arrive as CUDA tensors that view the daemon's device
    memory, on this process's device with the daemon GPU's UUID, ready in the order of the
    stream that was current when they were produced (it waits on the daemon, the host does
    not). Each region goes back to the daemon when the last tensor viewing it is
    garbage-collected; a GPU region once the work queued on that stream until then has run.
    """

    def __init__(
        self,
        device: Device = "cpu",
        socket: str | os.PathLike[str] | None = None,
        autostart: bool = True,
        name: str | None = None,
        connect_timeout: float = 60.0,
    ) -> None:
        self.device = parse_device(device)
        self.socket = socket_path(self.device, socket)
        # Results that arrived while waiting for another; filled by the connection. Neither it
        # nor the connection may hold the session itself, or the finalizer would never run.
        self._results: dict[int, BatchReady | BatchFailed] = {}
        connection = autostart_connect(
            self.socket,
            self.device,
            autostart=autostart,
            connect_timeout=connect_timeout,
            name=name or f"pid {os.getpid()}",
            on_push=functools.partial(_keep_result, self._results),
        )
        try:
            cuda_index = _daemon_gpu(connection.welcome.device_uuid)
        except DeviceMismatch:
            connection.close()
            raise
        self._resources = _Resources(connection, SlabMappings(), cuda_index)
        self._finalizer = weakref.finalize(self, self._resources.close)

    # --- properties -----------------------------------------------------------------------------

    @property
    def job_id(self) -> int:
        return self._resources.connection.welcome.job_id

    @property
    def daemon_pid(self) -> int:
        return self._resources.connection.welcome.daemon_pid

    @property
    def limits(self) -> Limits:
        return self._resources.connection.welcome.limits

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def slabs_opened(self) -> int:
        """How many slabs this session has mapped, CPU and GPU (each is mapped once)."""
        cuda = self._resources.cuda
        return self._resources.mappings.opened + (cuda.opened if cuda is not None else 0)

    @property
    def events_opened(self) -> int:
        """How many of the daemon's batch events this session has opened (each once)."""
        cuda = self._resources.cuda
        return cuda.events_opened if cuda is not None else 0

    @property
    def live_regions(self) -> int:
        """Output regions that tensors still view, CPU and GPU."""
        cuda = self._resources.cuda
        return self._resources.mappings.live_regions + (
            cuda.live_regions if cuda is not None else 0
        )

    # --- API ------------------------------------------------------------------------------------

    def proxy(self, pipeline: Any, deterministic: bool = False) -> Proxy:
        """Registers ``pipeline`` with the daemon and returns its picklable proxy callable.

        ``pipeline`` is a DALI pipeline, or a pipeline of the daemon's repository: a
        :class:`RepositoryPipeline` (``named_pipeline(name, batch_size=..., **parameters)``),
        or just its name. With ``deterministic`` a batch runs only when the trainer asks for
        its outputs, in the order the trainer asks, so random operators repeat run to run.
        """
        if isinstance(pipeline, str):
            pipeline = RepositoryPipeline(pipeline)
        if isinstance(pipeline, RepositoryPipeline):
            registered = self._connection.request(pipeline.request())
            assert isinstance(registered, PipelineRegistered)
            return self._proxy_for(registered, deterministic)
        _check_pipeline(pipeline)
        names = external_source_names(pipeline)
        if not names:
            raise InputError(
                "the pipeline has no external_source: dalid feeds pipelines through "
                "fn.external_source(name=...) inputs"
            )
        depth = pipeline.prefetch_queue_depth
        if isinstance(depth, dict):
            depth = max(depth.values())
        request = RegisterPipeline(
            serialized=memoryview(pipeline.serialize()),
            input_names=tuple(names),
            num_outputs=output_count(pipeline),
            max_batch_size=pipeline.max_batch_size,
            num_threads=pipeline.num_threads,
            prefetch_queue_depth=int(depth),
            seed=pipeline.seed,
            exec_dynamic=bool(pipeline.exec_dynamic),
            name=getattr(pipeline, "_name", None) or "",
        )
        reply = self._connection.request(request)
        assert isinstance(reply, PipelineRegistered)
        return self._proxy_for(reply, deterministic)

    def _proxy_for(self, registered: PipelineRegistered, deterministic: bool) -> Proxy:
        """The proxy of a pipeline as the daemon built it (names, outputs, batch size)."""
        welcome = self._connection.welcome
        return Proxy(
            ProxyTarget(
                socket=self.socket,
                device=self.device,
                job_id=welcome.job_id,
                job_token=welcome.job_token,
                pipeline_id=registered.pipeline_id,
                input_names=registered.input_names,
                num_outputs=registered.num_outputs,
                max_batch_size=registered.max_batch_size,
                deterministic=deterministic,
            )
        )

    def produce_data(self, obj: Any) -> Any:
        """``obj`` with every batch reference replaced by its tensor (nested structures too)."""
        return replace_refs(obj, self._outputs_of)

    def outputs(self, run: DALIPipelineRunRef) -> tuple[torch.Tensor, ...]:
        """The outputs of one batch, waiting for them (and scheduling it if deferred)."""
        return self._outputs_of([run])[id(run)]

    def close(self) -> None:
        """Ends the job: the daemon frees its pipelines; live tensors stay valid. Idempotent."""
        if self._finalizer.alive:
            self._flush_releases()
        self._finalizer()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"job {self.job_id}"
        return f"<dalid Session {self.socket} {state}>"

    # --- internals ------------------------------------------------------------------------------

    @property
    def _connection(self) -> Connection:
        if self.closed:
            raise DaemonUnavailable("this dalid session is closed")
        return self._resources.connection

    def _outputs_of(
        self, runs: Iterable[DALIPipelineRunRef]
    ) -> dict[int, tuple[torch.Tensor, ...]]:
        """Tensors for each run (keyed by ``id(run)``), in the order the runs are given."""
        runs = list(runs)
        for run in runs:
            if run.batch_id is None:
                raise InputError(
                    "a batch reference that was never submitted: collate the proxy's sample "
                    "references (torch's default collate does) before produce_data"
                )
            if run.job_id != self.job_id:
                raise InputError(
                    f"batch {run.batch_id} belongs to job {run.job_id}, not to this session's "
                    f"job {self.job_id}"
                )
        for run in runs:
            if not run.is_scheduled:
                self._connection.request(ScheduleBatch(run.batch_id))  # type: ignore[arg-type]
                run.is_scheduled = True
        produced: dict[int, tuple[torch.Tensor, ...]] = {}
        for run in runs:
            result = self._wait(run.batch_id)  # type: ignore[arg-type]
            if isinstance(result, BatchFailed):
                raise BatchError(result.code, result.message, result.batch_id, result.pipeline_id)
            self._retire(result.retired_slabs)
            produced[id(run)] = self._tensors(result)
        return produced

    def _tensors(self, result: BatchReady) -> tuple[torch.Tensor, ...]:
        resources = self._resources
        stream = None
        tensors = []
        for output in result.outputs:
            if output.device == "cpu":
                tensors.append(resources.mappings.tensor(output))
                continue
            cuda = resources.gpu()
            if stream is None:
                # Once per batch: the current stream waits for the daemon's copies.
                stream = cuda.begin_batch(result.event)
            tensors.append(cuda.tensor(output, stream))
        return tuple(tensors)

    def _retire(self, names: tuple[str, ...]) -> None:
        resources = self._resources
        resources.mappings.retire(names)
        if names and resources.connection.welcome.device_uuid:
            if resources.cuda is not None:
                resources.cuda.retire(names)
            else:
                resources.never_mapped.extend(names)

    def _wait(self, batch_id: int) -> BatchReady | BatchFailed:
        result = self._results.pop(batch_id, None)
        if result is not None:
            return result

        def is_result(envelope: Envelope) -> bool:
            message = envelope.message
            return isinstance(message, BatchReady | BatchFailed) and message.batch_id == batch_id

        started = time.monotonic()
        warned = False

        def idle() -> None:
            nonlocal warned
            self._flush_releases()
            if not warned and time.monotonic() - started > SLOW_BATCH_WARNING_S:
                warned = True
                log.warning(
                    "batch %d has not arrived after %.0f s; this job still holds %d output "
                    "buffers through live tensors. If you keep outputs across steps, keep "
                    "copies (tensor.clone()) so the daemon can reuse its buffers.",
                    batch_id,
                    SLOW_BATCH_WARNING_S,
                    self.live_regions,
                )

        envelope = self._connection.receive_until(is_result, None, idle=idle)
        assert envelope is not None and isinstance(envelope.message, BatchReady | BatchFailed)
        return envelope.message

    def _flush_releases(self) -> None:
        resources = self._resources
        notify = resources.connection.notify
        released = resources.mappings.take_released()
        if released:
            notify(ReleaseRegions(tuple(released)))
        closed, resources.never_mapped = resources.never_mapped, []
        if resources.cuda is not None:
            # Each group comes with a fence on the stream its tensors were used on.
            for region_ids, fence in resources.cuda.take_released():
                notify(ReleaseRegions(region_ids, event=fence))
            closed += resources.cuda.take_closed()
        if closed:
            notify(ReleaseRegions(closed_slabs=tuple(closed)))


def _daemon_gpu(device_uuid: str) -> int | None:
    """The index of the daemon's GPU in this process, when the daemon runs on one and torch
    here has CUDA; None otherwise (a GPU output then raises when it arrives). Raises
    DeviceMismatch when this process cannot see that GPU."""
    if not device_uuid or not torch.cuda.is_available():
        return None
    return local_device(device_uuid)


def _keep_result(results: dict[int, BatchReady | BatchFailed], envelope: Envelope) -> None:
    """Keeps a batch result that arrived while the session waited for another."""
    message = envelope.message
    if isinstance(message, BatchReady | BatchFailed):
        results[message.batch_id] = message
    elif isinstance(message, Error):
        log.warning("dalid daemon: %s", message.message)


def autostart_connect(
    path: Path,
    device: Device,
    *,
    autostart: bool,
    connect_timeout: float,
    name: str,
    on_push: Any,
) -> Connection:
    """A trainer connection to the daemon on ``path``, starting one first if allowed."""
    if path.exists():
        try:
            return Connection(path, Role.TRAINER, device=device, name=name, on_push=on_push)
        except DaemonUnavailable:
            if not autostart:
                raise
            # A socket file no daemon answers on: a killed daemon's. A new one replaces it.
    elif not autostart:
        raise DaemonUnavailable(no_daemon_message(path, device))
    start_daemon(device, path, timeout=connect_timeout)
    return Connection(path, Role.TRAINER, device=device, name=name, on_push=on_push)
