"""A job's output stores (server/outputs.py): which store takes each output of a batch, what its
descriptors say, and the order of a GPU batch's copies, host waits and event.

CPU outputs are real DALI tensors copied into real shared memory; GPU outputs run on the fake
CUDA layer (the same path on a real GPU is in tests/integration/test_gpu.py).
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np
import pytest
from nvidia.dali.tensors import TensorListCPU

from dalid.protocol import ErrorCode, Limits
from dalid.server.cuda import device_outputs
from dalid.server.outputs import JobOutputs, OutputFailure, ReleaseRefused
from dalid.server.pool import PAGE
from dalid.server.shm import SHM_DIR, host_outputs

from .fake_cuda import FakeApi

LIMITS = Limits(
    max_batch_size=64, max_message_bytes=1 << 20, pool_bytes=16 * PAGE, slab_bytes=4 * PAGE
)


class TensorListGPU:
    """Stands for DALI's GPU TensorList: the calls the stores make, on no device."""

    def __init__(self, shape: tuple[int, ...], dtype: Any = None, dense: bool = True) -> None:
        from nvidia.dali import types

        self._shape = shape
        self.dtype = dtype if dtype is not None else types.DALIDataType.FLOAT
        self._dense = dense

    def is_dense_tensor(self) -> bool:
        return self._dense

    def as_tensor(self) -> TensorListGPU:
        return self

    def shape(self) -> Any:
        return self._shape if self._dense else [self._shape[1:], (1,)]

    def layout(self) -> str:
        return "NCHW"


@pytest.fixture
def prefix() -> str:
    return f"dalid-unittest-{os.getpid()}-{os.urandom(3).hex()}"


def _bytes(name: str, offset: int, nbytes: int) -> bytes:
    fd = os.open(SHM_DIR / name, os.O_RDONLY)
    try:
        with mmap.mmap(fd, offset + nbytes, prot=mmap.PROT_READ) as view:
            return view[offset : offset + nbytes]
    finally:
        os.close(fd)


def test_cpu_outputs_are_copied_into_shared_memory_and_described(prefix: str) -> None:
    outputs = host_outputs()(prefix, LIMITS)
    try:
        images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
        labels = np.array([[7], [9]], dtype=np.int64)
        batch = (TensorListCPU(images, "HW"), TensorListCPU(labels))
        descriptors, event = outputs.write_batch(batch)
        assert event == ""
        assert [d.device for d in descriptors] == ["cpu", "cpu"]
        assert [d.shape for d in descriptors] == [(2, 3, 4), (2, 1)]
        assert [d.dtype for d in descriptors] == ["uint8", "int64"]
        assert descriptors[0].layout == "HW"
        assert all(d.ipc_handle == "" for d in descriptors)
        for descriptor, array in zip(descriptors, (images, labels), strict=True):
            assert _bytes(descriptor.slab, descriptor.offset, descriptor.nbytes) == array.tobytes()
        assert outputs.leased_regions == 2
        ids = [d.region_id for d in descriptors]
        assert outputs.release([*ids, 999]) == [999]
        assert outputs.leased_regions == 0
    finally:
        assert outputs.close() is False  # shared memory never outlives the job in the daemon
        outputs.free()


def test_a_gpu_output_on_a_cpu_daemon_fails_the_batch_and_leases_nothing(prefix: str) -> None:
    outputs = host_outputs()(prefix, LIMITS)
    try:
        batch = (TensorListCPU(np.zeros((2, 2), np.uint8)), TensorListGPU((2, 3)))
        with pytest.raises(OutputFailure, match="output 1 is on the GPU") as failure:
            outputs.write_batch(batch)
        assert failure.value.code is ErrorCode.INVALID_OUTPUT
        assert outputs.leased_regions == 0
        with pytest.raises(ReleaseRefused, match="for GPU outputs"):
            outputs.release([], fence="ab" * 64)
    finally:
        outputs.close()


def test_outputs_of_different_shapes_and_batches_too_large_fail(prefix: str) -> None:
    outputs = host_outputs()(prefix, LIMITS)
    try:
        ragged = TensorListCPU([np.zeros((2,), np.uint8), np.zeros((3,), np.uint8)])
        with pytest.raises(OutputFailure, match="different shapes") as failure:
            outputs.write_batch((ragged,))
        assert failure.value.code is ErrorCode.INVALID_OUTPUT
        huge = TensorListCPU(np.zeros((17, PAGE), np.uint8))  # over the 16-page pool
        small = TensorListCPU(np.zeros((1, 8), np.uint8))
        with pytest.raises(OutputFailure, match="pool's limit") as failure:
            outputs.write_batch((small, huge))
        assert failure.value.code is ErrorCode.RESOURCE_EXHAUSTED
        assert outputs.leased_regions == 0  # all or none
    finally:
        outputs.close()


def _gpu_outputs(prefix: str, api: FakeApi) -> JobOutputs:
    return device_outputs(0, api=api)(prefix, LIMITS)


def test_a_mixed_batch_goes_to_both_stores_and_waits_on_the_host_before_cpu_copies(
    prefix: str,
) -> None:
    api = FakeApi()
    outputs = _gpu_outputs(prefix, api)
    try:
        assert outputs.stream == 7  # DALI hands outputs over on the job's stream
        labels = np.array([1, 2], dtype=np.int32)
        descriptors, event = outputs.write_batch(
            (TensorListGPU((2, 3, 4, 4)), TensorListCPU(labels)), stream_ordered=True
        )
        gpu, cpu = descriptors
        assert (gpu.device, cpu.device) == ("cuda", "cpu")
        assert len(gpu.ipc_handle) == 128 and cpu.ipc_handle == ""
        assert gpu.region_id != cpu.region_id  # one id sequence for the job
        assert _bytes(cpu.slab, cpu.offset, cpu.nbytes) == labels.tobytes()
        kinds = [call[0] for call in api.calls]
        # CPU outputs of a stream-ordered batch are ready in the stream's order only: the host
        # waits before they are read; the batch event follows the GPU copy.
        assert kinds == ["synchronize", "copy", "record"]
        assert event == api.events[0].to_bytes(64, "little").hex()
    finally:
        outputs.close()
        outputs.free()
    assert api.allocated == {}


def test_a_gpu_only_batch_never_waits_on_the_host_unless_the_executor_is_legacy(
    prefix: str,
) -> None:
    api = FakeApi()
    outputs = _gpu_outputs(prefix, api)
    try:
        outputs.write_batch((TensorListGPU((2, 8)),), stream_ordered=True)
        assert [call[0] for call in api.calls] == ["copy", "record"]
        api.calls.clear()
        # The legacy executor reuses its buffers without regard to our stream.
        outputs.write_batch((TensorListGPU((2, 8)),), stream_ordered=False)
        assert [call[0] for call in api.calls] == ["copy", "record", "synchronize"]
        api.calls.clear()
        _, event = outputs.write_batch((TensorListCPU(np.zeros((2,), np.uint8)),))
        assert event == "" and api.calls == []  # no GPU output: no event
    finally:
        outputs.close()
        outputs.free()
    assert api.allocated == {}


def test_gpu_releases_wait_on_the_fence_and_slabs_the_trainer_keeps_linger(prefix: str) -> None:
    api = FakeApi()
    outputs = _gpu_outputs(prefix, api)
    (gpu,), _ = outputs.write_batch((TensorListGPU((1, 16)),))
    assert outputs.release([gpu.region_id], fence="5a" * 64) == []
    assert [call[0] for call in api.calls][-1] == "wait"
    with pytest.raises(ReleaseRefused, match="cannot be used"):
        outputs.release([], fence="zz" * 64)
    outputs.peer_leaving([gpu.slab])  # the trainer still maps the slab
    assert outputs.close() is True  # freed once the trainer is gone
    assert api.allocated != {}
    outputs.free()
    assert api.allocated == {}
