"""A job's output stores (server/outputs/job_outputs.py): which store takes each output of a batch,
what its descriptors say, and the order of a GPU batch's copies, host waits and event.

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
from dalid.protocol.slabs import SHM_DIR
from dalid.server.outputs.cuda_store import device_outputs
from dalid.server.outputs.job_outputs import JobOutputs
from dalid.server.outputs.pool import PAGE
from dalid.server.outputs.run_output import OutputFailure, RunOutput
from dalid.server.outputs.shm import host_outputs
from dalid.server.outputs.store import ReleaseRefused

from .fake_cuda import FakeApi

LIMITS = Limits(
    max_batch_size=64, max_message_bytes=1 << 20, pool_bytes=16 * PAGE, slab_bytes=4 * PAGE
)


class TensorListGPU:
    """Stands for DALI's GPU TensorList: the calls the stores make, on no device. ``shape`` is
    the batch's; ``ragged`` makes sample 0 longer than the others."""

    def __init__(self, shape: tuple[int, ...], ragged: bool = False) -> None:
        from nvidia.dali import types

        self.dtype = types.DALIDataType.FLOAT
        self._samples = [shape[1:]] * shape[0]
        if ragged:
            self._samples[0] = (shape[1] + 1, *shape[2:])

    def is_dense_tensor(self) -> bool:
        return len(set(self._samples)) == 1

    def as_tensor(self) -> _DenseGPU:
        return _DenseGPU((len(self._samples), *self._samples[0]))

    def shape(self) -> list[tuple[int, ...]]:
        return list(self._samples)

    def layout(self) -> str:
        return "CHW"

    def data_ptr(self) -> int:
        return 0xD000

    def __getitem__(self, index: int) -> tuple[str, int]:
        return ("sample", index)


class _DenseGPU:
    """A dense GPU TensorList as one tensor (``as_tensor``): its whole shape, its address."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self._shape = shape

    def shape(self) -> list[int]:
        return list(self._shape)

    def data_ptr(self) -> int:
        return 0xD000


def _write(
    outputs: JobOutputs,
    batch: tuple[Any, ...],
    rows: range | None = None,
    source_stream: int | None = None,
) -> Any:
    """``outputs.write_batch`` of a run's outputs (all rows unless ``rows``)."""
    run = [RunOutput(index, tensors) for index, tensors in enumerate(batch)]
    return outputs.write_batch(
        run, run[0].whole if rows is None else rows, source_stream=source_stream
    )


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
        descriptors, event = _write(outputs, batch)
        assert event == ""
        assert [d.device for d in descriptors] == ["cpu", "cpu"]
        assert [d.shape for d in descriptors] == [(2, 3, 4), (2, 1)]
        assert [d.dtype for d in descriptors] == ["uint8", "int64"]
        assert descriptors[0].layout == "HW"
        assert all(d.ipc_handle == "" for d in descriptors)
        arrays: tuple[np.ndarray, ...] = (images, labels)
        for descriptor, array in zip(descriptors, arrays, strict=True):
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
            _write(outputs, batch)
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
            _write(outputs, (ragged,))
        assert failure.value.code is ErrorCode.INVALID_OUTPUT
        huge = TensorListCPU(np.zeros((17, PAGE), np.uint8))  # over the 16-page pool
        small = TensorListCPU(np.zeros((17, 8), np.uint8))
        with pytest.raises(OutputFailure, match="pool's limit") as failure:
            _write(outputs, (small, huge))
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
        descriptors, event = _write(
            outputs, (TensorListGPU((2, 3, 4, 4)), TensorListCPU(labels)), source_stream=7
        )
        gpu, cpu = descriptors
        assert (gpu.device, cpu.device) == ("cuda", "cpu")
        assert gpu.shape == (2, 3, 4, 4) and gpu.layout == "CHW"
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
        _write(outputs, (TensorListGPU((2, 8)),), source_stream=7)
        assert [call[0] for call in api.calls] == ["copy", "record"]
        api.calls.clear()
        # The legacy executor reuses its buffers without regard to our stream.
        _write(outputs, (TensorListGPU((2, 8)),), source_stream=None)
        assert [call[0] for call in api.calls] == ["copy", "record", "synchronize"]
        api.calls.clear()
        _, event = _write(outputs, (TensorListCPU(np.zeros((2,), np.uint8)),))
        assert event == "" and api.calls == []  # no GPU output: no event
        # CPU outputs handed over on the stream are read once the host has waited for it.
        _write(outputs, (TensorListCPU(np.zeros((2,), np.uint8)),), source_stream=7)
        assert api.calls == [("synchronize", 7)]
    finally:
        outputs.close()
        outputs.free()
    assert api.allocated == {}


def test_gpu_releases_wait_on_the_fence_and_slabs_the_trainer_keeps_linger(prefix: str) -> None:
    api = FakeApi()
    outputs = _gpu_outputs(prefix, api)
    (gpu,), _ = _write(outputs, (TensorListGPU((1, 16)),), source_stream=7)
    assert outputs.release([gpu.region_id], fence="5a" * 64) == []
    assert [call[0] for call in api.calls][-1] == "wait"
    with pytest.raises(ReleaseRefused, match="cannot be used"):
        outputs.release([], fence="zz" * 64)
    outputs.peer_leaving([gpu.slab])  # the trainer still maps the slab
    assert outputs.close() is True  # freed once the trainer is gone
    assert api.allocated != {}
    outputs.free()
    assert api.allocated == {}


def test_a_jobs_rows_of_a_shared_run_are_copied_alone(prefix: str) -> None:
    outputs = host_outputs()(prefix, LIMITS)
    try:
        run = np.arange(5 * 3, dtype=np.int32).reshape(5, 3)
        (dense,), _ = _write(outputs, (TensorListCPU(run),), rows=range(1, 4))
        assert dense.shape == (3, 3)
        assert _bytes(dense.slab, dense.offset, dense.nbytes) == run[1:4].tobytes()
        # Samples of another job differ in shape; this job's rows do not.
        ragged = [np.full((4,), 9, np.uint8), np.arange(2, dtype=np.uint8), np.ones(2, np.uint8)]
        (rows,), _ = _write(outputs, (TensorListCPU(ragged),), rows=range(1, 3))
        assert rows.shape == (2, 2)
        assert _bytes(rows.slab, rows.offset, rows.nbytes) == bytes([0, 1, 1, 1])
        with pytest.raises(OutputFailure, match="different shapes"):
            _write(outputs, (TensorListCPU(ragged),), rows=range(2))
    finally:
        outputs.close()


def test_gpu_rows_of_a_shared_run_are_ordered_against_the_pipelines_stream(prefix: str) -> None:
    api = FakeApi()
    outputs = _gpu_outputs(prefix, api)
    try:
        shared_stream = 99  # the pipeline's own, not the job's (7)
        _write(outputs, (TensorListGPU((4, 8)),), range(2, 4), shared_stream)
        follow, lead = api.private
        assert [call for call in api.calls if call[0] != "copy_range"] == [
            ("record", follow, shared_stream),  # the job's stream waits for DALI's outputs,
            ("wait", 7, follow),
            ("record", api.events[0], 7),  # then the batch event after the copy,
            ("record", lead, 7),  # and DALI's stream waits for the copy before reusing them
            ("wait", shared_stream, lead),
        ]
        (copy,) = [call for call in api.calls if call[0] == "copy_range"]
        assert copy[2:] == (0xD000 + 2 * 8 * 4, 2 * 8 * 4, 7)
        api.calls.clear()
        _write(outputs, (TensorListGPU((3, 2), ragged=True),), range(1, 3), shared_stream)
        assert [call[0] for call in api.calls if call[0] == "copy"] == ["copy", "copy"]
    finally:
        outputs.close()
        outputs.free()
    assert api.allocated == {} and sorted(api.destroyed) == sorted([*api.events, *api.private])
