"""GPU outputs: CUDA IPC slabs, the job's copy stream and its interprocess events.

A GPU daemon gives each job a :class:`CudaStore` beside its shared-memory one (the output
stores of ``outputs.py``): its :class:`~dalid.server.outputs.pool.RegionPool` carves output regions
from :class:`CudaSlab`\\ s of the job's :class:`CudaBackend`, and the executors' copies of DALI's
GPU outputs go into them on the backend's stream. CuPy is imported only when a backend is made for a
real device (:class:`CupyApi`), so a CPU daemon never needs CUDA.

Why one module of some 580 lines: the note below and the code that keeps it (slabs, the job's
stream, its event ring, the peers' fences, the copy memory and, for a cohort, a peer per member)
read best together.

Note [GPU output lifetime]
--------------------------
GPU regions follow Note [Output buffer lifetime] in ``pool.py``; the contract both sides keep is
SPEC.md, "Outputs", rules 7 to 13 (the trainer keeps its half in ``client/outputs/cuda.py``).
How the daemon keeps what CUDA adds:

1. Memory (rule 8). A slab is one ``cudaMalloc`` (not CuPy's memory pool: its arena must not be
   exported to another process, and a slab is freed exactly when this note says). Its IPC handle
   is taken once and sent, in hex, in every descriptor of its regions.
2. Writing (rule 9). Each job has one daemon-owned, non-blocking stream. DALI hands a batch's
   outputs over bound to that stream (``outputs(cuda_stream=...)``, no host synchronization), the
   store copies them into their regions on it, then records one interprocess event on it. The
   daemon's host waits for its stream in two cases only: before copying the CPU outputs of a
   pipeline with outputs on both devices (DALI's GPU-to-CPU outputs are ready in the stream's
   order), and with the legacy executor, before DALI may reuse the buffers copied from.
3. Event reuse (rule 9). The batch events form a ring of ``EVENT_RING`` per job, created once, so
   each handle is opened once by the trainer and no event is destroyed while the trainer may
   still open it. Reusing one is safe: a wait binds to the event's most recent record at the time
   of the wait call; every record of the ring is on the same stream, so a later record marks a
   later point of that stream, which the earlier batch's copies precede.
4. Release (rule 10). The I/O thread makes the job's stream wait on the trainer's release fence
   *before* the regions go back to the pool, so every later copy into them runs after the
   trainer's last use. It opens each fence handle once and at most ``MAX_PEER_EVENTS`` of them.
5. Freeing (rule 11). A slab whose handle went out (``export``) and that the pool lets go of
   waits until the trainer reports it unmapped (``closed_slabs``), or, at the end of the job,
   until the trainer's goodbye leaves it out of ``kept_slabs``; slabs it keeps are freed when its
   process exits (the core keeps the job's outputs until then; where it cannot watch the pid,
   until the daemon exits).
6. Death (rule 13). A trainer that dies unmaps everything with its process: its job's slabs are
   freed at once.
7. Events at the end (rule 12). The daemon destroys the fences it opened when the job closes,
   while the trainer still has them, and its ring with the job's last slab.
8. A cohort's store (``for_members``) keeps these points with a peer per member instead of one
   trainer: a slab is mapped by each member given its regions (``give``), so point 5 waits for
   each of them, and point 6 is a member's; point 4 opens and bounds each member's fences
   apart, and point 7 destroys a member's when it is gone (Note [Cohort outputs] in
   runs/cohorts.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from dalid.protocol import Limits, OutputDescriptor

from . import cuda_api
from .copies import COPY_BATCHES, DeviceCopies
from .cuda_api import DeviceApi
from .job_outputs import (
    JobOutputs,
    OutputsFactory,
    ReleaseRefused,
    RunOutput,
    StreamFactory,
    region_ids,
)
from .pool import PoolFull, PoolTooSmall, Region, RegionPool, SlabUnavailable
from .shm import SharedMemoryStore

log = logging.getLogger("dalid.server")

EVENT_RING = 32
"""Interprocess batch events per job (Note [GPU output lifetime], point 3)."""
MAX_PEER_EVENTS = 256
"""Release fences a trainer may have the daemon open; the client keeps at most 64."""
TRAINER = 0
"""The one peer of a job's backend: its trainer. A cohort's backend has one per member (its job
id: Note [Cohort outputs] in runs/cohorts.py)."""


class CudaSlab:
    """One block of device memory, exported by its CUDA IPC handle.

    ``close()`` hands it back to its backend, which frees it now or, once exported, when the
    trainer reports it unmapped (Note [GPU output lifetime], point 5). Idempotent. ``peers``:
    the trainers that may map it (given its handle, not yet reported it unmapped).
    """

    device = "cuda"

    def __init__(self, backend: CudaBackend, name: str, size: int, ptr: int, handle: str) -> None:
        self.name = name
        self.size = size
        self.ipc_handle = handle
        self._backend = backend
        self._ptr = ptr
        self.peers: set[int] = set()
        self.closed = False

    @property
    def ptr(self) -> int:
        return self._ptr

    def address(self, offset: int) -> int:
        return self._ptr + offset

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        raise TypeError(f"slab {self.name} is GPU memory: it has no host view")

    def copy_into(self, offset: int, source: object) -> None:
        """Copies a DALI GPU tensor into the slab at ``offset``, on the job's stream."""
        self._backend.copy(self.address(offset), source)

    def export(self) -> str:
        """The IPC handle (hex) for a descriptor; from now on the trainer may map the slab
        (a cohort's: each member it is given to, ``CudaBackend.give``)."""
        self._backend.exported(self)
        return self.ipc_handle

    def close(self, unmap: bool = True) -> None:
        """Frees the slab (now or once the trainer unmapped it); ``unmap=False`` keeps the
        memory for good, for a writer that could not be stopped."""
        self._backend.slab_closed(self, free=unmap)


class CudaBackend:
    """GPU memory of one job on device ``device_id``: slabs, the stream that writes them, the
    batch events and the trainer's release fences. See Note [GPU output lifetime].

    Thread-safe: executors create slabs, copy and record from their threads; the I/O thread
    applies release fences and closed slabs.

    A job's backend has one peer, its trainer (``TRAINER``), which may map a slab once it is
    exported. A cohort's (``shared``) has one per member, named by the member's job id: a slab
    exported is mapped by the members it is given to (:meth:`give`), and is freed once each of
    them has unmapped it or is gone; their fences are opened and destroyed member by member.
    """

    device = "cuda"

    def __init__(
        self,
        device_id: int,
        api: DeviceApi | None = None,
        ring_size: int = EVENT_RING,
        *,
        shared: bool = False,
    ) -> None:
        self.device_id = device_id
        self.shared = shared
        self._api: DeviceApi = api if api is not None else cuda_api.CupyApi(device_id)
        self._lock = threading.Lock()
        self.stream = self._api.create_stream()
        self._ring_size = ring_size
        self._ring: list[tuple[int, str]] = []  # (event, handle), created as first needed
        self._next_event = 0
        self._peer_events: dict[int, dict[str, int]] = {}  # by peer, by handle
        self._private: list[int] = []  # see _private_event
        self._slabs: dict[str, CudaSlab] = {}  # every slab not yet freed
        self._kept = False  # a slab was kept for a writer that could not be stopped
        self.closed = False

    # --- slabs ------------------------------------------------------------------------------

    def create(self, name: str, size: int) -> CudaSlab:
        """A new slab of ``size`` bytes of device memory (``SlabBackend``)."""
        ptr = self._api.malloc(size)
        try:
            handle = self._api.export_memory(ptr).hex()
        except BaseException:
            self._api.free(ptr)
            raise
        slab = CudaSlab(self, name, size, ptr, handle)
        with self._lock:
            self._slabs[name] = slab
        return slab

    def exported(self, slab: CudaSlab) -> None:
        """``slab``'s handle goes out: a job's trainer may map it from now on."""
        if not self.shared:
            with self._lock:
                slab.peers.add(TRAINER)

    def give(self, peer: int, names: Sequence[str]) -> None:
        """A cohort's backend: member ``peer`` is given regions of these slabs, so may map
        them until it reports them unmapped or is gone."""
        with self._lock:
            for name in names:
                slab = self._slabs.get(name)
                if slab is not None:
                    slab.peers.add(peer)

    def slab_closed(self, slab: CudaSlab, free: bool) -> None:
        """The pool let go of ``slab``: free it unless a trainer may still map it."""
        with self._lock:
            if slab.closed:
                return
            slab.closed = True
            if not free:
                self._slabs.pop(slab.name, None)
                self._kept = True
                return
            if slab.peers:
                return  # freed by peer_closed(), or by close() once the trainers are gone
            self._slabs.pop(slab.name, None)
        self._api.free(slab.ptr)

    def peer_closed(self, names: Sequence[str], peer: int = TRAINER) -> None:
        """The trainer unmapped these slabs: free those the pool has let go of already."""
        self._peer_closed(peer, lambda name: name in names)

    def peer_kept(self, names: Sequence[str], peer: int = TRAINER) -> None:
        """The trainer, leaving, still maps these slabs and has unmapped every other one."""
        self._peer_closed(peer, lambda name: name not in names)

    def peer_gone(self, peer: int) -> None:
        """Member ``peer``'s process is gone (it mapped nothing any more) or its job ended:
        its slabs no longer wait for it, and the fences opened for it are destroyed."""
        self._peer_closed(peer, lambda name: True)
        self.forget_peer_events(peer)

    def _peer_closed(self, peer: int, unmapped: Callable[[str], bool]) -> None:
        freed = []
        with self._lock:
            for name, slab in list(self._slabs.items()):
                if not unmapped(name):
                    continue
                slab.peers.discard(peer)
                if slab.closed and not slab.peers:
                    freed.append(self._slabs.pop(name))
        for slab in freed:
            self._api.free(slab.ptr)

    def maps(self, peer: int) -> bool:
        """Whether ``peer`` may map a slab not yet freed."""
        with self._lock:
            return any(peer in slab.peers for slab in self._slabs.values())

    @property
    def awaiting_peer(self) -> int:
        """Slabs the pool has let go of that the trainer still maps."""
        with self._lock:
            return sum(1 for slab in self._slabs.values() if slab.closed)

    @property
    def api(self) -> DeviceApi:
        """The CUDA calls it makes (staged outputs share its device, stream and calls)."""
        return self._api

    # --- the stream ---------------------------------------------------------------------------

    def copy(self, ptr: int, source: Any) -> None:
        self._api.copy(ptr, source, self.stream)

    def record_batch(self) -> str:
        """Records the next event of the ring after the work queued so far; its handle (hex)."""
        with self._lock:
            if len(self._ring) < self._ring_size:
                event, handle = self._api.create_event()
                self._ring.append((event, handle.hex()))
            event, handle_hex = self._ring[self._next_event % self._ring_size]
            self._next_event += 1
            self._api.record(event, self.stream)
        return handle_hex

    def wait_for_peer(self, handle: str, peer: int = TRAINER) -> None:
        """Later work on the stream waits for the trainer's release fence ``handle`` (hex)."""
        with self._lock:
            events = self._peer_events.setdefault(peer, {})
            event = events.get(handle)
            if event is None:
                if len(events) >= MAX_PEER_EVENTS:
                    raise ValueError(
                        f"the trainer has sent more than {MAX_PEER_EVENTS} different release "
                        "events; reuse them once they complete"
                    )
                event = self._api.open_event(bytes.fromhex(handle))
                events[handle] = event
            self._api.wait(self.stream, event)

    def synchronize(self, stream: int | None = None) -> None:
        """Waits on the host until the work queued so far on the job's stream (or ``stream``)
        is done."""
        self._api.synchronize(self.stream if stream is None else stream)

    def read(self, ptr: int, nbytes: int) -> np.ndarray:
        """``nbytes`` of device memory at ``ptr`` in a new host buffer, once the work queued on
        the job's stream so far is done (a host wait: a private copy's bytes)."""
        buffer = np.empty(nbytes, dtype=np.uint8)
        if nbytes:
            self._api.copy_to_host(buffer.ctypes.data, ptr, nbytes, self.stream)
            self._api.synchronize(self.stream)
        return buffer

    def copy_range(self, ptr: int, source: int, nbytes: int) -> None:
        """Copies ``nbytes`` of device memory at ``source`` to ``ptr`` on the job's stream."""
        self._api.copy_range(ptr, source, nbytes, self.stream)

    def follow(self, source: int) -> None:
        """Work queued on the job's stream from now on waits for what ``source`` has queued."""
        with self._lock:
            self._api.record(self._private_event(0), source)
            self._api.wait(self.stream, self._private_event(0))

    def lead(self, source: int) -> None:
        """Work queued on ``source`` from now on waits for what the job's stream has queued."""
        with self._lock:
            self._api.record(self._private_event(1), self.stream)
            self._api.wait(source, self._private_event(1))

    def _private_event(self, which: int) -> int:
        """One of the two events that order the job's stream and a shared pipeline's; reused
        (a wait binds to the event's latest record when it is queued). Under ``_lock``."""
        while len(self._private) <= which:
            self._private.append(self._api.create_private_event())
        return self._private[which]

    def forget_peer_events(self, peer: int | None = None) -> None:
        """The job (or member ``peer`` of a cohort) has ended: destroys the trainer's release
        fences opened here, while the trainer still has them (waits already queued on the
        stream stay valid)."""
        with self._lock:
            if peer is None:
                opened, self._peer_events = list(self._peer_events.values()), {}
            else:
                opened = [self._peer_events.pop(peer, {})]
        for event in [event for events in opened for event in events.values()]:
            self._api.destroy_event(event)

    # --- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        """Frees every slab left and destroys the stream and events. Idempotent.

        Call once the job's pool is closed and the trainer has unmapped its slabs or is gone.
        Where a slab was kept for a writer that could not be stopped, the stream and events are
        kept too, since that writer may still use them.
        """
        with self._lock:
            if self.closed:
                return
            self.closed = True
            slabs = list(self._slabs.values())
            self._slabs.clear()
            events = [event for event, _ in self._ring] + self._private
            events += [event for opened in self._peer_events.values() for event in opened.values()]
            self._ring, self._peer_events, self._private = [], {}, []
            kept = self._kept
        for slab in slabs:
            slab.closed = True
            self._api.free(slab.ptr)
        if kept:
            log.warning("GPU output memory kept for a pipeline that could not be stopped")
            return
        for event in events:
            self._api.destroy_event(event)
        self._api.destroy_stream(self.stream)


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

    # --- private copies left on the device (Note [Private copies], point 2, in copies.py) ---

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
        """Member ``peer``'s job ended: the fences opened for it go (point 7)."""
        self.backend.forget_peer_events(peer)

    @property
    def awaiting_peers(self) -> bool:
        """Whether slabs the pool let go of wait for a trainer that may still map them."""
        return self.backend.awaiting_peer > 0

    def close(self, unmap: bool) -> bool:
        self.pool.close(unmap=unmap)
        self.copy_pool.close(unmap=unmap)
        # The trainer still has its fences; destroy ours of them while it does (point 7).
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
