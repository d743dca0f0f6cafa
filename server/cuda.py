"""GPU output memory: CUDA IPC slabs, the job's copy stream and its interprocess events.

A GPU daemon gives each job a :class:`CudaBackend` beside its shared-memory one: the job's GPU
:class:`~dalid.server.pool.RegionPool` carves output regions from its :class:`CudaSlab`\\ s, and
the executors copy DALI's GPU outputs into them on the backend's stream. CuPy is imported only
when a backend is made for a real device (:class:`CupyApi`), so a CPU daemon never needs CUDA.

Note [GPU output lifetime]
--------------------------
GPU regions follow Note [Output buffer lifetime] in ``pool.py`` (leases, backpressure, retiring
empty slabs); CUDA adds what follows. ``client/cuda.py`` keeps the trainer's half.

1. Memory. A slab is one ``cudaMalloc`` (not CuPy's memory pool: its arena must not be exported
   to another process, and a slab is freed exactly when this note says). Its IPC handle is taken
   once and travels, in hex, in every descriptor of its regions; the trainer opens each handle
   once per process (0.2-1.3 ms each: O(slabs), never O(batches)) and caches it by slab name.
2. Writing. Each job has one daemon-owned, non-blocking stream. DALI hands a batch's outputs over
   bound to that stream (``outputs(cuda_stream=...)``, no host synchronization), the executor
   copies them into their regions on it, then records one interprocess event on it and sends the
   event's handle in ``batch_ready``. The trainer makes its current stream wait on the event
   (``cudaStreamWaitEvent``, never a host sync) before it hands out the batch's tensors. The
   daemon's host waits for its stream in two cases only: before copying the CPU outputs of a
   pipeline with outputs on both devices (DALI's GPU-to-CPU outputs are ready in the stream's
   order), and with the legacy executor, before DALI may reuse the buffers copied from.
3. Event reuse. The batch events form a ring of ``EVENT_RING`` per job, created once, so each
   handle is opened once by the trainer and no event is destroyed while the trainer may still
   open it. Reusing one is safe: a wait binds to the event's most recent record at the time of
   the wait call; every record of the ring is on the same stream, so a later record marks a later
   point of that stream, which the earlier batch's copies precede. A trainer that waits after the
   daemon has recorded the same event again waits for a later batch's copies too: longer than
   needed (only when it lags ``EVENT_RING`` batches behind), never shorter.
4. Release. When the last tensor viewing a region dies, the trainer records an interprocess
   event (a *release fence*) on the stream the batch was delivered on, and sends its handle with
   ``release_regions``. The I/O thread makes the job's stream wait on it *before* the regions go
   back to the pool, so every later copy into them runs after the trainer's last use. Tensors
   used on other streams must be ordered before the delivery stream's later work, as torch asks
   of any tensor whose memory may be reused (``record_stream``).
5. Freeing. CUDA forbids freeing memory that another process still maps. A slab whose handle
   went out (``export``) and that the pool retires when empty waits until the trainer reports
   it unmapped (``release_regions.closed_slabs``); the trainer unmaps a retired slab once its
   own work on it has completed, and reports at once one it never mapped. Before its goodbye
   the trainer unmaps every slab no tensor views and names the others (``goodbye.kept_slabs``):
   the daemon frees all but those at once, and those when the trainer process exits (it watches
   the pid; where it cannot, they stay until the daemon exits).
6. Death. A trainer that dies unmaps everything with its process: its job's slabs are freed at
   once. A daemon that dies takes its allocations with it: unlike shared memory, GPU tensors it
   delivered are no longer valid, and the trainer's next wait raises DaemonUnavailable.
7. Events at the end. CUDA forbids using an opened event after its exporter destroyed it, so
   each side lets go of the other's events first: the trainer drops the batch events it opened
   before its goodbye, and keeps its release fences until the goodbye is answered; the daemon
   destroys the fences it opened when the job closes, and its ring with the job's last slab.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

log = logging.getLogger("dalid.server")

EVENT_RING = 32
"""Interprocess batch events per job (Note [GPU output lifetime], point 3)."""
MAX_PEER_EVENTS = 256
"""Release fences a trainer may have the daemon open; the client keeps at most 64."""


class DeviceApi(Protocol):
    """The CUDA calls a :class:`CudaBackend` makes: memory, one stream, interprocess events.

    :class:`CupyApi` makes them on a device; unit tests pass a fake, so the bookkeeping above
    runs without a GPU. Streams and events are raw handles (ints).
    """

    def malloc(self, size: int) -> int: ...

    def free(self, ptr: int) -> None: ...

    def export_memory(self, ptr: int) -> bytes: ...

    def create_stream(self) -> int: ...

    def destroy_stream(self, stream: int) -> None: ...

    def create_event(self) -> tuple[int, bytes]: ...

    def open_event(self, handle: bytes) -> int: ...

    def destroy_event(self, event: int) -> None: ...

    def record(self, event: int, stream: int) -> None: ...

    def wait(self, stream: int, event: int) -> None: ...

    def synchronize(self, stream: int) -> None: ...

    def copy(self, ptr: int, source: Any, stream: int) -> None: ...


class CupyApi:
    """:class:`DeviceApi` through CuPy's runtime bindings, on one device from any thread."""

    def __init__(self, device_id: int) -> None:
        import cupy

        self._device = cupy.cuda.Device(device_id)
        self._runtime = cupy.cuda.runtime

    def malloc(self, size: int) -> int:
        with self._device:
            return int(self._runtime.malloc(size))

    def free(self, ptr: int) -> None:
        # cudaFree waits for the device's pending work, the copies into this slab included.
        with self._device:
            self._runtime.free(ptr)

    def export_memory(self, ptr: int) -> bytes:
        with self._device:
            return bytes(self._runtime.ipcGetMemHandle(ptr))

    def create_stream(self) -> int:
        with self._device:
            return int(self._runtime.streamCreateWithFlags(self._runtime.streamNonBlocking))

    def destroy_stream(self, stream: int) -> None:
        # Returns at once; CUDA releases the stream when its pending work is done.
        with self._device:
            self._runtime.streamDestroy(stream)

    def create_event(self) -> tuple[int, bytes]:
        rt = self._runtime
        with self._device:
            event = int(rt.eventCreateWithFlags(rt.eventDisableTiming | rt.eventInterprocess))
            return event, bytes(rt.ipcGetEventHandle(event))

    def open_event(self, handle: bytes) -> int:
        with self._device:
            return int(self._runtime.ipcOpenEventHandle(handle))

    def destroy_event(self, event: int) -> None:
        with self._device:
            self._runtime.eventDestroy(event)

    def record(self, event: int, stream: int) -> None:
        with self._device:
            self._runtime.eventRecord(event, stream)

    def wait(self, stream: int, event: int) -> None:
        with self._device:
            self._runtime.streamWaitEvent(stream, event, 0)

    def synchronize(self, stream: int) -> None:
        with self._device:
            self._runtime.streamSynchronize(stream)

    def copy(self, ptr: int, source: Any, stream: int) -> None:
        """Copies a DALI GPU tensor to ``ptr``, asynchronously on ``stream``."""
        with self._device:
            # ctypes pointers: DALI takes them (a plain int address crashes its CPU twin).
            source.copy_to_external(
                ctypes.c_void_p(ptr), cuda_stream=ctypes.c_void_p(stream), non_blocking=True
            )


class CudaSlab:
    """One block of device memory, exported by its CUDA IPC handle.

    ``close()`` hands it back to its backend, which frees it now or, once exported, when the
    trainer reports it unmapped (Note [GPU output lifetime], point 5). Idempotent.
    """

    device = "cuda"

    def __init__(self, backend: CudaBackend, name: str, size: int, ptr: int, handle: str) -> None:
        self.name = name
        self.size = size
        self.ipc_handle = handle
        self._backend = backend
        self._ptr = ptr
        self.exported = False
        self.peer_closed = False
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
        """The IPC handle (hex) for a descriptor; from now on the trainer may map the slab."""
        self.exported = True
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
    """

    device = "cuda"

    def __init__(
        self, device_id: int, api: DeviceApi | None = None, ring_size: int = EVENT_RING
    ) -> None:
        self.device_id = device_id
        self._api: DeviceApi = api if api is not None else CupyApi(device_id)
        self._lock = threading.Lock()
        self.stream = self._api.create_stream()
        self._ring_size = ring_size
        self._ring: list[tuple[int, str]] = []  # (event, handle), created as first needed
        self._next_event = 0
        self._peer_events: dict[str, int] = {}
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

    def slab_closed(self, slab: CudaSlab, free: bool) -> None:
        """The pool let go of ``slab``: free it unless the trainer may still map it."""
        with self._lock:
            if slab.closed:
                return
            slab.closed = True
            if not free:
                self._slabs.pop(slab.name, None)
                self._kept = True
                return
            if slab.exported and not slab.peer_closed:
                return  # freed by peer_closed(), or by close() once the trainer is gone
            self._slabs.pop(slab.name, None)
        self._api.free(slab.ptr)

    def peer_closed(self, names: tuple[str, ...] | list[str]) -> None:
        """The trainer unmapped these slabs: free those the pool has let go of already."""
        self._peer_closed(lambda name: name in names)

    def peer_kept(self, names: tuple[str, ...] | list[str]) -> None:
        """The trainer, leaving, still maps these slabs and has unmapped every other one."""
        self._peer_closed(lambda name: name not in names)

    def _peer_closed(self, unmapped: Callable[[str], bool]) -> None:
        freed = []
        with self._lock:
            for name, slab in list(self._slabs.items()):
                if not unmapped(name):
                    continue
                slab.peer_closed = True
                if slab.closed:
                    freed.append(self._slabs.pop(name))
        for slab in freed:
            self._api.free(slab.ptr)

    @property
    def awaiting_peer(self) -> int:
        """Slabs the pool has let go of that the trainer still maps."""
        with self._lock:
            return sum(1 for slab in self._slabs.values() if slab.closed)

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

    def wait_for_peer(self, handle: str) -> None:
        """Later work on the stream waits for the trainer's release fence ``handle`` (hex)."""
        with self._lock:
            event = self._peer_events.get(handle)
            if event is None:
                if len(self._peer_events) >= MAX_PEER_EVENTS:
                    raise ValueError(
                        f"the trainer has sent more than {MAX_PEER_EVENTS} different release "
                        "events; reuse them once they complete"
                    )
                event = self._api.open_event(bytes.fromhex(handle))
                self._peer_events[handle] = event
            self._api.wait(self.stream, event)

    def synchronize(self) -> None:
        """Waits on the host until the work queued on the stream so far is done."""
        self._api.synchronize(self.stream)

    def forget_peer_events(self) -> None:
        """The job has ended: destroys the trainer's release fences opened here, while the
        trainer still has them (waits already queued on the stream stay valid)."""
        with self._lock:
            events, self._peer_events = list(self._peer_events.values()), {}
        for event in events:
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
            events = [event for event, _ in self._ring] + list(self._peer_events.values())
            self._ring, self._peer_events = [], {}
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
