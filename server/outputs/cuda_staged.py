"""GPU outputs for a trainer that cannot open the daemon's memory: staged in shared memory.

CUDA IPC does not work everywhere: MIG instances do not support it, a trainer in another PID
namespace than the daemon (a container without ``--pid=host``) cannot open the daemon's handles,
and a trainer cannot map memory of a GPU it does not see. The handshake finds out: a GPU
daemon's welcome carries the IPC handle of a small probe buffer (:class:`IpcProbe`); the trainer
opens it, reads it back and says whether it could (``ipc_probe_result``); :class:`OutputPaths`
chooses the job's output path and answers ``output_path``. For a job that cannot use CUDA IPC,
:class:`StagedStore` takes the place of its CUDA IPC store (``cuda.py``): it copies each GPU
output from the device into page-locked shared memory and delivers descriptors of device
``staged``, which the trainer uploads to its own GPU on its current stream
(``client/outputs/cuda_staged.py``).

Note [Staged GPU outputs]
-------------------------
SPEC.md, "Outputs", rules 14 to 17; the trainer keeps its half in
``client/outputs/cuda_staged.py``. Staged slabs are shared-memory segments, page-locked once when
made and unregistered before they are unmapped. A batch's copies run on the job's stream after
the pipeline's, and the store waits for them on its host before the batch is delivered: the
trainer reads host memory and has no event of the daemon's to wait on. The trainer releases a
region, with no fence, once its upload has completed; the rest is Note [Output buffer lifetime].
docs/design/gpu-output-lifetime.md
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from enum import StrEnum
from typing import Any, Protocol

import numpy as np

from dalid.protocol import ErrorCode, IpcProbeResult, Limits, OutputPath

from ..errors import RequestRefused
from . import cuda_api
from .copies import host_copy
from .cuda import CudaBackend
from .cuda_api import DeviceApi
from .cuda_store import CudaStore, GpuOutputStore
from .job_outputs import JobOutputs
from .pool import Growth, Region, RegionPool
from .run_output import RunOutput
from .shm import SharedMemorySlab
from .store import OutputRoute, ReleaseRefused

log = logging.getLogger("dalid.server")


class GpuOutputMode(StrEnum):
    """How a GPU daemon delivers GPU outputs (``dalid serve --gpu-outputs``)."""

    AUTO = "auto"  # CUDA IPC where the trainer can open the daemon's memory, staged elsewhere
    IPC = "ipc"  # CUDA IPC only: a trainer that cannot open it is refused at connect
    STAGED = "staged"  # every job staged: where CUDA IPC is known not to work, and in tests


GPU_OUTPUT_MODES = tuple(mode.value for mode in GpuOutputMode)
"""The names of the :class:`GpuOutputMode` values, in their order."""

STAGING_COST = (
    "each batch is copied from the GPU into shared memory by the daemon and uploaded to the GPU "
    "by the trainer: two PCIe copies (some 3 ms each for 77 MB, a batch of 256 224x224 float16 "
    "images) and a host wait in the daemon, where CUDA IPC costs none"
)


class PinnedSlab(SharedMemorySlab):
    """A shared-memory slab page-locked for the device-to-host copies of ``api`` on ``stream``.

    ``close()`` waits for copies still queued into it (a batch whose writing failed half-way)
    and unregisters it before unmapping it. Idempotent.
    """

    def __init__(self, name: str, size: int, api: DeviceApi, stream: int) -> None:
        super().__init__(name, size)
        self._api = api
        self._stream = stream
        self.pinned = False
        try:
            api.register_host(self.address(0), size)
        except Exception as error:
            # Pageable memory still works: the copies into it are slower and synchronous.
            log.warning("cannot page-lock staged output memory %s: %s", name, error)
        else:
            self.pinned = True

    def copy_into(self, offset: int, source: Any) -> None:
        raise TypeError(f"slab {self.name} is written by device-to-host copies of its store")

    def close(self, unmap: bool = True) -> None:
        if self.pinned and unmap:
            self.pinned = False
            self._api.synchronize(self._stream)
            self._api.unregister_host(self.address(0))
        super().close(unmap)


class PinnedSlabs:
    """Makes the :class:`PinnedSlab`\\ s of one job's staged outputs (a ``SlabBackend``)."""

    def __init__(self, backend: CudaBackend) -> None:
        self._backend = backend

    def create(self, name: str, size: int) -> PinnedSlab:
        return PinnedSlab(name, size, self._backend.api, self._backend.stream)


class StagedStore(GpuOutputStore):
    """A job's GPU outputs staged in page-locked shared memory for a trainer that uploads them
    (Note [Staged GPU outputs]). Its :class:`CudaBackend` gives it the job's stream."""

    device = "staged"
    takes = "cuda"
    peer_ordered = False

    def __init__(
        self, name_prefix: str, limits: Limits, ids: Iterator[int], backend: CudaBackend
    ) -> None:
        self.backend = backend
        self.pool = RegionPool(
            PinnedSlabs(backend),
            f"{name_prefix}-staged",
            limits.pool_bytes,
            limits.slab_bytes,
            region_ids=ids,
        )

    @classmethod
    def instead_of(cls, store: CudaStore) -> StagedStore:
        """The store to put in the place of a job's CUDA IPC ``store``, which made no slab."""
        # Its backend (the job's stream on the daemon's GPU) is this store's from now on.
        return cls(store.name_prefix, store.limits, store.ids, store.backend)

    def write(self, region: Region, output: RunOutput, rows: range) -> None:
        api, stream = self.backend.api, self.backend.stream
        address = region.slab.address(region.offset)
        dense = output.dense()
        if dense is not None:
            # The whole run, or a job's rows of a shared run: one contiguous block.
            start = dense.data_ptr() + rows.start * output.row_bytes(rows)
            api.copy_to_host(address, start, region.nbytes, stream)
            return
        row_bytes = output.row_bytes(rows)
        for row in rows:
            api.copy_to_host(address, output.tensors[row].data_ptr(), row_bytes, stream)
            address += row_bytes

    def export(self, region: Region) -> str:
        return ""  # the trainer maps the slab by its name

    def read(self, address: int, nbytes: int) -> np.ndarray:
        return host_copy(address, nbytes)

    def finish(self, wrote: bool, source_stream: int | None) -> str:
        if wrote:
            # Done before the batch is delivered (Note [Staged GPU outputs]).
            self.backend.synchronize()
        return ""

    def fence(self, event: str) -> None:
        raise ReleaseRefused("staged outputs take no release fence")

    def peer_unmapped(self, slabs: Sequence[str]) -> None:
        pass

    def peer_leaving(self, kept: Sequence[str]) -> None:
        pass

    def close(self, unmap: bool) -> bool:
        # A trainer that still maps a segment keeps its pages on its own (POSIX semantics).
        self.pool.close(unmap=unmap)
        return False

    def free(self) -> None:
        self.pool.close()
        try:
            self.backend.close()
        except Exception:
            log.exception("freeing the stream of staged outputs failed")


PROBE_BYTES = 64
"""The probe buffer holds its own IPC handle (64 bytes)."""


class IpcProbe:
    """A small buffer of the daemon's GPU, exported by CUDA IPC, that holds the 64 bytes of its
    own handle: a trainer that opens the handle and reads them back knows it reaches the
    daemon's memory. ``close()`` frees it; idempotent."""

    def __init__(self, api: DeviceApi) -> None:
        self._api = api
        self._ptr: int | None = api.malloc(PROBE_BYTES)
        try:
            handle = api.export_memory(self._ptr)
            api.write(self._ptr, handle)
        except BaseException:
            api.free(self._ptr)
            raise
        self.handle = handle.hex()

    def close(self) -> None:
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            self._api.free(ptr)


class StagedJob(Protocol):
    """What choosing a job's output path reads and changes of the job (``jobs/jobs.py``'s
    ``Job``, in a stage above the outputs)."""

    @property
    def job_id(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def limits(self) -> Limits: ...
    @property
    def outputs(self) -> JobOutputs: ...
    @property
    def pipelines(self) -> Mapping[int, object]: ...


class HostMemory(Protocol):
    """The daemon's shared memory for outputs, that a staged pool grows within
    (``jobs/reservations.py``'s ``OutputMemory``)."""

    def growing(self, cap: int) -> Growth: ...


class OutputPaths:
    """How the jobs of a GPU daemon get their GPU outputs: by CUDA IPC or staged (``mode``, a
    :class:`GpuOutputMode` or its name), chosen for each job by its trainer's ``ipc_probe_result``.

    Owns the daemon's :class:`IpcProbe`; ``close()`` frees it. Where the probe cannot be made
    (the daemon's GPU cannot export CUDA IPC memory, as on a MIG instance), welcomes carry none
    and every job is staged (mode ``ipc``: the daemon does not start). A job whose trainer sends
    no result (an older client) keeps CUDA IPC, in every mode: it could not read staged outputs.
    """

    def __init__(self, device_id: int, mode: str = "auto", api: DeviceApi | None = None) -> None:
        if mode not in GPU_OUTPUT_MODES:
            raise ValueError(f"unknown GPU output mode {mode!r}: one of {GPU_OUTPUT_MODES}")
        self.mode = GpuOutputMode(mode)
        self._probe: IpcProbe | None = None
        # Why the daemon's own GPU has no CUDA IPC ("" where it has).
        self.no_ipc = ""
        try:
            self._probe = IpcProbe(api if api is not None else cuda_api.CupyApi(device_id))
        except Exception as error:
            if self.mode is GpuOutputMode.IPC:
                raise
            # A MIG instance, say: CUDA IPC memory cannot even be exported. Every job stages.
            self.no_ipc = f"the daemon's GPU cannot export CUDA IPC memory ({error})"
            log.warning("%s: every job's GPU outputs are staged", self.no_ipc)

    @property
    def probe(self) -> str:
        """The probe's IPC handle, in hex, for every welcome ("" where there is none)."""
        return self._probe.handle if self._probe is not None else ""

    def choose(self, job: StagedJob, result: IpcProbeResult, host_memory: HostMemory) -> OutputPath:
        """The output path of ``job`` given its trainer's ``result``, put in place; a staged
        pool grows within ``host_memory`` (``reservations.py``). Raises RequestRefused where
        the mode refuses it, or once the job registered a pipeline."""
        if result.opened and self.mode is not GpuOutputMode.STAGED and not self.no_ipc:
            log.info("job %d: GPU outputs by CUDA IPC", job.job_id)
            return OutputPath(OutputRoute.CUDA_IPC)
        why = self.no_ipc or result.reason or "no reason given"
        if self.mode is GpuOutputMode.IPC:
            raise RequestRefused(
                ErrorCode.DEVICE_MISMATCH,
                f"this process cannot open the daemon's GPU memory by CUDA IPC ({why}), and the "
                "daemon delivers GPU outputs by CUDA IPC only (--gpu-outputs ipc): restart it "
                "with --gpu-outputs auto to have them staged through shared memory",
            )
        if result.opened and not self.no_ipc:
            why = "the daemon stages every job's GPU outputs (--gpu-outputs staged)"
        if job.pipelines:
            raise RequestRefused(
                ErrorCode.MALFORMED_MESSAGE,
                "ipc_probe_result must come before the job registers a pipeline",
            )
        try:
            store = job.outputs.store("cuda")
        except KeyError:
            raise RequestRefused(
                ErrorCode.MALFORMED_MESSAGE, "the job's GPU outputs are staged already"
            ) from None
        assert isinstance(store, CudaStore)
        staged = StagedStore.instead_of(store)
        staged.pool.grow_within(host_memory.growing(job.limits.pool_bytes))
        job.outputs.replace("cuda", staged)
        # It made no slab; its backend went to the staged store, its reservation goes now.
        store.pool.close()
        log.warning("job %d (%s): GPU outputs staged: %s; %s", job.job_id, job.name or "?", why,
                    STAGING_COST)  # fmt: skip
        return OutputPath(OutputRoute.STAGED, why)

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
