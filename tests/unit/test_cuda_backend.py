"""The daemon's GPU memory bookkeeping (server/outputs/cuda.py) on a fake CUDA API: no GPU needed.

What runs on a real GPU (CupyApi, the copies, IPC between processes) is in
tests/integration/test_gpu.py. Here: when slabs are freed, how events are reused, and how the
daemon applies the trainer's release fences, closed slabs and goodbye (Note [GPU output
lifetime]).
"""

from __future__ import annotations

import os
import queue
import uuid
from typing import Any

import pytest

from dalid.protocol import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Goodbye,
    Hello,
    Message,
    ReleaseRegions,
    Role,
    Welcome,
)
from dalid.server.handling.core import DaemonCore
from dalid.server.jobs.jobs import Job
from dalid.server.jobs.quotas import Quotas
from dalid.server.outputs.cuda import MAX_PEER_EVENTS, CudaBackend, CudaSlab, SlabState
from dalid.server.outputs.cuda_store import CudaStore, device_outputs
from dalid.server.outputs.pool import PAGE, RegionPool
from dalid.server.outputs.shm import host_outputs

from .fake_cuda import DEVICE_UUID, FakeApi

TRAINER = b"trainer"


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


def _backend(api: FakeApi, ring_size: int = 4) -> CudaBackend:
    return CudaBackend(0, api=api, ring_size=ring_size)


# --- slabs --------------------------------------------------------------------------------------


def test_a_slab_never_exported_is_freed_when_the_pool_lets_go(api: FakeApi) -> None:
    backend = _backend(api)
    slab = backend.create("s-1", 2 * PAGE)
    assert isinstance(slab, CudaSlab)
    assert api.allocated == {slab.ptr: 2 * PAGE}
    assert slab.ipc_handle == api.export_memory(slab.ptr).hex()
    assert slab.address(256) == slab.ptr + 256
    with pytest.raises(TypeError, match="no host view"):
        slab.view(0, 1)
    slab.close()
    slab.close()  # idempotent
    assert api.freed == [slab.ptr]
    assert backend.awaiting_peer == 0


def test_an_exported_slab_waits_until_the_trainer_unmapped_it(api: FakeApi) -> None:
    backend = _backend(api)
    slab = backend.create("s-1", PAGE)
    assert slab.export() == slab.ipc_handle
    slab.close()
    assert api.freed == []  # CUDA: freeing memory another process maps is undefined
    assert backend.awaiting_peer == 1
    backend.peer_closed(["unknown", "s-1"])
    assert api.freed == [slab.ptr]
    assert backend.awaiting_peer == 0
    backend.peer_closed(["s-1"])  # a repeated report changes nothing
    assert api.freed == [slab.ptr]


def test_a_slab_the_trainer_unmapped_first_is_freed_when_the_pool_lets_go(api: FakeApi) -> None:
    backend = _backend(api)
    slab = backend.create("s-1", PAGE)
    slab.export()
    backend.peer_closed(["s-1"])
    assert api.freed == []  # the pool still holds it
    slab.close()
    assert api.freed == [slab.ptr]


def test_a_slabs_state_follows_its_life(api: FakeApi) -> None:
    backend = _backend(api)
    alone, shared, kept = (backend.create(f"s-{n}", PAGE) for n in range(3))
    states: list[SlabState] = [alone.state, shared.state, kept.state]
    alone.close()
    shared.export()
    shared.close()
    states += [alone.state, shared.state]
    assert backend.awaiting_peer == 1
    backend.peer_closed(["s-1"])
    kept.close(unmap=False)
    kept.close()  # kept for good: a later close changes nothing
    states += [shared.state, kept.state]
    assert states == [
        *[SlabState.POOLED] * 3,
        SlabState.FREED,  # never exported: nobody else maps it
        SlabState.AWAITING_PEERS,  # exported: freed once the trainer unmapped it
        SlabState.FREED,
        SlabState.KEPT,
    ]
    assert api.freed == [alone.ptr, shared.ptr] and backend.awaiting_peer == 0


def test_a_goodbye_frees_all_but_the_kept_slabs(api: FakeApi) -> None:
    backend = _backend(api)
    slabs = [backend.create(f"s-{n}", PAGE) for n in range(3)]
    for slab in slabs:
        slab.export()
    backend.peer_kept(["s-1"])
    for slab in slabs:
        slab.close()
    assert sorted(api.freed) == sorted([slabs[0].ptr, slabs[2].ptr])
    assert backend.awaiting_peer == 1
    backend.close()  # the trainer is gone
    assert api.allocated == {}


def test_close_frees_everything_and_destroys_stream_and_events(api: FakeApi) -> None:
    backend = _backend(api)
    slab = backend.create("s-1", PAGE)
    slab.export()
    backend.record_batch()
    backend.wait_for_peer("ab" * 64)
    backend.close()
    backend.close()
    assert api.allocated == {}
    assert sorted(api.destroyed) == sorted([*api.events, *api.opened])
    assert ("destroy_stream", backend.stream) in api.calls


def test_memory_kept_for_a_writer_that_cannot_be_stopped(api: FakeApi) -> None:
    backend = _backend(api)
    kept = backend.create("s-1", PAGE)
    other = backend.create("s-2", PAGE)
    kept.close(unmap=False)
    other.close()
    backend.close()
    assert api.allocated == {kept.ptr: PAGE}  # that writer may still copy into it
    assert api.destroyed == []
    assert not any(call[0] == "destroy_stream" for call in api.calls)


# --- a cohort's slabs: one peer per member -------------------------------------------------------


def _shared(api: FakeApi) -> CudaBackend:
    return CudaBackend(0, api=api, ring_size=4, shared=True)


def test_a_cohorts_slab_is_freed_once_every_member_given_it_unmapped_it(api: FakeApi) -> None:
    backend = _shared(api)
    slab = backend.create("c-1", PAGE)
    slab.export()  # in the descriptors of a run: mapped by the members given them, no other
    backend.give(1, ["c-1"])
    backend.give(2, ["c-1", "unknown"])
    slab.close()
    assert api.freed == [] and backend.awaiting_peer == 1
    backend.peer_closed(["c-1"], peer=1)
    assert api.freed == []  # member 2 may still map it
    backend.peer_closed(["c-1"], peer=2)
    assert api.freed == [slab.ptr] and backend.awaiting_peer == 0


def test_a_cohorts_slab_no_member_was_given_is_freed_when_the_pool_lets_go(api: FakeApi) -> None:
    backend = _shared(api)
    slab = backend.create("c-1", PAGE)
    slab.export()
    slab.close()
    assert api.freed == [slab.ptr]


def test_a_member_gone_or_leaving_lets_go_of_what_it_mapped(api: FakeApi) -> None:
    backend = _shared(api)
    slabs = [backend.create(f"c-{n}", PAGE) for n in range(3)]
    for slab in slabs:
        slab.export()
    backend.give(1, ["c-0", "c-1", "c-2"])
    backend.give(2, ["c-0", "c-1"])
    backend.wait_for_peer("01" * 64, peer=1)
    backend.wait_for_peer("01" * 64, peer=2)  # another process's event: opened for each
    assert len(api.opened) == 2
    for slab in slabs:
        slab.close()
    backend.peer_kept(["c-1"], peer=2)  # member 2's goodbye: it still views c-1
    assert api.freed == []
    assert backend.maps(1) and backend.maps(2)
    backend.peer_gone(1)  # member 1 was killed: its mappings went with its process
    assert sorted(api.freed) == sorted([slabs[0].ptr, slabs[2].ptr])
    assert sorted(api.destroyed) == [min(api.opened)]  # its fence only
    assert not backend.maps(1) and backend.maps(2)
    backend.peer_gone(2)
    assert api.allocated == {} and not backend.maps(2)


def test_fences_are_bounded_per_member(api: FakeApi) -> None:
    backend = _shared(api)
    for n in range(MAX_PEER_EVENTS):
        backend.wait_for_peer(n.to_bytes(64, "little").hex(), peer=1)
    backend.wait_for_peer("ff" * 64, peer=2)  # another member's fences count apart
    with pytest.raises(ValueError, match="release events"):
        backend.wait_for_peer("ff" * 64, peer=1)


def test_a_gpu_region_is_read_to_the_host_after_the_copies_queued(api: FakeApi) -> None:
    backend = _backend(api)
    slab = backend.create("s-1", PAGE)
    copy = backend.read(slab.address(256), 64)
    assert copy.nbytes == 64
    (copied,) = [call for call in api.calls if call[0] == "copy_to_host"]
    assert copied[2:] == (slab.ptr + 256, 64, backend.stream)
    assert api.calls[-1] == ("synchronize", backend.stream)


# --- events -------------------------------------------------------------------------------------


def test_batch_events_form_a_ring_recorded_on_the_stream(api: FakeApi) -> None:
    backend = _backend(api, ring_size=3)
    handles = [backend.record_batch() for _ in range(7)]
    assert len(api.events) == 3  # created once, then reused
    assert handles[:3] == [event.to_bytes(64, "little").hex() for event in api.events]
    assert handles[3:] == handles[:3] + handles[:1]
    records = [call for call in api.calls if call[0] == "record"]
    assert [event for _, event, _ in records] == [100, 101, 102] * 2 + [100]
    assert {stream for _, _, stream in records} == {backend.stream}


def test_release_fences_are_opened_once_and_waited_on_each_time(api: FakeApi) -> None:
    backend = _backend(api)
    backend.wait_for_peer("01" * 64)
    backend.wait_for_peer("01" * 64)
    backend.wait_for_peer("02" * 64)
    assert list(api.opened.values()) == [b"\x01" * 64, b"\x02" * 64]
    waits = [call for call in api.calls if call[0] == "wait"]
    assert waits == [("wait", 7, 1000), ("wait", 7, 1000), ("wait", 7, 1001)]


def test_the_daemon_opens_a_bounded_number_of_release_fences(api: FakeApi) -> None:
    backend = _backend(api)
    for n in range(MAX_PEER_EVENTS):
        backend.wait_for_peer(n.to_bytes(64, "little").hex())
    with pytest.raises(ValueError, match="release events"):
        backend.wait_for_peer("ff" * 64)


def test_copies_go_on_the_job_stream(api: FakeApi) -> None:
    backend = _backend(api)
    slab = backend.create("s-1", PAGE)
    slab.copy_into(512, object())
    assert ("copy", slab.ptr + 512, backend.stream) in api.calls


# --- in a pool ----------------------------------------------------------------------------------


def test_a_retired_gpu_slab_is_freed_once_the_trainer_reports_it(api: FakeApi) -> None:
    backend = _backend(api)
    pool = RegionPool(backend, "dalid-test-cuda", 2 * PAGE, PAGE)
    singles = [pool.allocate([PAGE])[0] for _ in range(2)]
    for region in singles:
        assert isinstance(region.slab, CudaSlab)
        region.slab.export()
    pool.release([region.region_id for region in singles])
    (large,) = pool.allocate([2 * PAGE])  # the two empty slabs make way
    retired = pool.take_retired()
    assert sorted(retired) == sorted(region.slab.name for region in singles)
    assert api.freed == []
    backend.peer_closed(retired)
    assert sorted(api.freed) == sorted(region.slab.ptr for region in singles)  # type: ignore[attr-defined]
    pool.release([large.region_id])
    pool.close()
    backend.close()
    assert api.allocated == {}


# --- in the daemon core -------------------------------------------------------------------------


@pytest.fixture
def gpu_core(api: FakeApi) -> Any:
    pushed: queue.Queue[tuple[bytes, Message, int | None]] = queue.Queue()
    quotas = Quotas(max_batch_size=64, pool_bytes=4 * PAGE, slab_bytes=PAGE)
    core = DaemonCore(
        0,
        device_outputs(0, api=api),
        lambda peer, message, rid: pushed.put((peer, message, rid)),
        quotas,
        instance=f"unittest-{uuid.uuid4().hex[:8]}",
        device_uuid=DEVICE_UUID,
    )
    yield core
    core.close()
    assert api.allocated == {}


def _hello(core: DaemonCore) -> Welcome:
    reply = core.handle(TRAINER, Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER), 1)
    assert isinstance(reply, Welcome)
    return reply


def _gpu(job: Job) -> CudaStore:
    store = job.outputs.store("cuda")
    assert isinstance(store, CudaStore)
    return store


def test_the_welcome_names_the_gpu(gpu_core: DaemonCore) -> None:
    assert _hello(gpu_core).device_uuid == DEVICE_UUID


def test_region_ids_name_one_region_of_the_job(gpu_core: DaemonCore) -> None:
    welcome = _hello(gpu_core)
    job = gpu_core.jobs[welcome.job_id]
    cpu = job.outputs.store("cpu").pool.allocate([10, 10])
    gpu = _gpu(job).pool.allocate([10, 10])
    ids = [region.region_id for region in cpu + gpu]
    assert len(set(ids)) == 4
    assert gpu_core.handle(TRAINER, ReleaseRegions(tuple(ids)), None) is None
    assert job.outputs.leased_regions == 0


def test_gpu_regions_return_only_after_the_stream_waits_on_the_fence(
    gpu_core: DaemonCore, api: FakeApi
) -> None:
    welcome = _hello(gpu_core)
    job = gpu_core.jobs[welcome.job_id]
    pool = _gpu(job).pool
    (region,) = pool.allocate([100])
    leased_at_wait: list[int] = []
    api.on_wait.append(lambda: leased_at_wait.append(pool.leased_regions))
    fence = "5a" * 64
    reply = gpu_core.handle(TRAINER, ReleaseRegions((region.region_id,), event=fence), None)
    assert reply is None
    assert leased_at_wait == [1]  # the wait was queued while the region was still leased
    assert pool.leased_regions == 0
    assert list(api.opened.values()) == [bytes.fromhex(fence)]


def test_a_cpu_daemon_refuses_gpu_release_fields() -> None:
    core = DaemonCore(
        "cpu",
        host_outputs(),
        lambda *_: None,
        Quotas(max_batch_size=64, pool_bytes=4 * PAGE, slab_bytes=PAGE),
        instance=f"unittest-{uuid.uuid4().hex[:8]}",
    )
    try:
        assert _hello(core).device_uuid == ""
        for message in (ReleaseRegions(event="00" * 64), ReleaseRegions(closed_slabs=("x",))):
            reply = core.handle(TRAINER, message, None)
            assert isinstance(reply, Error)
            assert reply.code is ErrorCode.MALFORMED_MESSAGE
    finally:
        core.close()


def test_closed_slabs_free_retired_slabs(gpu_core: DaemonCore, api: FakeApi) -> None:
    welcome = _hello(gpu_core)
    job = gpu_core.jobs[welcome.job_id]
    pool = _gpu(job).pool
    singles = [pool.allocate([PAGE])[0] for _ in range(4)]
    for region in singles:
        region.slab.export()  # type: ignore[attr-defined]
    gpu_core.handle(TRAINER, ReleaseRegions(tuple(r.region_id for r in singles)), None)
    (large,) = pool.allocate([4 * PAGE])
    retired = tuple(pool.take_retired())
    assert len(retired) == 4
    assert api.freed == []
    gpu_core.handle(TRAINER, ReleaseRegions(closed_slabs=retired), None)
    assert len(api.freed) == 4
    gpu_core.handle(TRAINER, ReleaseRegions((large.region_id,)), None)


def test_slabs_the_trainer_keeps_outlive_the_job_until_it_exits(
    gpu_core: DaemonCore, api: FakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    welcome = _hello(gpu_core)
    job = gpu_core.jobs[welcome.job_id]
    backend = _gpu(job).backend
    regions = _gpu(job).pool.allocate([PAGE, PAGE])
    for region in regions:
        region.slab.export()  # type: ignore[attr-defined]
    kept, other = (region.slab for region in regions)
    gpu_core.handle(TRAINER, ReleaseRegions((), event="33" * 64), None)
    reply = gpu_core.handle(TRAINER, Goodbye(kept_slabs=(kept.name,)), 2)
    assert reply is not None and reply.OP == "ok"
    assert welcome.job_id not in gpu_core.jobs
    assert api.freed == [other.ptr]  # type: ignore[attr-defined]
    assert backend.awaiting_peer == 1
    # The trainer's fences are let go at once (it destroys them after the goodbye); the
    # daemon's own events stay until the trainer has gone.
    assert api.destroyed == list(api.opened)
    gpu_core.reap()
    assert api.freed == [other.ptr]  # type: ignore[attr-defined]  # our pid is alive
    monkeypatch.setattr(gpu_core.registry, "alive", lambda pid, namespace: False)
    gpu_core.reap()
    assert api.allocated == {}
    assert backend.closed


def test_a_dead_trainers_gpu_memory_is_freed_at_once(
    gpu_core: DaemonCore, api: FakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    welcome = _hello(gpu_core)
    job = gpu_core.jobs[welcome.job_id]
    for region in _gpu(job).pool.allocate([PAGE, 10]):
        region.slab.export()  # type: ignore[attr-defined]
    monkeypatch.setattr(gpu_core.registry, "alive", lambda pid, namespace: False)
    assert gpu_core.reap() == [welcome.job_id]
    assert api.allocated == {}
