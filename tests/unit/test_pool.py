"""The output pool on real POSIX shared memory (/dev/shm), as the daemon uses it."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import mmap
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from dalid.client.outputs.shm import SharedMemoryOutputs
from dalid.protocol import OutputDescriptor, ReleaseRegions, slabs
from dalid.protocol.slabs import SHM_DIR
from dalid.server.jobs.quotas import QuotaRefused
from dalid.server.jobs.reservations import OutputMemory
from dalid.server.outputs.pool import (
    ALIGNMENT,
    GROWTH_REGIONS,
    IDLE_SLAB_S,
    PAGE,
    PoolClosed,
    PoolFull,
    PoolTooSmall,
    Region,
    RegionPool,
    Slab,
)
from dalid.server.outputs.shm import SharedMemoryBackend, SharedMemorySlab

# How long a test waits for something that should happen at once (a thread waking up).
PROMPT_S = 5.0
# How long a test watches for something that should not happen (a blocked thread finishing).
QUIET_S = 0.2

PoolFactory = Callable[..., RegionPool]


def _shm(slab: Slab) -> SharedMemorySlab:
    """A slab of these pools, which are all of shared memory."""
    assert isinstance(slab, SharedMemorySlab)
    return slab


def _view(region: Region) -> np.ndarray:
    return _shm(region.slab).view(region.offset, region.nbytes)


def _segments(prefix: str) -> list[str]:
    """The segments of slabs whose label (the pool's name for them) starts with ``prefix``."""
    return sorted(
        path.name for path, record in slabs.user_segments() if record.label.startswith(prefix)
    )


@pytest.fixture
def prefix() -> Iterator[str]:
    """A slab label prefix of this test's own; no segment with it may outlive the test."""
    # The segments' records name this process, alive while the test runs, so neither a daemon
    # starting up nor a concurrent test session takes them for stale ones.
    name = f"dalid-{os.getpid()}-unittest-{uuid.uuid4().hex[:12]}"
    yield name
    gc.collect()
    leftovers = _segments(name)
    for leftover in leftovers:
        (SHM_DIR / leftover).unlink(missing_ok=True)
    assert not leftovers, f"segments left behind in {SHM_DIR}: {leftovers}"


@pytest.fixture
def make_pool(prefix: str) -> Iterator[PoolFactory]:
    """Builds pools on SharedMemoryBackend; closes them and checks /dev/shm afterwards."""
    pools: list[RegionPool] = []

    def make(limit_pages: int, slab_pages: int = 1) -> RegionPool:
        pool = RegionPool(SharedMemoryBackend(), prefix, limit_pages * PAGE, slab_pages * PAGE)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()
        assert pool.slab_count == 0
    assert _segments(prefix) == []


def _allocate_now(pool: RegionPool, sizes: Sequence[int]) -> list[Region]:
    """Allocates without waiting: PoolClosed if the sizes do not fit right now."""
    attempts = itertools.count()
    return pool.allocate(sizes, cancelled=lambda: next(attempts) > 0, poll_interval=0.001)


def _fits_now(pool: RegionPool, sizes: Sequence[int]) -> bool:
    try:
        regions = _allocate_now(pool, sizes)
    except PoolClosed:
        return False
    pool.release([region.region_id for region in regions])
    return True


def _span(region: Region) -> tuple[str, int, int]:
    end = region.offset + -(-max(region.nbytes, 1) // ALIGNMENT) * ALIGNMENT
    return region.slab.name, region.offset, end


class _Allocator(threading.Thread):
    """Calls ``pool.allocate`` in a thread; ``done`` is set when it returned or raised."""

    def __init__(self, pool: RegionPool, sizes: Sequence[int], **kwargs: object) -> None:
        super().__init__(daemon=True)
        self.pool, self.sizes, self.kwargs = pool, sizes, kwargs
        self.started = threading.Event()
        self.done = threading.Event()
        self.regions: list[Region] | None = None
        self.error: BaseException | None = None
        self.start()
        assert self.started.wait(PROMPT_S)

    def run(self) -> None:
        self.started.set()
        try:
            self.regions = self.pool.allocate(self.sizes, **self.kwargs)  # type: ignore[arg-type]
        except BaseException as error:
            self.error = error
        finally:
            self.done.set()

    def finish(self) -> None:
        assert self.done.wait(PROMPT_S), "the allocating thread is still blocked"
        self.join(PROMPT_S)


def test_the_leased_bytes_are_read_while_an_allocation_holds_the_pool(
    make_pool: PoolFactory,
) -> None:
    # ``dalid status`` reads them on the daemon's I/O thread, while an executor may hold the
    # pool's lock making or freeing a slab: every message waited for that.
    pool = make_pool(limit_pages=4, slab_pages=2)
    (region,) = pool.allocate([1000])
    holding, done = threading.Event(), threading.Event()

    def allocation() -> None:
        with pool._condition:
            holding.set()
            done.wait(300)  # past the per-test timeout: a read that waits for it fails

    thread = threading.Thread(target=allocation)
    thread.start()
    try:
        assert holding.wait(30)
        assert pool.leased_bytes == 1024
    finally:
        done.set()
        thread.join(30)
    pool.release([region.region_id])
    pool.close()
    assert pool.leased_bytes == 0


# --- Allocation and reuse -----------------------------------------------------------------------


def test_allocate_release_reuse(make_pool: PoolFactory, prefix: str) -> None:
    pool = make_pool(limit_pages=4, slab_pages=2)
    (first,) = pool.allocate([1000])
    assert first.nbytes == 1000
    assert first.offset == 0
    assert first.slab.label.startswith(prefix)  # type: ignore[attr-defined]
    assert slabs.is_slab_name(first.slab.name)
    assert first.slab.size == 2 * PAGE
    assert pool.slab_count == 1
    assert pool.leased_regions == 1
    assert pool.leased_bytes == 1024

    assert pool.release([first.region_id]) == []
    assert pool.leased_regions == 0
    assert pool.leased_bytes == 0

    (second,) = pool.allocate([1000])
    assert second.region_id != first.region_id
    assert (second.slab.name, second.offset) == (first.slab.name, 0)
    assert pool.slab_count == 1
    pool.release([second.region_id])


def test_steady_use_does_not_grow_the_pool(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=8, slab_pages=2)
    ids: set[int] = set()
    for round_ in range(200):
        regions = pool.allocate([100 + round_ % 7 * 300, 2000, 5])
        ids.update(region.region_id for region in regions)
        assert pool.release([region.region_id for region in regions]) == []
    assert len(ids) == 600  # every region id is new
    assert pool.slab_count == 1
    assert pool.slab_bytes_total == 2 * PAGE


def test_regions_are_aligned_and_disjoint(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=8, slab_pages=2)
    sizes = [1, 255, 256, 257, 0, 1000, 3000, 17]
    regions = pool.allocate(sizes)
    more = pool.allocate([13, 700])
    everything = regions + more
    assert [region.nbytes for region in regions] == sizes
    assert all(region.offset % ALIGNMENT == 0 for region in everything)
    assert len({region.region_id for region in everything}) == len(everything)
    spans = sorted(_span(region) for region in everything)
    for (slab_a, _, end_a), (slab_b, start_b, _) in itertools.pairwise(spans):
        assert slab_a != slab_b or end_a <= start_b, f"regions overlap: {spans}"
    for region in everything:
        assert region.offset + region.nbytes <= region.slab.size
    pool.release([region.region_id for region in everything])
    assert pool.leased_bytes == 0


def test_a_region_larger_than_a_slab_gets_its_own_slab(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=8, slab_pages=1)
    (small,) = pool.allocate([10])
    (large,) = pool.allocate([3 * PAGE + 1])
    assert large.slab.name != small.slab.name
    assert large.slab.size == 4 * PAGE
    assert large.offset == 0
    pool.release([small.region_id, large.region_id])


# --- Free-list coalescing -----------------------------------------------------------------------


def test_freed_neighbours_coalesce(make_pool: PoolFactory) -> None:
    # One slab of one page and no room for another: whatever fits must fit in that page.
    pool = make_pool(limit_pages=1, slab_pages=1)
    quarter = PAGE // 4
    a, b, c, d = (pool.allocate([quarter])[0] for _ in range(4))
    assert [r.offset for r in (a, b, c, d)] == [0, quarter, 2 * quarter, 3 * quarter]
    assert not _fits_now(pool, [1])

    # Merge with the following block: free b, then a.
    pool.release([b.region_id])
    pool.release([a.region_id])
    (ab,) = _allocate_now(pool, [2 * quarter])
    assert ab.offset == 0

    # Merge with the preceding block: free ab, then c.
    pool.release([ab.region_id])
    pool.release([c.region_id])
    (abc,) = _allocate_now(pool, [3 * quarter])
    assert abc.offset == 0

    # Merge on both sides: free abc and d around a block freed last.
    pool.release([abc.region_id, d.region_id])
    (whole,) = _allocate_now(pool, [PAGE])
    assert whole.offset == 0
    pool.release([whole.region_id])
    assert pool.slab_count == 1


def test_a_block_freed_between_two_free_blocks_merges_with_both(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=1, slab_pages=1)
    quarter = PAGE // 4
    a, b, c, d = (pool.allocate([quarter])[0] for _ in range(4))
    pool.release([a.region_id, c.region_id])
    assert not _fits_now(pool, [2 * quarter])  # two free quarters, not adjacent
    pool.release([b.region_id])
    (abc,) = _allocate_now(pool, [3 * quarter])
    assert abc.offset == 0
    pool.release([abc.region_id, d.region_id])
    assert _fits_now(pool, [PAGE])


# --- All or nothing, limits ---------------------------------------------------------------------


def test_allocation_is_all_or_nothing(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=2, slab_pages=1)
    (held,) = pool.allocate([PAGE])
    # Two pages are wanted, one is left: nothing may be taken.
    with pytest.raises(PoolClosed):
        _allocate_now(pool, [PAGE, PAGE])
    assert pool.leased_regions == 1
    assert pool.leased_bytes == PAGE
    (single,) = _allocate_now(pool, [PAGE])  # the page left is still free
    pool.release([single.region_id, held.region_id])

    regions = _allocate_now(pool, [PAGE, 100])
    assert [region.nbytes for region in regions] == [PAGE, 100]
    assert regions[0].slab.name != regions[1].slab.name
    pool.release([region.region_id for region in regions])


def test_pool_too_small(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=2, slab_pages=1)
    with pytest.raises(PoolTooSmall, match="--pool-bytes"):
        pool.allocate([2 * PAGE + 1])
    with pytest.raises(PoolTooSmall):
        pool.allocate([PAGE, PAGE, 1])
    assert pool.slab_count == 0
    assert pool.leased_regions == 0
    # The whole pool at once is not too much.
    regions = pool.allocate([PAGE, PAGE])
    pool.release([region.region_id for region in regions])


def test_pool_too_small_is_raised_even_while_the_pool_is_full(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=1, slab_pages=1)
    (held,) = pool.allocate([PAGE])
    with pytest.raises(PoolTooSmall):
        pool.allocate([2 * PAGE])  # must not wait for `held`
    pool.release([held.region_id])


def test_a_batch_that_never_fits_in_slabs_fails_at_once(make_pool: PoolFactory) -> None:
    # Four pages may be held, slabs are two pages. A three-page output takes a three-page slab;
    # the small output needs a new two-page slab: five pages, although the sizes sum to four.
    pool = make_pool(limit_pages=4, slab_pages=2)
    deadline = time.monotonic() + 0.5
    try:
        regions = pool.allocate([3 * PAGE, 8], cancelled=lambda: time.monotonic() > deadline)
    except PoolTooSmall:
        return  # refusing at once is a fix
    except PoolClosed:
        pytest.fail("allocate waited for memory that an empty pool can never provide")
    pool.release([region.region_id for region in regions])  # fitting it is a fix too


# --- Backpressure -------------------------------------------------------------------------------


def test_allocate_blocks_until_release(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=1, slab_pages=1)
    (held,) = pool.allocate([PAGE])
    waiter = _Allocator(pool, [PAGE // 2])
    assert not waiter.done.wait(QUIET_S), "allocate returned although the pool is full"
    assert pool.release([held.region_id]) == []
    waiter.finish()
    assert waiter.error is None
    assert waiter.regions is not None
    assert [region.offset for region in waiter.regions] == [0]
    assert pool.slab_count == 1
    pool.release([region.region_id for region in waiter.regions])


def test_release_wakes_a_waiter_without_polling_delay(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=1, slab_pages=1)
    (held,) = pool.allocate([PAGE])
    waiter = _Allocator(pool, [PAGE], poll_interval=60.0)
    assert not waiter.done.wait(QUIET_S)
    pool.release([held.region_id])
    waiter.finish()  # well before the 60 s poll: release notifies
    assert waiter.regions is not None
    pool.release([region.region_id for region in waiter.regions])


def test_close_raises_pool_closed_in_a_waiting_allocator(
    make_pool: PoolFactory, prefix: str
) -> None:
    pool = make_pool(limit_pages=1, slab_pages=1)
    pool.allocate([PAGE])
    waiter = _Allocator(pool, [PAGE], poll_interval=60.0)
    assert not waiter.done.wait(QUIET_S)
    pool.close()
    waiter.finish()
    assert isinstance(waiter.error, PoolClosed)
    assert _segments(prefix) == []
    with pytest.raises(PoolClosed):
        pool.allocate([1])
    pool.close()  # idempotent


def test_cancelled_is_honoured_while_waiting(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=1, slab_pages=1)
    (held,) = pool.allocate([PAGE])
    stop = threading.Event()
    waiter = _Allocator(pool, [PAGE], cancelled=stop.is_set, poll_interval=0.01)
    assert not waiter.done.wait(QUIET_S)
    stop.set()
    waiter.finish()
    assert isinstance(waiter.error, PoolClosed)
    assert pool.leased_regions == 1
    pool.release([held.region_id])


def test_cancelled_before_the_first_attempt(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=1, slab_pages=1)
    with pytest.raises(PoolClosed):
        pool.allocate([1], cancelled=lambda: True)
    assert pool.leased_regions == 0


# --- Eviction of empty slabs --------------------------------------------------------------------


def test_empty_slabs_are_evicted_for_a_larger_slab(make_pool: PoolFactory, prefix: str) -> None:
    pool = make_pool(limit_pages=4, slab_pages=1)
    singles = [pool.allocate([PAGE])[0] for _ in range(4)]
    assert pool.slab_count == 4
    kept = singles[0]
    pool.release([region.region_id for region in singles[1:]])
    evicted = {region.slab.name for region in singles[1:]}

    (large,) = _allocate_now(pool, [3 * PAGE])
    assert large.slab.size == 3 * PAGE
    assert pool.slab_bytes_total <= pool.limit_bytes
    assert pool.slab_count == 2
    names = set(_segments(prefix))
    assert kept.slab.name in names  # a slab with a leased region is never evicted
    assert not evicted & names  # evicted slabs are unlinked
    assert names == {kept.slab.name, large.slab.name}

    # The kept region is intact and usable.
    view = _view(kept)
    view[:] = 7
    assert int(view.sum()) == 7 * PAGE
    del view
    pool.release([kept.region_id, large.region_id])


def test_eviction_frees_small_empty_slabs_first(make_pool: PoolFactory, prefix: str) -> None:
    pool = make_pool(limit_pages=8, slab_pages=1)
    (big,) = pool.allocate([3 * PAGE])
    smalls = [pool.allocate([PAGE])[0] for _ in range(5)]
    pool.release([big.region_id, *(region.region_id for region in smalls)])
    assert pool.slab_bytes_total == 8 * PAGE

    # Four pages do not fit the empty three-page slab; freeing four one-page slabs is enough.
    (four,) = _allocate_now(pool, [4 * PAGE])
    assert big.slab.name in _segments(prefix)
    assert pool.slab_count == 3
    pool.release([four.region_id])


def test_no_eviction_while_every_slab_is_leased(make_pool: PoolFactory, prefix: str) -> None:
    pool = make_pool(limit_pages=2, slab_pages=1)
    held = pool.allocate([PAGE, PAGE])
    before = _segments(prefix)
    assert not _fits_now(pool, [2 * PAGE])
    assert _segments(prefix) == before
    pool.release([region.region_id for region in held])
    (both,) = _allocate_now(pool, [2 * PAGE])  # now both empty slabs make way
    assert pool.slab_count == 1
    pool.release([both.region_id])


# --- Release bookkeeping ------------------------------------------------------------------------


def test_release_returns_unknown_ids(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=2, slab_pages=1)
    a, b = pool.allocate([10, 20])
    assert pool.release([999, a.region_id, -1]) == [999, -1]
    assert pool.release([a.region_id]) == [a.region_id]  # already released
    assert pool.release([b.region_id, b.region_id]) == [b.region_id]
    assert pool.release([]) == []
    assert pool.leased_regions == 0
    (c,) = pool.allocate([10])
    pool.close()
    assert pool.release([c.region_id]) == [c.region_id]  # the pool is gone


# --- The shared memory itself -------------------------------------------------------------------


def test_writes_through_the_view_are_visible_in_another_mapping(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=4, slab_pages=2)
    _, region = pool.allocate([300, 5000])
    pattern = np.arange(region.nbytes, dtype=np.uint32).astype(np.uint8)
    view = _view(region)
    assert view.shape == (region.nbytes,)
    assert view.ctypes.data == region.slab.address(region.offset)
    view[:] = pattern

    # What the trainer does: open the segment by name and map it on its own.
    fd = os.open(SHM_DIR / region.slab.name, os.O_RDWR)
    try:
        # The slab, then its record (see dalid.protocol.slabs).
        assert os.fstat(fd).st_size == region.slab.size + slabs.RECORD_BYTES
        other = mmap.mmap(fd, region.slab.size)
    finally:
        os.close(fd)
    try:
        seen = other[region.offset : region.offset + region.nbytes]
        assert seen == pattern.tobytes()
        # And the other way round.
        other[region.offset : region.offset + 4] = b"\x01\x02\x03\x04"
        assert view[:4].tolist() == [1, 2, 3, 4]
    finally:
        other.close()
    del view
    pool.release([region.region_id])


def test_the_trainer_mapping_views_a_region_as_a_tensor(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=4, slab_pages=2)
    expected = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    other, region = pool.allocate([64, expected.nbytes])
    assert other.slab is region.slab
    view = _view(region)
    view[:] = expected.view(np.uint8).reshape(-1)
    del view
    descriptor = OutputDescriptor(
        region_id=region.region_id,
        slab=region.slab.name,
        slab_size=region.slab.size,
        offset=region.offset,
        nbytes=region.nbytes,
        dtype="float32",
        shape=expected.shape,
        device=_shm(region.slab).device,
    )
    mappings = SharedMemoryOutputs()
    try:
        small_descriptor = dataclasses.replace(
            descriptor,
            region_id=other.region_id,
            offset=other.offset,
            nbytes=other.nbytes,
            dtype="uint8",
            shape=(other.nbytes,),
        )
        tensor, small = mappings.wrap([descriptor, small_descriptor], "")
        assert mappings.opened == 1  # each slab is mapped once
        assert isinstance(tensor, torch.Tensor)
        np.testing.assert_array_equal(tensor.numpy(), expected)
        assert mappings.releases() == []
        view_of_tensor = tensor[1]
        del tensor
        gc.collect()
        assert mappings.releases() == []  # a view of the tensor still uses the region
        del view_of_tensor
        gc.collect()
        assert mappings.releases() == [ReleaseRegions((region.region_id,))]
        del small
        gc.collect()
        assert mappings.releases() == [ReleaseRegions((other.region_id,))]
        assert pool.release([region.region_id, other.region_id]) == []
    finally:
        mappings.close()


def test_the_trainer_refuses_names_that_are_not_slabs() -> None:
    mappings = SharedMemoryOutputs()
    for name in ("passwd", "../dalid-x", "dalid-a/b"):
        descriptor = OutputDescriptor(1, name, PAGE, 0, 4, "uint8", (4,))
        with pytest.raises(ValueError, match="refusing"):
            mappings.wrap([descriptor], "")
    mappings.close()


def test_closing_the_pool_keeps_live_views_valid_and_unlinks_names(
    make_pool: PoolFactory, prefix: str
) -> None:
    pool = make_pool(limit_pages=2, slab_pages=1)
    (region,) = pool.allocate([PAGE])
    fd = os.open(SHM_DIR / region.slab.name, os.O_RDWR)
    try:
        trainer = mmap.mmap(fd, region.slab.size)
    finally:
        os.close(fd)
    daemon_view = _shm(region.slab).view(0, PAGE)
    daemon_view[:8] = 42
    pool.close()
    assert _segments(prefix) == []
    # Both the trainer's mapping and a view the daemon still held keep the pages.
    assert trainer[:8] == bytes([42] * 8)
    daemon_view[8:16] = 43
    assert trainer[8:16] == bytes([43] * 8)
    trainer.close()
    del daemon_view


def test_segments_are_private_to_the_user(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=1, slab_pages=1)
    (region,) = pool.allocate([1])
    info = os.stat(SHM_DIR / region.slab.name)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.getuid()
    pool.release([region.region_id])


def test_segments_are_private_whatever_the_umask(prefix: str) -> None:
    old = os.umask(0)
    try:
        slab = SharedMemorySlab(f"{prefix}-umask", PAGE)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(SHM_DIR / slab.name).st_mode) == 0o600
    finally:
        slab.close()


def test_slab_names_are_unguessable_and_say_nothing(prefix: str) -> None:
    with (
        SharedMemorySlab(f"{prefix}-j7-1", PAGE) as first,
        SharedMemorySlab(f"{prefix}-j7-1", PAGE) as second,
    ):
        assert first.name != second.name
        for slab in (first, second):
            assert slabs.is_slab_name(slab.name)
            assert str(os.getpid()) not in slab.name and "j7" not in slab.name
            # What the name no longer says, the segment's record does (for its user only).
            assert slabs.read_record(SHM_DIR / slab.name) == slabs.SlabRecord(
                os.getpid(), f"{prefix}-j7-1"
            )
            # The record lies past the slab: the mapped bytes are all the slab's.
            assert os.stat(SHM_DIR / slab.name).st_size == PAGE + slabs.RECORD_BYTES
    assert _segments(prefix) == []


def test_a_slab_never_clobbers_a_file_planted_under_its_name(
    prefix: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Were a name guessed, O_EXCL | O_NOFOLLOW keep the daemon off what was planted there."""
    planted_name = slabs.new_name()
    target = tmp_path / "victim"
    target.write_bytes(b"keep me")
    (SHM_DIR / planted_name).symlink_to(target)
    try:
        monkeypatch.setattr(slabs, "new_name", lambda: planted_name)
        with pytest.raises(FileExistsError):
            SharedMemorySlab(f"{prefix}-x", PAGE)
        assert (SHM_DIR / planted_name).is_symlink()  # the failed attempt did not unlink it
        assert target.read_bytes() == b"keep me"
    finally:
        (SHM_DIR / planted_name).unlink()
    assert _segments(prefix) == []


@pytest.mark.parametrize("size", [0, -PAGE, PAGE + 1, PAGE // 2])
def test_slab_size_must_be_whole_pages(prefix: str, size: int) -> None:
    with pytest.raises(ValueError, match="multiple"):
        SharedMemorySlab(f"{prefix}-bad", size)


def test_slab_close_is_idempotent(prefix: str) -> None:
    slab = SharedMemorySlab(f"{prefix}-once", 2 * PAGE)
    slab.close()
    slab.close()
    with pytest.raises(ValueError, match="closed"):
        slab.view(0, 1)


def test_evicted_slabs_are_reported_once_for_the_trainer(make_pool: PoolFactory) -> None:
    pool = make_pool(limit_pages=2, slab_pages=1)
    singles = [pool.allocate([PAGE])[0] for _ in range(2)]
    assert pool.take_retired() == []
    pool.release([region.region_id for region in singles])
    (large,) = _allocate_now(pool, [2 * PAGE])
    assert sorted(pool.take_retired()) == sorted(region.slab.name for region in singles)
    assert pool.take_retired() == []
    pool.release([large.region_id])


def test_close_without_unmap_unlinks_but_keeps_memory_writable(
    make_pool: PoolFactory, prefix: str
) -> None:
    pool = make_pool(limit_pages=1)
    (region,) = pool.allocate([PAGE])
    slab = _shm(region.slab)
    pool.close(unmap=False)
    assert _segments(prefix) == []
    # A writer that could not be stopped still has its memory (no crash).
    view = slab.view(region.offset, region.nbytes)
    view[:] = 3
    assert int(view.sum()) == 3 * PAGE
    del view
    slab.close()


def test_a_pool_held_full_gives_up_after_the_wait_then_at_once(make_pool: PoolFactory) -> None:
    # Note [Private copies] in dalid.server.outputs.copies: the caller then delivers a copy.
    pool = make_pool(limit_pages=1)
    held = pool.allocate([PAGE])
    started = time.monotonic()
    with pytest.raises(PoolFull):
        pool.allocate([64], give_up_after=QUIET_S)
    assert time.monotonic() - started >= QUIET_S
    started = time.monotonic()
    with pytest.raises(PoolFull):  # nothing released since: no second wait
        pool.allocate([64], give_up_after=PROMPT_S)
    assert time.monotonic() - started < PROMPT_S / 2
    # Once the trainer releases again, a full pool waits for its releases as it always did.
    pool.release([held[0].region_id])
    held = pool.allocate([PAGE])
    releaser = threading.Timer(QUIET_S, pool.release, [[held[0].region_id]])
    releaser.start()
    try:
        other = pool.allocate([PAGE], give_up_after=PROMPT_S)
    finally:
        releaser.join()
    assert len(other) == 1
    pool.release([other[0].region_id])


# --- Pools that grow as their outputs need room (a job's reservation) ---------------------------


def test_a_growing_pool_reserves_slabs_sized_from_its_outputs(prefix: str) -> None:
    memory = OutputMemory(limit=64 * PAGE)
    reservation = memory.growing(cap=32 * PAGE)
    pool = RegionPool(SharedMemoryBackend(), prefix, 64 * PAGE, 16 * PAGE)
    pool.grow_within(reservation)
    try:
        assert memory.reserved == 0  # nothing until an output needs room
        (region,) = pool.allocate([PAGE - 100])
        # Room for GROWTH_REGIONS such outputs, not a whole slab_bytes.
        assert pool.limit_bytes == GROWTH_REGIONS * PAGE == memory.reserved
        held = [pool.allocate([PAGE - 100])[0] for _ in range(GROWTH_REGIONS - 1)]
        assert pool.slab_count == 1  # they share the slab
        pool.allocate([PAGE - 100])  # the trainer holds them all: the pool grows
        assert memory.reserved == 2 * GROWTH_REGIONS * PAGE
        pool.release([r.region_id for r in [region, *held]])
        assert memory.reserved == 2 * GROWTH_REGIONS * PAGE  # kept for the next batches
    finally:
        pool.close()
    assert memory.reserved == 0 and reservation.closed


def test_a_growing_pool_waits_at_the_daemons_limit_and_refuses_when_it_holds_nothing(
    prefix: str,
) -> None:
    memory = OutputMemory(limit=6 * PAGE)
    other = memory.fixed(4 * PAGE)
    pool = RegionPool(SharedMemoryBackend(), prefix, 64 * PAGE, PAGE)
    pool.grow_within(memory.growing(64 * PAGE))
    try:
        (first,) = pool.allocate([PAGE])
        (second,) = pool.allocate([PAGE])
        assert memory.reserved == 6 * PAGE
        assert not _fits_now(pool, [PAGE])  # full: it waits for a release, as any full pool
        pool.release([first.region_id, second.region_id])
        with pytest.raises(
            PoolTooSmall,
            match=r"needs 12 KiB .* has 0 B left .* --memory-limit 24 KiB \(2 jobs hold 24 KiB\)",
        ):
            pool.allocate([3 * PAGE])
        other.close()
        (large,) = pool.allocate([3 * PAGE])  # the other job's memory is free again
        pool.release([large.region_id])
    finally:
        pool.close()
    assert memory.reserved == 0


def test_a_growing_pool_stops_at_its_cap(prefix: str) -> None:
    memory = OutputMemory(limit=0)
    pool = RegionPool(SharedMemoryBackend(), prefix, 64 * PAGE, PAGE)
    pool.grow_within(memory.growing(2 * PAGE))
    try:
        with pytest.raises(PoolTooSmall, match="more than its limit of 8 KiB"):
            pool.allocate([3 * PAGE])
        (region,) = pool.allocate([2 * PAGE])
        assert not _fits_now(pool, [PAGE])
        pool.release([region.region_id])
    finally:
        pool.close()


def test_a_fixed_reservation_is_refused_when_the_daemon_has_not_that_much_left() -> None:
    memory = OutputMemory(limit=3 << 20)
    kept = memory.fixed(2 << 20)
    with pytest.raises(
        QuotaRefused, match=r"asks for 2 MiB .* has 1 MiB left .* 3 MiB \(1 jobs hold 2 MiB\)"
    ):
        memory.fixed(2 << 20)
    assert memory.reserved == 2 << 20
    kept.close()
    kept.close()
    assert memory.reserved == 0
    memory.fixed(3 << 20).close()


def test_a_growing_pool_has_room_for_what_it_may_still_reserve(prefix: str) -> None:
    # A shared pipeline takes a job's batch only where its outputs have room (run_planner.py).
    memory = OutputMemory(limit=4 * PAGE)
    pool = RegionPool(SharedMemoryBackend(), prefix, 64 * PAGE, PAGE)
    pool.grow_within(memory.growing(3 * PAGE))
    try:
        assert pool.limit_bytes == 0
        assert pool.has_room([3 * PAGE])  # its cap
        assert not pool.has_room([3 * PAGE + 1])
        other = memory.fixed(2 * PAGE)
        assert pool.has_room([2 * PAGE]) and not pool.has_room([3 * PAGE])  # the daemon's limit
        other.close()
    finally:
        pool.close()


def test_a_pool_says_how_many_batches_it_could_hold_and_holds_them(prefix: str) -> None:
    # A job's window is no wider than this (Note [A job's window] in run_planner.py).
    memory = OutputMemory(limit=64 * PAGE)
    pool = RegionPool(SharedMemoryBackend(), prefix, 64 * PAGE, PAGE)
    pool.grow_within(memory.growing(11 * PAGE))
    try:
        batch = [2 * PAGE + 1, 100]  # images of 3 pages, labels of one
        assert pool.sets_fit(batch) == 2
        held = [pool.allocate(batch) for _ in range(2)]  # it holds what it said, without waiting
        assert pool.sets_fit(batch) == 2  # the same with the memory reserved
        other = memory.fixed(48 * PAGE)
        assert pool.sets_fit(batch) == 2  # what it holds already is its own
        other.close()
        pool.release([region.region_id for regions in held for region in regions])
        # The daemon's limit leaves it less to grow into: what it holds, and 2 pages more.
        other = memory.fixed(64 * PAGE - pool.limit_bytes - 2 * PAGE)
        assert pool.sets_fit([PAGE]) == pool.limit_bytes // PAGE + 2
        assert pool.sets_fit(batch) == (pool.limit_bytes + 2 * PAGE) // (4 * PAGE)
        other.close()
    finally:
        pool.close()


def test_slabs_no_lease_needed_for_a_while_are_freed(prefix: str) -> None:
    # A pool grown for a wider window (a DALI instance since dropped) goes back to what its
    # job holds at once (Note [Output buffer lifetime]).
    now = [0.0]
    memory = OutputMemory(limit=64 * PAGE)
    pool = RegionPool(SharedMemoryBackend(), prefix, 64 * PAGE, PAGE, clock=lambda: now[0])
    pool.grow_within(memory.growing(32 * PAGE))
    try:
        wide = [pool.allocate([2 * PAGE])[0] for _ in range(3)]  # three batches at once
        pool.release([region.region_id for region in wide])
        assert pool.slab_count == 3
        for _ in range(6):  # then one at a time, for a while
            (region,) = pool.allocate([2 * PAGE])
            pool.release([region.region_id])
            now[0] += IDLE_SLAB_S / 3
            # The look at IDLE_SLAB_S found three held at once in the period before it.
            assert pool.slab_count == 3
        (region,) = pool.allocate([2 * PAGE])  # the next look: one at a time since the last
        assert pool.slab_count == 1 and pool.slab_bytes_total == 2 * PAGE
        retired = pool.take_retired()
        assert len(retired) == 2 and region.slab.name not in retired
        assert _segments(prefix) == [region.slab.name]  # the others are unlinked
        (second,) = pool.allocate([2 * PAGE])  # it grows again as it did
        assert pool.slab_count == 2
        pool.release([region.region_id, second.region_id])
    finally:
        pool.close()
