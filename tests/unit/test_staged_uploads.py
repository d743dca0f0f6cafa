"""Staged GPU outputs, the trainer's half (client/outputs/cuda_staged.py): the IPC probe, the
output path the daemon answers, and the backend that uploads staged regions, on a fake device.

The slabs are real shared memory written by the test; the fake device uploads by copying to
CPU tensors and completes its markers when told, so release timing, page-locking and unmapping
are checked for real. A real daemon on this path is tests/integration/test_staged.py; on a real
GPU, tests/integration/test_gpu.py.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

import dalid.client.outputs.cuda_device
from dalid.client.errors import DeviceMismatch, RequestError
from dalid.client.outputs import cuda_staged as staged
from dalid.client.outputs.cuda_staged import StagedOutputs, output_path, probe_ipc
from dalid.client.outputs.outputs import Outputs
from dalid.protocol import (
    BatchReady,
    ErrorCode,
    IpcProbeResult,
    Limits,
    Message,
    OutputDescriptor,
    OutputPath,
    ReleaseRegions,
    Welcome,
)
from dalid.protocol import slabs as slab_names

SLAB_BYTES = 1 << 16
UUID = "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


@dataclass(eq=False)
class Marker:
    complete: bool = False


@dataclass(frozen=True)
class Stream:
    cuda_stream: int


@dataclass
class FakeDevice:
    """Uploads by copying; markers complete when a test says so."""

    stream: Stream = Stream(1)
    uploads: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    pinned: dict[int, int] = field(default_factory=dict)
    unpinned: list[int] = field(default_factory=list)
    synchronized: list[Marker] = field(default_factory=list)
    can_pin: bool = True

    def current_stream(self) -> Any:
        return self.stream

    def upload(self, host: torch.Tensor, stream: Any = None) -> torch.Tensor:
        copy = host.clone()
        on = stream if stream is not None else self.current_stream()
        self.uploads.append((on.cuda_stream, copy))
        return copy

    def marker(self, stream: Any) -> Marker:
        marker = Marker()
        self.markers.append(marker)
        return marker

    def done(self, event: Marker) -> bool:
        return event.complete

    def synchronize(self, event: Marker) -> None:
        event.complete = True
        self.synchronized.append(event)

    def pin(self, ptr: int, size: int) -> bool:
        if not self.can_pin:
            return False
        assert ptr not in self.pinned, "page-locked twice"
        self.pinned[ptr] = size
        return True

    def unpin(self, ptr: int) -> None:
        del self.pinned[ptr]
        self.unpinned.append(ptr)


@pytest.fixture
def slabs() -> Iterator[list[str]]:
    """Two shared-memory slabs as the daemon makes them (named as dalid names slabs)."""
    names = [slab_names.new_name() for _ in range(2)]
    for name in names:
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, SLAB_BYTES)
        os.close(fd)
    yield names
    for name in names:
        os.unlink(f"/dev/shm/{name}")


def _put(slab: str, offset: int, array: np.ndarray) -> None:
    fd = os.open(f"/dev/shm/{slab}", os.O_RDWR)
    try:
        with mmap.mmap(fd, SLAB_BYTES) as view:
            raw = array.tobytes()
            view[offset : offset + len(raw)] = raw
    finally:
        os.close(fd)


def _staged(region_id: int, slab: str, offset: int, array: np.ndarray) -> OutputDescriptor:
    _put(slab, offset, array)
    return OutputDescriptor(
        region_id=region_id,
        slab=slab,
        slab_size=SLAB_BYTES,
        offset=offset,
        nbytes=array.nbytes,
        dtype=array.dtype.name,
        shape=array.shape,
        device="staged",
    )


@pytest.fixture
def device() -> FakeDevice:
    return FakeDevice()


@pytest.fixture
def uploads(device: FakeDevice) -> Iterator[StagedOutputs]:
    backend = StagedOutputs(lambda: device, reason="cudaIpcOpenMemHandle failed: not supported")
    yield backend
    backend.close()


def _ids(messages: list[ReleaseRegions]) -> list[int]:
    assert all(not message.event and not message.closed_slabs for message in messages)
    return [region_id for message in messages for region_id in message.region_ids]


# --- the backend --------------------------------------------------------------------------------


def test_nothing_touches_the_device_before_the_first_staged_output() -> None:
    def no_device() -> FakeDevice:
        raise AssertionError("the device was opened")

    backend = StagedOutputs(no_device, reason="why")
    backend.retire(["dalid-1-x-j1-3"])
    assert backend.releases() == []
    assert backend.unmap() == ()
    backend.close()
    assert (backend.opened, backend.events_opened, backend.live_regions) == (0, 0, 0)


def test_outputs_are_uploaded_on_the_current_stream_from_slabs_mapped_and_pinned_once(
    device: FakeDevice, uploads: StagedOutputs, slabs: list[str]
) -> None:
    images = np.arange(2 * 3 * 4, dtype=np.float16).reshape(2, 3, 4)
    labels = np.array([5, 6], dtype=np.int64)
    first = uploads.wrap([_staged(1, slabs[0], 0, images), _staged(2, slabs[0], 256, labels)])
    device.stream = Stream(2)
    (second,) = uploads.wrap([_staged(3, slabs[0], 512, images + 1)])
    np.testing.assert_array_equal(first[0].numpy(), images)
    np.testing.assert_array_equal(first[1].numpy(), labels)
    np.testing.assert_array_equal(second.numpy(), images + 1)
    assert [stream for stream, _ in device.uploads] == [1, 1, 2]
    assert uploads.opened == 1 and len(device.pinned) == 1
    assert uploads.live_regions == 3  # until their uploads have run


def test_a_region_goes_back_once_its_upload_has_completed(
    device: FakeDevice, uploads: StagedOutputs, slabs: list[str]
) -> None:
    images = np.ones((2, 4), dtype=np.float32)
    held = uploads.wrap([_staged(1, slabs[0], 0, images)])
    uploads.wrap([_staged(2, slabs[0], 256, images)])
    assert _ids(uploads.releases()) == []  # the uploads still run
    device.markers[1].complete = True  # the second batch's upload finished first
    assert _ids(uploads.releases()) == [2]
    device.markers[0].complete = True
    assert _ids(uploads.releases()) == [1]
    assert uploads.live_regions == 0
    # What was handed out is a copy: the region's reuse cannot change it.
    _put(slabs[0], 0, np.zeros((2, 4), np.float32))
    np.testing.assert_array_equal(held[0].numpy(), images)


def test_a_retired_slab_is_unmapped_once_no_upload_reads_it(
    device: FakeDevice, uploads: StagedOutputs, slabs: list[str]
) -> None:
    uploads.wrap([_staged(1, slabs[0], 0, np.ones(4, np.int32))])
    uploads.wrap([_staged(2, slabs[1], 0, np.ones(4, np.int32))])
    (first_slab, second_slab) = list(device.pinned)
    uploads.retire([slabs[0], "dalid-1-x-j1-9"])  # a slab never mapped here is ignored
    assert device.unpinned == []  # its upload may still read it
    device.markers[0].complete = True
    assert _ids(uploads.releases()) == [1]
    assert device.unpinned == [first_slab]
    assert uploads.unmap() == ()  # the daemon need keep nothing: tensors are copies
    assert device.synchronized == [device.markers[1]]  # waited for the last upload
    assert device.unpinned == [first_slab, second_slab] and device.pinned == {}


def test_memory_that_cannot_be_pinned_is_uploaded_all_the_same(
    device: FakeDevice, uploads: StagedOutputs, slabs: list[str]
) -> None:
    device.can_pin = False
    (tensor,) = uploads.wrap([_staged(1, slabs[0], 0, np.arange(3, dtype=np.uint8))])
    np.testing.assert_array_equal(tensor.numpy(), [0, 1, 2])
    uploads.close()
    assert device.unpinned == []


def test_one_warning_names_the_reason_and_the_cost(
    uploads: StagedOutputs, slabs: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="dalid.client"):
        for n in range(3):
            uploads.wrap([_staged(n + 1, slabs[0], 256 * n, np.ones(2, np.int32))])
    (warning,) = [record.getMessage() for record in caplog.records]
    assert "not by CUDA IPC" in warning and "not supported" in warning
    assert "two PCIe copies" in warning and "--pid=host" in warning


def test_outputs_it_does_not_take_are_refused(uploads: StagedOutputs, slabs: list[str]) -> None:
    gpu = OutputDescriptor(
        1, "dalid-1-x-j1-cuda-1", 1024, 0, 4, "int32", (1,), device="cuda", ipc_handle="ab" * 64
    )
    with pytest.raises(ValueError, match="not a staged GPU output"):
        uploads.wrap([gpu])
    strided = OutputDescriptor(
        2, slabs[0], SLAB_BYTES, 0, 16, "int32", (2, 2), device="staged", strides=(4, 8)
    )
    with pytest.raises(ValueError, match="C-contiguous"):
        uploads.wrap([strided])
    gone = slab_names.new_name()
    with pytest.raises(FileNotFoundError):
        uploads.wrap([OutputDescriptor(3, gone, 4096, 0, 4, "int32", (1,), device="staged")])
    with pytest.raises(ValueError, match="not a dalid slab name"):
        uploads.wrap([OutputDescriptor(4, "../passwd", 4096, 0, 4, "int32", (1,), device="staged")])


def test_a_batch_of_staged_and_cpu_outputs_comes_out_in_order(
    device: FakeDevice, slabs: list[str]
) -> None:
    backend = StagedOutputs(lambda: device, reason="why")
    outputs = Outputs({"staged": backend})
    staged_output = _staged(1, slabs[0], 0, np.full(3, 9, np.int16))
    (tensor,) = outputs.tensors(BatchReady(1, 1, (staged_output,)))
    np.testing.assert_array_equal(tensor.numpy(), [9, 9, 9])
    outputs.close()


# --- the probe ----------------------------------------------------------------------------------


@dataclass
class ProbeDevice:
    """Opens a probe handle as the daemon's memory, or fails as CUDA would."""

    memory: dict[bytes, bytes]
    fail_open: str = ""
    opened: list[bytes] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)

    def open_memory(self, handle: bytes) -> int:
        if self.fail_open:
            raise RuntimeError(self.fail_open)
        self.opened.append(handle)
        return len(self.opened)

    def read(self, ptr: int, nbytes: int) -> bytes:
        return self.memory[self.opened[ptr - 1]][:nbytes]

    def close_memory(self, ptr: int) -> None:
        self.closed.append(ptr)


@dataclass
class ProbeDevices:
    device: ProbeDevice
    cuda: bool = True
    sees_daemon: bool = True

    def available(self) -> bool:
        return self.cuda

    def local(self, daemon_uuid: str) -> int:
        if not (self.cuda and self.sees_daemon):
            raise DeviceMismatch(f"cannot see {daemon_uuid}")
        return 0

    def current(self) -> int:
        return 0

    def open(self, index: int) -> ProbeDevice:
        return self.device


HANDLE = bytes(range(64))


def _probe(monkeypatch: pytest.MonkeyPatch, devices: ProbeDevices) -> str:
    monkeypatch.setattr(dalid.client.outputs.cuda_device, "DEVICES", devices)
    monkeypatch.setattr(staged, "_probed", {})
    return probe_ipc(UUID, HANDLE.hex())


def test_a_probe_that_opens_and_reads_its_handle_back_says_ipc_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    device = ProbeDevice({HANDLE: HANDLE})
    assert _probe(monkeypatch, ProbeDevices(device)) == ""
    assert device.opened == [HANDLE] and device.closed == [1]
    assert probe_ipc(UUID, HANDLE.hex()) == ""  # once per process and probe
    assert len(device.opened) == 1


@pytest.mark.parametrize(
    ("devices", "reason"),
    [
        (ProbeDevices(ProbeDevice({}), cuda=False), "has no CUDA"),
        (ProbeDevices(ProbeDevice({}), sees_daemon=False), f"does not see the daemon's GPU {UUID}"),
        (
            ProbeDevices(
                ProbeDevice({}, fail_open="cudaErrorNotSupported: operation not supported")
            ),
            "cudaIpcOpenMemHandle failed: cudaErrorNotSupported",
        ),
        (ProbeDevices(ProbeDevice({HANDLE: bytes(64)})), "does not hold the daemon's bytes"),
    ],
    ids=["no-cuda", "gpu-not-visible", "open-fails", "other-memory"],
)
def test_a_probe_that_fails_says_why(
    monkeypatch: pytest.MonkeyPatch, devices: ProbeDevices, reason: str
) -> None:
    assert reason in _probe(monkeypatch, devices)
    assert devices.device.closed == devices.device.closed[:1]  # what it opened, it closed


class FakeLink:
    def __init__(self, probe: str, answer: Message | Exception) -> None:
        self.welcome = Welcome(
            5, 1, "gpu0", "2.4.0", 1, "t", Limits(64, 1 << 20, 1 << 20, 1 << 16), UUID, 0, probe
        )
        self.answer = answer
        self.sent: list[Message] = []

    def request(self, message: Message, timeout: float | None = None) -> Message:
        self.sent.append(message)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_the_trainer_reports_its_probe_and_takes_the_daemons_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        dalid.client.outputs.cuda_device,
        "DEVICES",
        ProbeDevices(ProbeDevice({}, fail_open="no IPC here")),
    )
    monkeypatch.setattr(staged, "_probed", {})
    link = FakeLink(HANDLE.hex(), OutputPath("staged", "no IPC here"))
    assert output_path(link) == OutputPath("staged", "no IPC here")  # type: ignore[arg-type]
    (result,) = link.sent
    assert isinstance(result, IpcProbeResult) and not result.opened
    assert "no IPC here" in result.reason
    # A daemon that offers no probe has no CUDA IPC: the trainer says it could not open one.
    mig = FakeLink("", OutputPath("staged", "no CUDA IPC on the daemon's GPU"))
    assert output_path(mig).path == "staged"  # type: ignore[arg-type]
    (result,) = mig.sent
    assert isinstance(result, IpcProbeResult) and not result.opened
    # A daemon of an older release does not know the question, and delivers by CUDA IPC.
    old = FakeLink(HANDLE.hex(), RequestError(ErrorCode.UNKNOWN_OPERATION, "'ipc_probe_result'"))
    assert output_path(old) == OutputPath("cuda_ipc")  # type: ignore[arg-type]
    # A daemon of CUDA IPC only refuses: the session does not start.
    refusing = FakeLink(HANDLE.hex(), RequestError(ErrorCode.DEVICE_MISMATCH, "IPC only"))
    with pytest.raises(DeviceMismatch, match="IPC only"):
        output_path(refusing)  # type: ignore[arg-type]
