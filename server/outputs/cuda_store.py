"""A job's GPU outputs as an output store: regions of its CUDA IPC slabs, written on its stream.

:class:`CudaStore` is the output store (``store.py``) of a GPU daemon's job for DALI's GPU
outputs, over the job's :class:`~dalid.server.outputs.cuda.CudaBackend` (which keeps Note [GPU
output lifetime]); :class:`GpuOutputStore` is what it shares with the staged store
(``cuda_staged.py``). Also here: the output stores and pipeline streams of a GPU daemon.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from dalid.protocol import Limits, OutputDescriptor

from . import cuda_api
from .copies import COPY_BATCHES, DeviceCopies
from .cuda import TRAINER, CudaBackend, CudaSlab
from .cuda_api import DeviceApi
from .job_outputs import JobOutputs, OutputsFactory
from .pool import PoolFull, PoolTooSmall, Region, RegionPool, SlabUnavailable
from .run_output import RunOutput
from .shm import SharedMemoryStore
from .store import ReleaseRefused, StreamFactory, region_ids

log = logging.getLogger("dalid.server")


class GpuOutputStore:
    """What the stores of DALI's GPU outputs share, whatever memory they write into (device
    memory here, pinned shared memory in ``cuda_staged.py``): they take GPU outputs, and copy
    them on the job's stream, the :class:`CudaBackend`'s, after the pipeline's work."""

    backend: CudaBackend

    @property
    def stream(self) -> int | None:
        return self.backend.stream

    def holds(self, output: Any) -> bool:
        return type(output).__name__ == "TensorListGPU"

    def prepare(self, others: bool, source_stream: int | None) -> None:
        if source_stream is None:
            return
        if others:
            # CPU outputs that DALI copied from the GPU are ready in the source stream's order
            # only: a host wait here, in the daemon, for pipelines with outputs on both devices.
            self.backend.synchronize(source_stream)
        if source_stream != self.backend.stream:
            # A shared pipeline's outputs are ready on its own stream: ours waits for them.
            self.backend.follow(source_stream)


class CudaStore(GpuOutputStore):
    """A job's GPU outputs: regions of its :class:`CudaBackend`'s slabs, written on its stream
    and released after the trainer's fences (Note [GPU output lifetime]).

    Its ``copy_pool`` is the job's copy memory: slabs of the same backend, outside the job's
    pool, where private copies of GPU outputs stay on the device (Note [Private copies] in
    copies.py); its regions follow the same note as the pool's.
    """

    device = "cuda"
    takes = "cuda"
    peer_ordered = True

    def __init__(
        self, name_prefix: str, limits: Limits, ids: Iterator[int], backend: CudaBackend
    ) -> None:
        self.backend = backend
        # What another store of the job's GPU outputs needs to take this one's place.
        self.name_prefix, self.limits, self.ids = name_prefix, limits, ids
        self.pool = RegionPool(
            backend, f"{name_prefix}-cuda", limits.pool_bytes, limits.slab_bytes, region_ids=ids
        )
        # Sized by the batches it holds once one needs it (``copy_regions``).
        self.copy_pool = RegionPool(backend, f"{name_prefix}-cudacopy", 0, 0, region_ids=ids)

    def write(self, region: Region, output: RunOutput, rows: range) -> None:
        dense = output.dense()
        address = region.slab.address(region.offset)
        if dense is not None and rows == output.whole:
            region.slab.copy_into(region.offset, dense)
        elif dense is not None:
            # A job's rows of a shared run: one contiguous block of the run's output.
            start = dense.data_ptr() + rows.start * output.row_bytes(rows)
            self.backend.copy_range(address, start, region.nbytes)
        else:
            for row in rows:
                self.backend.copy(address, output.tensors[row])
                address += output.row_bytes(rows)

    # --- private copies left on the device (Note [Private copies] in copies.py) ----------

    def copy_regions(self, sizes: Sequence[int]) -> list[Region] | None:
        self.copy_pool.hold_sets(sizes, COPY_BATCHES)
        try:
            return self.copy_pool.allocate(sizes, give_up_after=0.0)
        except (PoolFull, PoolTooSmall, SlabUnavailable):
            return None  # no room now, or no device memory: the copy goes through the host

    def write_copies(
        self,
        regions: Sequence[Region],
        outputs: Sequence[Any],
        rows: range,
        others: bool,
        source_stream: int | None,
    ) -> str:
        self.prepare(others, source_stream)
        for region, output in zip(regions, outputs, strict=True):
            if region.nbytes:
                self.write(region, output, rows)
        return self.finish(True, source_stream)

    def copy_from(self, source: DeviceCopies, copies: Sequence[tuple[Region, int]]) -> str:
        theirs = source.stream
        assert theirs is not None
        # After the run that wrote them (its event was recorded on that stream), with no host
        # wait; and the source's later writes into those regions after these copies.
        self.backend.follow(theirs)
        for region, address in copies:
            if region.nbytes:
                self.backend.copy_range(region.slab.address(region.offset), address, region.nbytes)
        event = self.backend.record_batch()
        self.backend.lead(theirs)
        return event

    def export(self, region: Region) -> str:
        slab = region.slab
        assert isinstance(slab, CudaSlab)
        # Exported: the daemon frees the slab only once the trainer unmapped it.
        return slab.export()

    def read(self, address: int, nbytes: int) -> np.ndarray:
        return self.backend.read(address, nbytes)

    def finish(self, wrote: bool, source_stream: int | None) -> str:
        if not wrote:
            return ""
        event = self.backend.record_batch()
        if source_stream is None:
            # The legacy executor reuses its output buffers once released, without regard to
            # our stream: let the copies finish first.
            self.backend.synchronize()
        elif source_stream != self.backend.stream:
            # DALI may reuse the buffers we copied from once its stream moves on: not before
            # our copies are done.
            self.backend.lead(source_stream)
        return event

    def fence(self, event: str, peer: int = TRAINER) -> None:
        try:
            self.backend.wait_for_peer(event, peer)
        except Exception as error:
            raise ReleaseRefused(f"the release event cannot be used: {error}") from None

    def peer_unmapped(self, slabs: Sequence[str], peer: int = TRAINER) -> None:
        self.backend.peer_closed(slabs, peer)

    def peer_leaving(self, kept: Sequence[str], peer: int = TRAINER) -> None:
        self.backend.peer_kept(kept, peer)

    # --- a cohort's store: its members are its peers (Note [Cohort outputs] in cohorts.py) ---

    def for_members(self) -> None:
        """Makes this a cohort's store, before it made a slab: each slab is mapped by the
        members given its regions (:meth:`give`), named by their job ids, not by one trainer."""
        if self.pool.slab_count:
            raise ValueError("a store becomes a cohort's before it makes a slab")
        self.backend.shared = True

    def give(self, peer: int, regions: Sequence[OutputDescriptor]) -> None:
        """Member ``peer`` is given these regions (descriptors of this store's): it may map
        their slabs from now on, until it reports them unmapped or is gone."""
        self.backend.give(peer, [d.slab for d in regions if d.device == self.device])

    def peer_gone(self, peer: int) -> None:
        """Member ``peer`` maps nothing of this store any more (its process is gone)."""
        self.backend.peer_gone(peer)

    def maps(self, peer: int) -> bool:
        """Whether member ``peer`` may still map a slab of this store."""
        return self.backend.maps(peer)

    def forget_fences(self, peer: int) -> None:
        """Member ``peer``'s job ended: the fences opened for it go (Note [GPU output lifetime])."""
        self.backend.forget_peer_events(peer)

    @property
    def awaiting_peers(self) -> bool:
        """Whether slabs the pool let go of wait for a trainer that may still map them."""
        return self.backend.awaiting_peer > 0

    def close(self, unmap: bool) -> bool:
        self.pool.close(unmap=unmap)
        self.copy_pool.close(unmap=unmap)
        # The trainer still has its fences; destroy ours of them while it does.
        self.backend.forget_peer_events()
        return self.backend.awaiting_peer > 0

    def free(self) -> None:
        try:
            self.backend.close()
        except Exception:
            log.exception("freeing GPU output memory failed")


def device_outputs(device_id: int, api: DeviceApi | None = None) -> OutputsFactory:
    """Output stores of a GPU daemon: shared memory for CPU outputs, device memory of GPU
    ``device_id`` for GPU outputs (``api``: the CUDA calls; CuPy's by default)."""

    def outputs(name_prefix: str, limits: Limits) -> JobOutputs:
        ids = region_ids()
        gpu = CudaStore(name_prefix, limits, ids, CudaBackend(device_id, api=api))
        return JobOutputs([SharedMemoryStore(name_prefix, limits, ids), gpu], on_device=gpu)

    return outputs


class PipelineStream:
    """A non-blocking stream of GPU ``device_id`` that a shared pipeline hands its outputs over
    on (``outputs.Stream``). ``close()`` destroys it; idempotent."""

    def __init__(self, api: DeviceApi) -> None:
        self._api = api
        self.handle = api.create_stream()
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._api.destroy_stream(self.handle)


def device_streams(device_id: int, api: DeviceApi | None = None) -> StreamFactory:
    """Streams of GPU ``device_id`` for shared pipelines (``api``: CuPy's calls by default)."""

    def stream() -> PipelineStream:
        return PipelineStream(api if api is not None else cuda_api.CupyApi(device_id))

    return stream
