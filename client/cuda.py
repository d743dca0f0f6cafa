"""The CUDA IPC output backend: GPU slabs opened once, regions as torch CUDA tensors.

See Note [GPU output lifetime] in ``dalid.server.cuda`` for the whole contract; this side keeps
its half:

- each slab's IPC handle is opened once per process (cached by slab name), and closed only once
  no tensor views the slab and the work queued on its streams has completed;
- each batch's event is opened once (cached by handle: the daemon reuses a small ring) and the
  current stream waits on it before the batch's tensors are handed out; no host sync;
- a region is released when the last tensor viewing it dies, with a release fence recorded on
  the stream it was delivered on, so the daemon writes it again only after that stream's work;
- slabs are reported unmapped so the daemon can free them (CUDA forbids freeing them earlier):
  retired ones as they are unmapped, and at the end all but those that tensors still view.

Only this module touches CUDA on the client, and only for a daemon on a GPU (its device is
opened with the first GPU output), so CPU-only users never need CUDA. :class:`TorchDevice`
makes the CUDA calls (through torch and CuPy); unit tests pass a fake one.

A little over 400 lines: the device calls, finding the daemon's GPU among this process's and
the backend's bookkeeping stay together as the one place the client touches CUDA.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from dalid.protocol import GpuUnavailable, OutputDescriptor, ReleaseRegions, gpu_uuid

from .copies import copied_tensor
from .errors import DeviceMismatch

MAX_FENCES = 64
"""Release fences kept by a session; the daemon accepts up to 256 (MAX_PEER_EVENTS)."""

StreamKey = tuple[int, int]


class Device(Protocol):
    """The CUDA calls :class:`CudaOutputs` makes; :class:`TorchDevice` on a real GPU."""

    def open_memory(self, handle: bytes) -> int: ...

    def close_memory(self, ptr: int) -> None: ...

    def current_stream(self) -> Any: ...

    def open_event(self, handle: bytes) -> Any: ...

    def wait(self, stream: Any, event: Any) -> None: ...

    def new_fence(self) -> Any: ...

    def record(self, event: Any, stream: Any) -> None: ...

    def fence_handle(self, event: Any) -> bytes: ...

    def marker(self, stream: Any) -> Any: ...

    def done(self, event: Any) -> bool: ...

    def synchronize(self, event: Any) -> None: ...

    def tensor(self, region: Any) -> torch.Tensor: ...

    def upload(self, host: torch.Tensor, stream: Any = None) -> torch.Tensor: ...


class TorchDevice:
    """:class:`Device` on CUDA device ``index`` of this process: memory handles through CuPy
    (torch has no public call for a foreign cudaIpcMemHandle), streams, events and the uploads of
    staged outputs (``cuda_staged.py``) through torch.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.torch_device = torch.device("cuda", index)

    @contextlib.contextmanager
    def _runtime(self) -> Iterator[Any]:
        """CuPy's runtime, with this device current meanwhile. CuPy is imported here: only IPC
        memory needs it, so a trainer that gets staged outputs does without it."""
        import cupy

        with cupy.cuda.Device(self.index):
            yield cupy.cuda.runtime

    def open_memory(self, handle: bytes) -> int:
        with self._runtime() as runtime:
            return int(runtime.ipcOpenMemHandle(handle))

    def close_memory(self, ptr: int) -> None:
        with self._runtime() as runtime:
            runtime.ipcCloseMemHandle(ptr)

    def read(self, ptr: int, nbytes: int) -> bytes:
        """``nbytes`` of device memory at ``ptr``, copied to the host (waits for the copy)."""
        buffer = ctypes.create_string_buffer(nbytes)
        with self._runtime() as runtime:
            runtime.memcpy(ctypes.addressof(buffer), ptr, nbytes, runtime.memcpyDeviceToHost)
        return buffer.raw

    def upload(self, host: torch.Tensor, stream: Any = None) -> torch.Tensor:
        """A copy of the CPU tensor ``host`` on this device, ordered on ``stream`` (default:
        the current stream), without a host wait where ``host`` is page-locked."""
        with torch.cuda.stream(stream if stream is not None else self.current_stream()):
            return host.to(self.torch_device, non_blocking=True)

    def pin(self, ptr: int, size: int) -> bool:
        """Page-locks host memory (``cudaHostRegister``); whether it could."""
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.index):
            return int(cudart.cudaHostRegister(ptr, size, 0)) == 0

    def unpin(self, ptr: int) -> None:
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.index):
            cudart.cudaHostUnregister(ptr)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.torch_device)

    def open_event(self, handle: bytes) -> Any:
        return torch.cuda.Event.from_ipc_handle(self.torch_device, handle)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def new_fence(self) -> Any:
        return torch.cuda.Event(interprocess=True)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def fence_handle(self, event: Any) -> bytes:
        return bytes(event.ipc_handle())

    def marker(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def tensor(self, region: Any) -> torch.Tensor:
        # torch keeps `region` alive for as long as any tensor shares this storage.
        return torch.as_tensor(region, device=self.torch_device)


def pick_device(daemon_uuid: str, uuids: Sequence[str], current: int) -> int:
    """The index among this process's devices (``uuids``) of the daemon's GPU: the current
    device if it is that GPU, else another one that is. Raises :class:`DeviceMismatch`."""
    if 0 <= current < len(uuids) and uuids[current] == daemon_uuid:
        return current
    for index, uuid in enumerate(uuids):
        if uuid == daemon_uuid:
            return index
    here = uuids[current] if 0 <= current < len(uuids) else "no GPU"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    raise DeviceMismatch(
        f"the dalid daemon runs on GPU {daemon_uuid}, which this process cannot see{where}: its "
        f"current device cuda:{current} is {here}, and it sees {len(uuids)} GPUs. GPU outputs "
        "stay on the daemon's GPU: connect to the daemon of your GPU (`dalid serve --device N` "
        "with N its ordinal as the daemon counts), or make the daemon's GPU visible"
    )


def local_device(daemon_uuid: str) -> int:
    """The torch device index of the daemon's GPU in this process (see :func:`pick_device`)."""
    if not torch.cuda.is_available():
        raise DeviceMismatch(
            f"the dalid daemon delivers outputs on GPU {daemon_uuid}, and torch in this process "
            "has no CUDA (torch.cuda.is_available() is False): use a CUDA build of torch, or "
            "move those outputs to the CPU in the pipeline (`.cpu()`)"
        )
    try:
        uuids = [gpu_uuid(index) for index in range(torch.cuda.device_count())]
    except GpuUnavailable as error:
        raise DeviceMismatch(f"cannot tell which GPU this process uses: {error}") from None
    return pick_device(daemon_uuid, uuids, torch.cuda.current_device())


class TorchDevices:
    """This process's CUDA devices as the GPU output backends open them, through torch. The one
    instance is :data:`DEVICES`, which the backends look up when they open a device, so that
    tests can put a simulated GPU in its place."""

    def available(self) -> bool:
        return torch.cuda.is_available()

    def local(self, daemon_uuid: str) -> int:
        """The index of the daemon's GPU here (see :func:`local_device`)."""
        return local_device(daemon_uuid)

    def current(self) -> int:
        return torch.cuda.current_device()

    def open(self, index: int) -> TorchDevice:
        return TorchDevice(index)


DEVICES = TorchDevices()


class _Region:
    """A region as ``__cuda_array_interface__``: the object torch keeps alive for a tensor."""

    __slots__ = ("__cuda_array_interface__", "__weakref__")

    def __init__(self, interface: dict[str, Any]) -> None:
        self.__cuda_array_interface__ = interface


@dataclass(eq=False)
class _Slab:
    name: str
    handle: str
    size: int
    ptr: int
    live: int = 0  # regions handed out, not yet released
    # The streams its regions were delivered on, whose work must end before it is unmapped.
    streams: dict[StreamKey, Any] = field(default_factory=dict)
    markers: list[Any] = field(default_factory=list)


def _key(stream: Any) -> StreamKey:
    return (int(stream.device_index), int(stream.cuda_stream))


class _Fences:
    """Interprocess release fences, reused once their last record has completed.

    Reusing only a completed fence keeps a late wait by the daemon correct: a wait binds to the
    most recent record, and the record it was meant for has completed before the new one.
    """

    def __init__(self, device: Device, limit: int = MAX_FENCES) -> None:
        self._device = device
        self._limit = limit
        self._fences: list[tuple[Any, str]] = []  # least recently recorded first

    def __len__(self) -> int:
        return len(self._fences)

    def record(self, stream: Any) -> str:
        """Records a fence on ``stream``; its handle (hex)."""
        device = self._device
        index = next((i for i, (fence, _) in enumerate(self._fences) if device.done(fence)), None)
        if index is None and len(self._fences) >= self._limit:
            index = 0  # all busy: wait for the oldest (a host wait, only under heavy backlog)
            device.synchronize(self._fences[0][0])
        if index is None:
            fence = device.new_fence()
            device.record(fence, stream)
            handle = device.fence_handle(fence).hex()
        else:
            fence, handle = self._fences.pop(index)
            device.record(fence, stream)
        self._fences.append((fence, handle))
        return handle

    def clear(self) -> None:
        self._fences.clear()


class CudaOutputs:
    """GPU outputs: the GPU slabs, batch events and release fences of one session in this
    process (an :class:`~dalid.client.outputs.OutputBackend`).

    ``open_device`` makes the :class:`Device` when the first GPU output arrives. Used from the
    session's thread; only the garbage collector's finalizers run elsewhere, and they only
    append to ``released``.
    """

    def __init__(self, open_device: Callable[[], Device]) -> None:
        self._open_device = open_device
        self._device: Device | None = None
        self._fences: _Fences | None = None
        self._pid = os.getpid()
        self._slabs: dict[str, _Slab] = {}
        self._regions: dict[int, tuple[_Slab, StreamKey]] = {}
        self._streams: dict[StreamKey, Any] = {}
        self._events: dict[str, Any] = {}
        self._retiring: list[_Slab] = []
        self._closed: list[str] = []
        # Region ids whose last tensor died; filled from any thread by GC, drained here.
        self.released: collections.deque[int] = collections.deque()
        self.opened = 0
        self.events_opened = 0
        self.handed_out = 0
        self._returned = 0

    @classmethod
    def for_daemon(cls, device_uuid: str) -> CudaOutputs:
        """The backend for the outputs of the daemon on GPU ``device_uuid``, on that GPU as this
        process numbers it. Raises :class:`DeviceMismatch` now where torch has CUDA and cannot
        see that GPU; where torch has no CUDA, when the first GPU output arrives."""
        devices = DEVICES
        index = devices.local(device_uuid) if devices.available() else None
        return cls(lambda: devices.open(devices.local(device_uuid) if index is None else index))

    @property
    def device(self) -> Device:
        if self._device is None:
            self._device = self._open_device()
            self._fences = _Fences(self._device)
        return self._device

    @property
    def live_regions(self) -> int:
        """Regions handed out as tensors that are not yet released."""
        return self.handed_out - self._returned - len(self.released)

    # --- receiving ----------------------------------------------------------------------------

    def wrap(self, outputs: Sequence[OutputDescriptor], event: str) -> list[torch.Tensor]:
        """CUDA tensors viewing the regions of one batch's ``outputs`` without a copy, ready in
        the order of the current stream: it waits for the batch's ``event`` (no host sync)."""
        stream = self._begin_batch(event)
        return [self._tensor(descriptor, stream) for descriptor in outputs]

    def copy(self, output: OutputDescriptor, frame: memoryview) -> torch.Tensor:
        return self.device.upload(copied_tensor(output, frame))

    def _begin_batch(self, event: str) -> Any:
        """Makes the current stream wait for the batch's event; that stream."""
        if not event:
            raise ValueError("a batch with GPU outputs came without its event")
        device = self.device
        opened = self._events.get(event)
        if opened is None:
            opened = device.open_event(bytes.fromhex(event))
            self._events[event] = opened
            self.events_opened += 1
        stream = device.current_stream()
        device.wait(stream, opened)
        return stream

    def _tensor(self, descriptor: OutputDescriptor, stream: Any) -> torch.Tensor:
        """A CUDA tensor viewing the region without a copy, for use on ``stream``."""
        if descriptor.device != "cuda":
            raise ValueError(f"output on {descriptor.device!r} is not a GPU output")
        slab = self._slab(descriptor)
        ptr = slab.ptr + descriptor.offset
        interface: dict[str, Any] = {
            "shape": tuple(descriptor.shape),
            "typestr": np.dtype(descriptor.dtype).str,
            "data": (ptr, False),
            "strides": tuple(descriptor.strides) if descriptor.strides else None,
            "version": 3,
        }
        region = _Region(interface)
        tensor = self.device.tensor(region)
        # When the last tensor sharing this storage goes, `region` dies and the region returns.
        weakref.finalize(region, self.released.append, descriptor.region_id)
        key = _key(stream)
        slab.live += 1
        slab.streams[key] = stream
        self._streams[key] = stream
        self._regions[descriptor.region_id] = (slab, key)
        self.handed_out += 1
        if descriptor.nbytes and tensor.data_ptr() != ptr:
            raise RuntimeError("torch copied a GPU output instead of viewing it")
        return tensor

    def _slab(self, descriptor: OutputDescriptor) -> _Slab:
        slab = self._slabs.get(descriptor.slab)
        if slab is None:
            ptr = self.device.open_memory(bytes.fromhex(descriptor.ipc_handle))
            slab = _Slab(descriptor.slab, descriptor.ipc_handle, descriptor.slab_size, ptr)
            self._slabs[descriptor.slab] = slab
            self.opened += 1
        elif slab.handle != descriptor.ipc_handle or slab.size != descriptor.slab_size:
            raise ValueError(f"slab {descriptor.slab} changed its handle or size")
        return slab

    # --- giving back --------------------------------------------------------------------------

    def releases(self) -> list[ReleaseRegions]:
        """What to tell the daemon now: the regions whose last tensor died, one message per
        delivery stream with a release fence recorded on that stream, then the slabs unmapped
        since the last call, for the daemon to free."""
        messages = [
            ReleaseRegions(region_ids, event=fence) for region_ids, fence in self._take_released()
        ]
        closed = self._take_closed()
        if closed:
            messages.append(ReleaseRegions(closed_slabs=tuple(closed)))
        return messages

    def _take_released(self) -> list[tuple[tuple[int, ...], str]]:
        """Regions whose last tensor died, grouped by delivery stream, each group with a release
        fence recorded on its stream: ``[(region_ids, fence_handle), ...]``."""
        groups: dict[StreamKey, list[int]] = {}
        while self.released:
            region_id = self.released.popleft()
            slab, key = self._regions.pop(region_id)
            slab.live -= 1
            groups.setdefault(key, []).append(region_id)
            self._returned += 1
        releases = []
        for key, ids in groups.items():
            assert self._fences is not None  # a region was handed out: the device is open
            releases.append((tuple(ids), self._fences.record(self._streams[key])))
        self._unmap_drained()
        return releases

    def retire(self, slabs: Sequence[str]) -> None:
        """The daemon has let go of these slabs: unmap each once its work has completed.

        A name never mapped here (a CPU slab, or a GPU slab whose batches were never used) is
        reported closed at once, so the daemon need not keep it.
        """
        for name in slabs:
            slab = self._slabs.pop(name, None)
            if slab is None:
                self._closed.append(name)
                continue
            slab.markers = [self.device.marker(stream) for stream in slab.streams.values()]
            self._retiring.append(slab)
        self._unmap_drained()

    def _take_closed(self) -> list[str]:
        """Slabs unmapped since the last call, for the daemon to free."""
        self._unmap_drained()
        closed, self._closed = self._closed, []
        return closed

    def _unmap_drained(self) -> None:
        waiting = []
        for slab in self._retiring:
            if slab.live == 0 and all(self.device.done(marker) for marker in slab.markers):
                self.device.close_memory(slab.ptr)
                self._closed.append(slab.name)
            else:
                waiting.append(slab)
        self._retiring = waiting

    # --- the end ------------------------------------------------------------------------------

    def unmap(self) -> tuple[str, ...]:
        """Before the goodbye: unmaps every slab no tensor views, once the work queued on its
        streams has completed (a host wait, once), and drops the batch events. Returns the
        slabs still mapped, for ``Goodbye.kept_slabs``.

        Slabs that tensors still view stay mapped until this process exits; the daemon keeps
        them allocated until then (Note [GPU output lifetime], point 5).
        """
        if self._pid != os.getpid():
            return ()
        while self.released:
            slab, _ = self._regions.pop(self.released.popleft())
            slab.live -= 1
            self._returned += 1
        slabs = [*self._slabs.values(), *self._retiring]
        idle = [slab for slab in slabs if slab.live == 0]
        streams = {key: stream for slab in idle for key, stream in slab.streams.items()}
        for marker in [self.device.marker(stream) for stream in streams.values()]:
            self.device.synchronize(marker)
        for slab in idle:
            self.device.close_memory(slab.ptr)
        kept = [slab for slab in slabs if slab.live]
        self._slabs = {slab.name: slab for slab in kept}
        self._retiring, self._closed = [], []
        self._events.clear()
        return tuple(slab.name for slab in kept)

    def close(self) -> None:
        """After the goodbye: drops the release fences, which the daemon no longer waits on."""
        if self._pid == os.getpid() and self._fences is not None:
            self._fences.clear()
