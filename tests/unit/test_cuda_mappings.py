"""The trainer's GPU output backend (client/outputs/cuda.py) on a fake device: no GPU needed.

Everything goes through the output-backend interface the session uses (``wrap``, ``retire``,
``releases``, ``unmap``, ``close``: see client/outputs/outputs.py).

The fake opens "device memory" as host buffers and builds tensors through numpy, keeping the
region object alive exactly as torch does for ``__cuda_array_interface__`` (the tensor holds
it), so release on garbage collection, stream grouping, fence reuse and unmapping are tested
for real. CUDA itself is in tests/integration/test_gpu.py.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from dalid.client.errors import DeviceMismatch
from dalid.client.outputs.cuda import MAX_FENCES, CudaOutputs
from dalid.client.outputs.cuda_device import pick_device
from dalid.client.outputs.outputs import Outputs
from dalid.client.outputs.shm import SharedMemoryOutputs
from dalid.protocol import BatchReady, OutputDescriptor, ReleaseRegions, slabs

SLAB_BYTES = 1 << 16


@dataclass(eq=False)
class FakeEvent:
    name: str
    complete: bool = True
    records: list[int] = field(default_factory=list)  # stream numbers
    ipc: bool = False


@dataclass(frozen=True)
class FakeStream:
    cuda_stream: int
    device_index: int = 0


class _HostView:
    """Exposes a region's memory to numpy; holding the region as torch would."""

    def __init__(self, region: Any) -> None:
        self.region = region
        interface = dict(region.__cuda_array_interface__)
        self.__array_interface__ = interface


class FakeDevice:
    def __init__(self) -> None:
        self.buffers: dict[int, np.ndarray] = {}
        self.handles: dict[bytes, int] = {}
        self.closed: list[int] = []
        self.stream = FakeStream(1)
        self.opened_events: list[bytes] = []
        self.waits: list[tuple[int, str]] = []
        self.fences: list[FakeEvent] = []
        self.markers: list[FakeEvent] = []
        self.synchronized: list[FakeEvent] = []
        self.copies: list[int] = []  # the streams device-to-device copies were made on
        # What the daemon wrote into a slab before this process mapped it, by handle.
        self.written: dict[bytes, list[tuple[int, np.ndarray]]] = {}

    def open_memory(self, handle: bytes) -> int:
        assert handle not in self.handles, "a slab handle opened twice"
        buffer = np.zeros(SLAB_BYTES, dtype=np.uint8)
        ptr = buffer.ctypes.data
        self.buffers[ptr] = buffer
        self.handles[handle] = ptr
        for offset, data in self.written.pop(handle, []):
            self.write(handle.hex(), offset, data)
        return ptr

    def close_memory(self, ptr: int) -> None:
        assert ptr in self.buffers and ptr not in self.closed
        self.closed.append(ptr)

    def current_stream(self) -> Any:
        return self.stream

    def open_event(self, handle: bytes) -> Any:
        self.opened_events.append(handle)
        return FakeEvent(handle.hex()[:8])

    def wait(self, stream: Any, event: Any) -> None:
        self.waits.append((stream.cuda_stream, event.name))

    def new_fence(self) -> Any:
        fence = FakeEvent(f"fence{len(self.fences)}", ipc=True)
        self.fences.append(fence)
        return fence

    def record(self, event: Any, stream: Any) -> None:
        event.records.append(stream.cuda_stream)
        event.complete = False  # the stream has not reached it yet

    def fence_handle(self, event: Any) -> bytes:
        name: str = event.name
        return name.encode().ljust(64, b"\0")

    def marker(self, stream: Any) -> Any:
        marker = FakeEvent(f"marker{len(self.markers)}", complete=False)
        marker.records.append(stream.cuda_stream)
        self.markers.append(marker)
        return marker

    def done(self, event: Any) -> bool:
        return bool(event.complete)

    def synchronize(self, event: Any) -> None:
        event.complete = True
        self.synchronized.append(event)

    def tensor(self, region: Any) -> torch.Tensor:
        return torch.from_numpy(np.asarray(_HostView(region)))

    def upload(self, host: torch.Tensor, stream: Any = None) -> torch.Tensor:
        return host.clone()  # "on the device": a copy

    def copy(self, tensor: torch.Tensor, stream: Any) -> torch.Tensor:
        self.copies.append(stream.cuda_stream)
        return tensor.clone()

    def write(self, handle: str, offset: int, data: np.ndarray) -> None:
        if bytes.fromhex(handle) not in self.handles:  # not mapped here yet
            self.written.setdefault(bytes.fromhex(handle), []).append((offset, data))
            return
        buffer = self.buffers[self.handles[bytes.fromhex(handle)]]
        raw = data.view(np.uint8).reshape(-1)
        buffer[offset : offset + raw.size] = raw


def _handle(n: int) -> str:
    return bytes([n] * 64).hex()


def _descriptor(
    region_id: int, slab: int, offset: int, shape: tuple[int, ...], dtype: str = "float32"
) -> OutputDescriptor:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return OutputDescriptor(
        region_id=region_id,
        slab=f"dalid-1-x-j1-cuda-{slab}",
        slab_size=SLAB_BYTES,
        offset=offset,
        nbytes=nbytes,
        dtype=dtype,
        shape=shape,
        device="cuda",
        ipc_handle=_handle(slab),
    )


EVENT_A = "aa" * 64
EVENT_B = "bb" * 64


@pytest.fixture
def device() -> FakeDevice:
    return FakeDevice()


@pytest.fixture
def mappings(device: FakeDevice) -> CudaOutputs:
    return CudaOutputs(lambda: device)


def _released(mappings: CudaOutputs) -> list[tuple[tuple[int, ...], str]]:
    """The region releases due now, as (region ids, fence); no slab is closed meanwhile."""
    messages = mappings.releases()
    assert all(not message.closed_slabs for message in messages)
    return [(message.region_ids, message.event) for message in messages]


def _closed(mappings: CudaOutputs) -> list[str]:
    """The slabs reported unmapped now; no region is released meanwhile."""
    messages = mappings.releases()
    assert all(not message.region_ids for message in messages)
    return [slab for message in messages for slab in message.closed_slabs]


def test_nothing_touches_the_device_before_the_first_gpu_output() -> None:
    def no_device() -> FakeDevice:
        raise AssertionError("the device was opened")

    mappings = CudaOutputs(no_device)
    # A GPU daemon retires CPU slabs too: reported unmapped at once, without CUDA.
    mappings.retire(["dalid-1-x-j1-4"])
    assert mappings.releases() == [ReleaseRegions(closed_slabs=("dalid-1-x-j1-4",))]
    assert mappings.unmap() == ()
    mappings.close()
    assert (mappings.opened, mappings.events_opened, mappings.live_regions) == (0, 0, 0)


def test_regions_are_viewed_in_place_and_slabs_opened_once(
    device: FakeDevice, mappings: CudaOutputs
) -> None:
    first = _descriptor(1, slab=1, offset=0, shape=(2, 3))
    second = _descriptor(2, slab=1, offset=256, shape=(4,), dtype="int64")
    a, b = mappings.wrap([first, second], EVENT_A)
    device.write(first.ipc_handle, 0, np.arange(6, dtype=np.float32))
    device.write(second.ipc_handle, 256, np.array([5, 6, 7, 8], dtype=np.int64))
    assert a.tolist() == [[0, 1, 2], [3, 4, 5]]  # written after: the tensor views the slab
    assert b.dtype == torch.int64 and b.tolist() == [5, 6, 7, 8]
    assert mappings.opened == 1
    assert mappings.handed_out == 2 and mappings.live_regions == 2


def test_each_batch_event_is_opened_once_and_waited_on_per_batch(
    device: FakeDevice, mappings: CudaOutputs
) -> None:
    kept = []
    for region_id, event in enumerate((EVENT_A, EVENT_B, EVENT_A, EVENT_A), start=1):
        outputs = [_descriptor(region_id * 2 + i, slab=1, offset=0, shape=(1,)) for i in (0, 1)]
        kept += mappings.wrap(outputs, event)  # two outputs, one wait
    assert device.opened_events == [bytes.fromhex(EVENT_A), bytes.fromhex(EVENT_B)]
    assert mappings.events_opened == 2
    assert [name for _, name in device.waits] == ["aaaaaaaa", "bbbbbbbb", "aaaaaaaa", "aaaaaaaa"]
    with pytest.raises(ValueError, match="without its event"):
        mappings.wrap([_descriptor(99, slab=1, offset=0, shape=(1,))], "")


def test_strides_are_honoured(device: FakeDevice, mappings: CudaOutputs) -> None:
    descriptor = OutputDescriptor(
        region_id=1,
        slab="dalid-1-x-j1-cuda-1",
        slab_size=SLAB_BYTES,
        offset=0,
        nbytes=6 * 4,
        dtype="int32",
        shape=(3, 2),
        device="cuda",
        strides=(4, 12),  # the transpose of a C-contiguous (2, 3)
        ipc_handle=_handle(1),
    )
    (tensor,) = mappings.wrap([descriptor], EVENT_A)
    device.write(descriptor.ipc_handle, 0, np.arange(6, dtype=np.int32))
    assert tensor.tolist() == [[0, 3], [1, 4], [2, 5]]


def test_a_region_returns_with_a_fence_once_its_last_view_dies(
    device: FakeDevice, mappings: CudaOutputs
) -> None:
    (tensor,) = mappings.wrap([_descriptor(7, slab=1, offset=0, shape=(4, 4))], EVENT_A)
    view = tensor[1:]
    del tensor
    gc.collect()
    assert mappings.releases() == []
    del view
    gc.collect()
    (released,) = mappings.releases()
    (fence,) = device.fences
    assert released == ReleaseRegions((7,), event=device.fence_handle(fence).hex())
    assert fence.records == [device.stream.cuda_stream]  # recorded on the stream it came on
    assert mappings.live_regions == 0
    assert mappings.releases() == []


def test_a_copy_left_on_the_device_is_copied_after_the_event_and_released_at_once(
    device: FakeDevice, mappings: CudaOutputs
) -> None:
    descriptor = dataclasses.replace(_descriptor(5, slab=1, offset=256, shape=(2, 2)), copy=True)
    device.write(descriptor.ipc_handle, 256, np.arange(4, dtype=np.float32))
    (copy,) = mappings.take_copies([descriptor], EVENT_A)
    # Copied on the delivery stream once it waited for the batch's event: no host wait.
    assert device.waits == [(device.stream.cuda_stream, "aaaaaaaa")]
    assert device.copies == [device.stream.cuda_stream] and not device.synchronized
    assert copy.tolist() == [[0, 1], [2, 3]]
    # The tensor is the trainer's own: the daemon's next copy into the region changes nothing.
    device.write(descriptor.ipc_handle, 256, np.full(4, 9, dtype=np.float32))
    assert copy.tolist() == [[0, 1], [2, 3]]
    # The region is due back at once, with a fence recorded after the copy, while the copy lives.
    (released,) = mappings.releases()
    (fence,) = device.fences
    assert released == ReleaseRegions((5,), event=device.fence_handle(fence).hex())
    assert fence.records == [device.stream.cuda_stream]
    assert mappings.live_regions == 0
    # Its slab is mapped once, as any slab, and unmapped when the daemon retires it.
    assert mappings.opened == 1
    mappings.retire([descriptor.slab])
    device.markers[-1].complete = True
    assert _closed(mappings) == [descriptor.slab]


def test_a_batch_of_copies_mixes_frames_and_copies_left_on_the_device(
    device: FakeDevice,
) -> None:
    outputs = Outputs({"cpu": SharedMemoryOutputs(), "cuda": CudaOutputs(lambda: device)})
    on_device = dataclasses.replace(_descriptor(3, slab=1, offset=0, shape=(3,)), copy=True)
    device.write(on_device.ipc_handle, 0, np.array([1, 2, 3], dtype=np.float32))
    frame = np.array([7, 8], dtype=np.int64)
    through_host = OutputDescriptor(
        region_id=0, slab="", slab_size=16, offset=0, nbytes=16, dtype="int64", shape=(2,)
    )
    result = BatchReady(
        1,
        1,
        (on_device, through_host),
        event=EVENT_A,
        copies=(memoryview(b""), memoryview(frame.tobytes())),
    )
    assert result.copied
    first, second = outputs.tensors(result)
    assert first.tolist() == [1, 2, 3] and second.tolist() == [7, 8]
    assert device.copies == [device.stream.cuda_stream]
    assert [message.region_ids for message in outputs.releases()] == [(3,)]


def test_releases_are_grouped_by_delivery_stream(device: FakeDevice, mappings: CudaOutputs) -> None:
    kept = []
    for region_id, stream in enumerate([1, 2, 1], start=1):
        device.stream = FakeStream(stream)
        descriptor = _descriptor(region_id, slab=1, offset=256 * region_id, shape=(4,))
        kept += mappings.wrap([descriptor], EVENT_A)
    kept.clear()
    gc.collect()
    groups = _released(mappings)
    assert sorted(tuple(sorted(ids)) for ids, _ in groups) == [(1, 3), (2,)]
    assert sorted(fence.records[0] for fence in device.fences) == [1, 2]


def test_a_fence_is_reused_only_once_its_last_record_completed(
    device: FakeDevice, mappings: CudaOutputs
) -> None:
    def release_one(region_id: int) -> str:
        descriptor = _descriptor(region_id, slab=1, offset=0, shape=(1,))
        mappings.wrap([descriptor], EVENT_A)  # dropped at once
        gc.collect()
        ((_, fence),) = _released(mappings)
        return fence

    first = release_one(1)
    second = release_one(2)
    assert first != second  # the first fence is still pending on the stream
    device.fences[0].complete = True
    assert release_one(3) == first
    assert len(device.fences) == 2


def test_fences_are_bounded(device: FakeDevice, mappings: CudaOutputs) -> None:
    for region_id in range(1, MAX_FENCES + 3):
        # The tensor is dropped at once; reference counting alone releases the region.
        mappings.wrap([_descriptor(region_id, 1, 0, (1,))], EVENT_A)
        assert len(_released(mappings)) == 1
    assert len(device.fences) == MAX_FENCES
    assert device.synchronized  # the oldest was waited for rather than a new one made


def test_a_retired_slab_is_unmapped_once_its_streams_passed_its_last_use(
    device: FakeDevice, mappings: CudaOutputs
) -> None:
    descriptor = _descriptor(1, slab=3, offset=0, shape=(2,))
    mappings.wrap([descriptor], EVENT_A)
    gc.collect()
    assert len(_released(mappings)) == 1
    mappings.retire([descriptor.slab, "dalid-1-x-j1-4"])
    # A slab never mapped here (here: a CPU one) is reported at once.
    assert _closed(mappings) == ["dalid-1-x-j1-4"]
    assert device.closed == []  # work queued on the stream may still read it
    (marker,) = device.markers
    marker.complete = True
    assert _closed(mappings) == [descriptor.slab]
    assert device.closed == [device.handles[bytes.fromhex(descriptor.ipc_handle)]]
    # A later slab of the same name is a new mapping.
    later = dataclasses.replace(descriptor, region_id=2, ipc_handle=_handle(9))
    mappings.wrap([later], EVENT_A)
    assert mappings.opened == 2


def test_a_changed_handle_for_a_mapped_slab_is_refused(mappings: CudaOutputs) -> None:
    first = _descriptor(1, slab=1, offset=0, shape=(1,))
    keep = mappings.wrap([first], EVENT_A)
    changed = dataclasses.replace(first, region_id=2, ipc_handle=_handle(2))
    with pytest.raises(ValueError, match="changed"):
        mappings.wrap([changed], EVENT_A)
    del keep


def test_closing_unmaps_idle_slabs_and_names_the_viewed_ones(
    device: FakeDevice, mappings: CudaOutputs
) -> None:
    (held,) = mappings.wrap([_descriptor(1, slab=1, offset=0, shape=(2,))], EVENT_A)
    mappings.wrap([_descriptor(2, slab=2, offset=0, shape=(2,))], EVENT_A)  # dropped
    gc.collect()
    kept = mappings.unmap()
    assert kept == ("dalid-1-x-j1-cuda-1",)
    assert device.closed == [device.handles[bytes.fromhex(_handle(2))]]
    assert device.synchronized  # its stream's work finished before the unmap
    assert held.tolist() == [0.0, 0.0]  # still mapped for the live tensor
    mappings.close()


# --- beside shared memory -----------------------------------------------------------------------


@pytest.fixture
def shm_slab() -> Iterator[str]:
    """A shared-memory slab as a CPU daemon makes one (named as the client accepts)."""
    name = slabs.new_name()
    fd = os.open(slabs.SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, SLAB_BYTES)
    finally:
        os.close(fd)
    yield name
    (slabs.SHM_DIR / name).unlink()


def test_a_batch_on_both_devices_comes_out_in_order_each_output_from_its_backend(
    device: FakeDevice, shm_slab: str
) -> None:
    outputs = Outputs({"cpu": SharedMemoryOutputs(), "cuda": CudaOutputs(lambda: device)})
    cpu = OutputDescriptor(10, shm_slab, SLAB_BYTES, 0, 8, "int32", (2,))
    gpu = [_descriptor(11, slab=1, offset=0, shape=(1,)), _descriptor(12, 1, 256, (2,))]
    batch = BatchReady(1, 1, (gpu[0], cpu, gpu[1]), event=EVENT_A)
    first, middle, last = outputs.tensors(batch)
    assert (first.shape, middle.shape, last.shape) == ((1,), (2,), (2,))
    assert middle.dtype == torch.int32 and middle.device.type == "cpu"
    assert len(device.waits) == 1  # one wait for the batch, not one per GPU output
    assert (outputs.opened, outputs.events_opened, outputs.live_regions) == (2, 1, 3)
    del first, middle, last
    gc.collect()
    # Shared memory first, then each stream's fence, then the slabs unmapped.
    outputs.retire([shm_slab, "dalid-1-x-j1-cuda-7"])
    cpu_release, gpu_release, closed = outputs.releases()
    assert cpu_release == ReleaseRegions((10,))
    assert sorted(gpu_release.region_ids) == [11, 12] and gpu_release.event
    assert closed == ReleaseRegions(closed_slabs=(shm_slab, "dalid-1-x-j1-cuda-7"))
    assert outputs.unmap() == ()
    outputs.close()


def test_an_output_on_a_device_the_daemon_did_not_announce_is_refused(shm_slab: str) -> None:
    outputs = Outputs({"cpu": SharedMemoryOutputs()})
    batch = BatchReady(1, 1, (_descriptor(1, slab=1, offset=0, shape=(1,)),), event=EVENT_A)
    with pytest.raises(DeviceMismatch, match="'cuda'"):
        outputs.tensors(batch)
    outputs.close()


# --- which device -------------------------------------------------------------------------------

GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def test_the_current_device_is_used_when_it_is_the_daemons() -> None:
    assert pick_device(GPU_B, [GPU_A, GPU_B], current=1) == 1


def test_another_visible_device_of_the_daemon_is_found() -> None:
    # The trainer's CUDA_VISIBLE_DEVICES renumbered the daemon's GPU.
    assert pick_device(GPU_B, [GPU_B, GPU_A], current=1) == 0


def test_a_gpu_the_trainer_cannot_see_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(DeviceMismatch) as raised:
        pick_device(GPU_A, [GPU_B], current=0)
    message = str(raised.value)
    assert GPU_A in message and GPU_B in message
    assert "CUDA_VISIBLE_DEVICES=1" in message
