"""A cohort's GPU outputs (server/runs/cohorts.py with server/outputs/cuda.py) on a fake CUDA API:
every member is given the same region of the cohort's device memory, its slab is mapped by each,
its release waits on each member's fence, and it goes back only after the last release.

The whole path, with a real daemon and trainers on a simulated GPU, is
tests/integration/test_cohorts_simulated_gpu.py; on a real GPU, test_cohorts_gpu.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from dalid.protocol import BatchReady, Limits
from dalid.server.outputs.cuda import CudaBackend
from dalid.server.outputs.cuda_store import CudaStore
from dalid.server.outputs.job_outputs import JobOutputs
from dalid.server.outputs.pool import PAGE
from dalid.server.outputs.run_output import RunOutput
from dalid.server.outputs.shm import SharedMemoryStore
from dalid.server.runs.cohorts import Cohort, Outcome

from .fake_cuda import FakeApi, TensorListGPU
from .test_cohorts import SAMPLES, _Job

LIMITS = Limits(
    max_batch_size=64, max_message_bytes=1 << 20, pool_bytes=64 * PAGE, slab_bytes=16 * PAGE
)


class _DeviceStore:
    """What a member's own outputs say of how its trainer takes GPU outputs."""

    def __init__(self, device: str) -> None:
        self.device = device


def _member(job_id: int, device: str = "cuda") -> _Job:
    job = _Job(job_id)
    job.member.outputs = JobOutputs([_DeviceStore(device)])  # type: ignore[list-item]
    return job


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.fixture
def outputs(api: FakeApi) -> Iterator[JobOutputs]:
    """A cohort's memory on a GPU daemon: shared memory and device memory."""
    prefix = f"dalid-unittest-{os.getpid()}-{os.urandom(3).hex()}"
    from dalid.server.outputs.store import region_ids

    ids = region_ids()
    made = JobOutputs(
        [
            SharedMemoryStore(prefix, LIMITS, ids),
            CudaStore(prefix, LIMITS, ids, CudaBackend(0, api=api)),
        ]
    )
    made.copy_after = 0.0
    yield made
    made.close()
    made.free()


def _run(cohort: Cohort, batch: Any, value: float) -> list[Any]:
    """The run of ``batch``'s entry, a GPU output and a CPU one, published."""
    samples = [np.full(PAGE // 4, value, np.float32) for _ in range(SAMPLES)]
    from nvidia.dali.tensors import TensorListCPU

    run = [
        RunOutput(0, TensorListGPU(samples)),
        RunOutput(1, TensorListCPU(np.stack(samples))),
    ]
    entry = batch.cohort_entry
    descriptors = entry.write(run, run[0].whole, None)
    assert descriptors is not None
    return list(entry.publish(descriptors, lambda: None))


def _gpu(ready: BatchReady) -> Any:
    (descriptor,) = [d for d in ready.outputs if d.device == "cuda"]
    return descriptor


def test_every_member_is_given_the_same_device_region_with_the_runs_event(
    outputs: JobOutputs, api: FakeApi
) -> None:
    cohort = Cohort("sweep", ("key",), outputs, 16 * PAGE, lambda pid, ns: False)
    first, second = _member(1), _member(2)
    cohort.join(first.member)
    cohort.join(second.member)
    producer, follower = first.batch(0), second.batch(0)
    assert cohort.take(producer)[0] == Outcome.RUN
    assert cohort.take(follower)[0] == Outcome.FOLLOW
    results = _run(cohort, producer, 1.0)
    (_, mine), (_, theirs) = results
    assert isinstance(mine, BatchReady) and isinstance(theirs, BatchReady)
    ours, others = _gpu(mine), _gpu(theirs)
    # One region, exported once: the same handle, slab and offset; a lease id for each member.
    assert (ours.ipc_handle, ours.slab, ours.offset) == (
        others.ipc_handle,
        others.slab,
        others.offset,
    )
    assert ours.region_id != others.region_id
    assert mine.event and mine.event == theirs.event  # the run's event, for both streams
    status = cohort.status()
    assert (status.runs, status.hits, status.copied) == (1, 1, 0)
    assert status.device_bytes == outputs.store("cuda").pool.slab_bytes_total > 0
    # Released by the first member after its fence: still leased to the second.
    gpu_store = outputs.store("cuda")
    fence = "0a" * 64
    cohort.release(1, [d.region_id for d in mine.outputs], fence=fence)
    assert api.opened and list(api.opened.values()) == [bytes.fromhex(fence)]
    assert gpu_store.pool.leased_regions == 1
    cohort.release(2, [d.region_id for d in theirs.outputs], fence="0b" * 64)
    assert gpu_store.pool.leased_regions == 0 and len(api.opened) == 2
    # The slab is mapped by both members: the pool letting go of it frees nothing yet.
    cohort.leave(first.member, pid=0, namespace=0)
    cohort.leave(second.member, pid=0, namespace=0)
    assert cohort.close()  # slabs wait for processes the daemon cannot watch
    assert api.allocated
    cohort.free()
    assert not api.allocated


def test_a_member_that_cannot_map_device_memory_gets_its_own_copy_of_the_run(
    outputs: JobOutputs, api: FakeApi
) -> None:
    cohort = Cohort("sweep", ("key",), outputs, 16 * PAGE, lambda pid, ns: False)
    first, staged, third = _member(1), _member(2, device="staged"), _member(3)
    for job in (first, staged, third):
        cohort.join(job.member)
    producer, follower = first.batch(0), staged.batch(0)
    cohort.take(producer)
    cohort.take(follower)
    (_, mine), (batch, theirs) = _run(cohort, producer, 1.0)
    assert isinstance(mine, BatchReady)
    # None: the executor writes the run into the member's own (staged) memory.
    assert batch is follower and theirs is None and follower.cohort_entry is None
    assert cohort.status().copied == 1
    # The others still share it: a member that comes later is given the same region.
    outcome, later = cohort.take(third.batch(0))
    assert outcome == Outcome.HIT and later is not None
    assert _gpu(later).offset == _gpu(mine).offset and _gpu(later).slab == _gpu(mine).slab
    # A batch of the staged member that comes once a run is done runs for it alone.
    leading = first.batch(1)
    cohort.take(leading)
    _run(cohort, leading, 2.0)
    assert cohort.take(staged.batch(1))[0] == Outcome.ALONE


def test_a_run_whose_producer_cannot_map_device_memory_is_still_shared_by_the_others(
    outputs: JobOutputs, api: FakeApi
) -> None:
    cohort = Cohort("sweep", ("key",), outputs, 16 * PAGE, lambda pid, ns: False)
    staged, first, second = _member(1, device="staged"), _member(2), _member(3)
    for job in (staged, first, second):
        cohort.join(job.member)
    producer = staged.batch(0)
    assert cohort.take(producer)[0] == Outcome.RUN
    assert cohort.take(first.batch(0))[0] == Outcome.FOLLOW
    (batch, own), (_, mine) = _run(cohort, producer, 1.0)
    # The producer's rows go to its own memory from the run; the follower maps the cohort's.
    assert batch is producer and own is None and producer.cohort_entry is None
    assert isinstance(mine, BatchReady) and mine.event
    outcome, theirs = cohort.take(second.batch(0))
    assert outcome == Outcome.HIT and theirs is not None
    assert (_gpu(theirs).slab, _gpu(theirs).offset) == (_gpu(mine).slab, _gpu(mine).offset)
    # One run, served to three members: two hits, one copy (the producer's own).
    status = cohort.status()
    assert (status.runs, status.hits, status.copied) == (1, 2, 1)
    # The producer was never given the cohort's slabs: it maps none of them.
    assert not outputs.store("cuda").maps(1)  # type: ignore[attr-defined]
    assert outputs.store("cuda").maps(2)  # type: ignore[attr-defined]


def test_members_gone_let_go_of_the_slabs_their_processes_mapped(
    outputs: JobOutputs, api: FakeApi
) -> None:
    alive = {1: True, 2: True}
    cohort = Cohort("sweep", ("key",), outputs, 16 * PAGE, lambda pid, ns: alive[pid])
    first, second = _member(1), _member(2)
    cohort.join(first.member)
    cohort.join(second.member)
    producer = first.batch(0)
    cohort.take(producer)
    cohort.take(second.batch(0))
    _run(cohort, producer, 1.0)
    first.member.closed = second.member.closed = True
    cohort.peer_leaving(1, [])  # its goodbye: it unmapped everything
    cohort.leave(first.member, pid=1, namespace=0)
    cohort.leave(second.member, pid=2, namespace=0)
    assert cohort.close()  # the second member's process lives, and may map the slab
    assert _awaiting(cohort) and api.allocated
    cohort.reap()
    assert _awaiting(cohort)
    alive[2] = False  # killed: its mappings went with it
    cohort.reap()
    assert not _awaiting(cohort) and not api.allocated
    cohort.free()
    assert ("destroy_stream", 7) in api.calls


def _awaiting(cohort: Cohort) -> bool:
    return cohort.awaiting_peers
