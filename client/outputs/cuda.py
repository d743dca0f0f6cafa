"""The CUDA IPC output backend: GPU slabs opened once, regions as torch CUDA tensors.

The contract is protocol/SPEC.md, "Outputs", rules 1 to 13 (GPU outputs: 7 to 13); this side
keeps the trainer's half:

- each slab's IPC handle is opened once per process (cached by slab name), and closed only once
  no tensor views the slab and the work queued on its streams has completed;
- each batch's event is opened once (cached by handle: the daemon reuses a small ring) and the
  current stream waits on it before the batch's tensors are handed out; no host sync;
- a region is released when the last tensor viewing it dies, with a release fence recorded on
  the stream it was delivered on, so the daemon writes it again only after that stream's work;
- slabs are reported unmapped so the daemon can free them (CUDA forbids freeing them earlier):
  retired ones as they are unmapped, and at the end all but those that tensors still view;
- a private copy left on the device (rule 4) is a region like the others, viewed only long
  enough to copy it into a tensor of this process's own on the same stream: released at once,
  its fence recorded after that copy.

CUDA is touched only for a daemon on a GPU (the device is opened with the first GPU output), so
CPU-only users never need it. The device calls, and finding the daemon's GPU among this
process's, are in ``cuda_device.py``; unit tests pass a fake :class:`Device`.
"""

from __future__ import annotations

import collections
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dalid.protocol import OutputDescriptor, ReleaseRegions

from . import cuda_device
from .copies import copied_tensor
from .cuda_device import Device

MAX_FENCES = 64
"""Release fences kept by a session; the daemon accepts up to 256 (MAX_PEER_EVENTS)."""

StreamKey = tuple[int, int]


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
    process (an :class:`~dalid.client.outputs.outputs.OutputBackend`).

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
        devices = cuda_device.DEVICES
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

    def take_copies(self, outputs: Sequence[OutputDescriptor], event: str) -> list[torch.Tensor]:
        """Private copies left on the device (``OutputDescriptor.copy``: protocol/SPEC.md,
        "Outputs", rule 4): each region copied, on the current stream once it has waited for
        the batch's ``event``, into a tensor of this process's own; the region is released at
        once, its fence recorded after that copy. No host copy, no host wait."""
        stream = self._begin_batch(event)
        copies = []
        for descriptor in outputs:
            view = self._tensor(descriptor, stream)
            copies.append(self.device.copy(view, stream))
            # The view was the region's only tensor: its release is due now (``released``).
            del view
        return copies

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
        them allocated until then (Note [GPU output lifetime]).
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
