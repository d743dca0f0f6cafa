"""GPU output memory of one job: CUDA IPC slabs, the job's stream, its events and the peers' fences.

A GPU daemon gives each job a :class:`CudaBackend` on its device: the slab backend of its CUDA
IPC store's pools (``cuda_store.py``), the non-blocking stream the executors' copies of DALI's
GPU outputs run on, the ring of interprocess batch events, and the release fences its trainer
(or, for a cohort, each member) sends. CuPy is imported only when a backend is made for a real
device (``cuda_api.CupyApi``), so a CPU daemon never needs CUDA.

Note [GPU output lifetime]
--------------------------
GPU regions follow Note [Output buffer lifetime], with what CUDA adds (SPEC.md, "Outputs",
rules 7 to 13; the trainer keeps its half in ``client/outputs/cuda.py``): a slab is one
``cudaMalloc``, exported once; a batch's copies run on the job's one stream and end with an
event of a ring of ``EVENT_RING``, created once, reused, never destroyed while the trainer may
open it; the job's stream waits for the trainer's release fence before the regions go back to
the pool; a slab the pool let go of is freed only once every peer that may map it reported it
unmapped, left it out of its goodbye's ``kept_slabs``, or is gone; the fences opened for a peer
are destroyed when its job ends. A cohort's backend keeps this per member.
docs/design/gpu-output-lifetime.md
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import numpy as np

from . import cuda_api
from .cuda_api import DeviceApi

log = logging.getLogger("dalid.server")

EVENT_RING = 32
"""Interprocess batch events per job, reused in turn (Note [GPU output lifetime])."""
MAX_PEER_EVENTS = 256
"""Release fences a trainer may have the daemon open; the client keeps at most 64."""
TRAINER = 0
"""The one peer of a job's backend: its trainer. A cohort's backend has one per member (its job
id: Note [Cohort outputs] in runs/cohorts.py)."""


class SlabState(Enum):
    """Where a slab is in its life (Note [GPU output lifetime]); each change is its backend's."""

    POOLED = "pooled"  # its pool carves regions from it
    AWAITING_PEERS = "awaiting peers"  # the pool let go of it; a peer may still map it
    KEPT = "kept"  # kept for good: a writer that could not be stopped may still write it
    FREED = "freed"


class CudaSlab:
    """One block of device memory, exported by its CUDA IPC handle.

    ``close()`` hands it back to its backend, which frees it now or, once exported, when the
    trainer reports it unmapped (Note [GPU output lifetime]). Idempotent. ``peers``:
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
        self.state = SlabState.POOLED

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
            if slab.state is not SlabState.POOLED:
                return
            if not free:
                slab.state = SlabState.KEPT
                self._slabs.pop(slab.name, None)
                self._kept = True
                return
            if slab.peers:
                # Freed by peer_closed(), or by close() once the trainers are gone.
                slab.state = SlabState.AWAITING_PEERS
                return
            slab.state = SlabState.FREED
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
                if slab.state is SlabState.AWAITING_PEERS and not slab.peers:
                    slab.state = SlabState.FREED
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
            return sum(1 for s in self._slabs.values() if s.state is SlabState.AWAITING_PEERS)

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
            slab.state = SlabState.FREED
            self._api.free(slab.ptr)
        if kept:
            log.warning("GPU output memory kept for a pipeline that could not be stopped")
            return
        for event in events:
            self._api.destroy_event(event)
        self._api.destroy_stream(self.stream)
