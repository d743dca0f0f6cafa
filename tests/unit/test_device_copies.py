"""Private copies of GPU outputs left on the device, the daemon's half (Note [Private copies] in
server/outputs/copies.py): the job's copy memory, its bound, and the host path it falls back
on. Shared memory is real; the CUDA calls are the fake of fake_cuda.py. A real daemon on this
path is tests/integration/test_kept_outputs.py (simulated GPU); on a real GPU,
tests/integration/test_gpu.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from nvidia.dali.tensors import TensorListCPU

from dalid.protocol import BatchReady, Limits
from dalid.server.outputs.copies import COPY_BATCHES
from dalid.server.outputs.cuda_store import device_outputs
from dalid.server.outputs.job_outputs import JobOutputs
from dalid.server.outputs.pool import PAGE
from dalid.server.outputs.run_output import RunOutput

from .fake_cuda import FakeApi, TensorListGPU

LIMITS = Limits(
    max_batch_size=64, max_message_bytes=1 << 20, pool_bytes=16 * PAGE, slab_bytes=4 * PAGE
)
STREAM = 7  # the fake's stream for every job


@pytest.fixture
def api() -> FakeApi:
    return FakeApi(host_memory=True)


@pytest.fixture
def outputs(api: FakeApi) -> Iterator[JobOutputs]:
    made = device_outputs(0, api=api)(f"dalid-unittest-{os.getpid()}-{os.urandom(3).hex()}", LIMITS)
    made.copies.device_copies = True
    try:
        yield made
    finally:
        made.close()
        made.free()


# A batch's GPU output: two samples of a page each, so that the copy memory holds two batches.
SAMPLE = (PAGE // 4,)


def _run(offset: int) -> list[RunOutput]:
    images = [np.full(SAMPLE, 100 * (offset + i), dtype=np.float32) for i in range(2)]
    labels = np.array([offset, offset + 1], dtype=np.int64)
    return [RunOutput(0, TensorListGPU(images)), RunOutput(1, TensorListCPU(labels))]


def _copies(outputs: JobOutputs, offset: int) -> tuple[Any, ...]:
    run = _run(offset)
    return outputs.private_copies(run, run[0].whole, source_stream=STREAM)


def test_gpu_outputs_are_copied_into_the_copy_memory_on_the_jobs_stream(
    outputs: JobOutputs, api: FakeApi
) -> None:
    (gpu, cpu), (gpu_frame, cpu_frame), event = _copies(outputs, 0)
    # The GPU output names a region of the copy memory, marked copy, with no frame; the CPU one
    # travels as a frame, naming no slab.
    assert gpu.copy and gpu.device == "cuda" and gpu.region_id and "-cudacopy-" in gpu.slab
    assert gpu.ipc_handle and not gpu_frame.nbytes
    assert not cpu.copy and not cpu.slab and cpu_frame.tobytes() == np.array([0, 1]).tobytes()
    # Copied device to device on the job's stream, after the batch's event: never to the host.
    kinds = [call[0] for call in api.calls]
    assert "copy_to_host" not in kinds and kinds.count("copy") == 1
    assert ("copy", outputs.copies.pool.address(gpu.region_id), STREAM) in api.calls  # type: ignore[union-attr]
    assert event and kinds[-1] == "record"
    # A valid batch_ready, counted as copied; the copy memory counts in the job's slabs.
    assert BatchReady(1, 1, (gpu, cpu), event=event, copies=(gpu_frame, cpu_frame)).copied
    assert outputs.copy_slab_bytes == 2 * PAGE and outputs.slab_bytes == 2 * PAGE
    assert outputs.leased_regions == 1


def test_the_copy_memory_holds_two_batches_and_then_copies_go_through_the_host(
    outputs: JobOutputs, api: FakeApi
) -> None:
    held = [_copies(outputs, 10 * n)[0][0] for n in range(COPY_BATCHES)]
    assert all(descriptor.copy for descriptor in held)
    # The trainer has not taken them yet: the next batch's GPU output comes as a frame, at once.
    (gpu, _), (gpu_frame, _), event = _copies(outputs, 50)
    assert not gpu.copy and not gpu.slab and event == ""
    images = [np.full(SAMPLE, 5000 + 100 * i, dtype=np.float32) for i in range(2)]
    assert gpu_frame.tobytes() == np.stack(images).tobytes()
    assert outputs.copy_slab_bytes == COPY_BATCHES * 2 * PAGE
    # Taken and released (with the trainer's fence), a copy's region serves the next copy.
    assert outputs.release([held[0].region_id], fence="ab" * 64) == []
    (gpu, _), _, event = _copies(outputs, 60)
    assert gpu.copy and event
    assert outputs.copy_slab_bytes == COPY_BATCHES * 2 * PAGE  # no more than two batches
    # Its releases end no overflow of the job's pool: they are no part of its window.
    assert outputs.leased_regions == COPY_BATCHES


def test_a_trainer_that_does_not_take_device_copies_gets_frames(
    outputs: JobOutputs, api: FakeApi
) -> None:
    outputs.copies.device_copies = False
    (gpu, _), (gpu_frame, _), event = _copies(outputs, 0)
    assert not gpu.copy and not gpu.slab and event == "" and gpu_frame.nbytes == 2 * PAGE
    assert outputs.copy_slab_bytes == 0


def test_a_cohorts_regions_are_copied_into_the_members_copy_memory_after_its_stream(
    api: FakeApi, outputs: JobOutputs
) -> None:
    cohort = device_outputs(0, api=api)(f"dalid-unittest-{os.getpid()}-c", LIMITS)
    try:
        run = _run(0)
        descriptors, _ = cohort.write_batch(run, run[0].whole, source_stream=STREAM)
        api.calls.clear()
        copied, frames, event = outputs.copies_from(cohort, descriptors)
        gpu, cpu = copied
        assert gpu.copy and "-cudacopy-" in gpu.slab and not frames[0].nbytes and event
        assert not cpu.slab and frames[1].tobytes() == np.array([0, 1]).tobytes()
        kinds = [call[0] for call in api.calls]
        # The member's stream waits for the cohort's, copies, records its batch event, and the
        # cohort's stream waits for that copy before it writes the regions again: no host wait.
        assert "synchronize" not in kinds and "copy_to_host" not in kinds
        assert kinds == ["record", "wait", "copy_range", "record", "record", "wait"]
        source = cohort.store("cuda").pool.address(descriptors[0].region_id)
        assert api.calls[2][2] == source and api.calls[2][3] == descriptors[0].nbytes
    finally:
        cohort.close()
        cohort.free()
