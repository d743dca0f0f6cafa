"""A slab's memory is reserved when it is made: a full /dev/shm is an error then, never a SIGBUS
at the first write. On a real tmpfs of a few MiB, mounted for the test (needs root)."""

from __future__ import annotations

import ctypes
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dalid.protocol import slabs
from dalid.server.outputs.pool import RegionPool, SlabUnavailable
from dalid.server.outputs.shm import SharedMemoryBackend, SharedMemorySlab

MIB = 1 << 20


@pytest.fixture
def small_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A 4 MiB tmpfs standing for /dev/shm, in this process only."""
    if os.getuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "shm"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr!r}")
    monkeypatch.setattr(slabs, "SHM_DIR", where)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def fill(where: Path) -> Path:
    """Fills the tmpfs as another process would, until it has no page left."""
    filler = where / "filler"
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True, check=False
    )
    return filler


def test_a_slab_that_does_not_fit_is_refused_when_made_and_leaves_nothing(
    small_shm: Path,
) -> None:
    with pytest.raises(SlabUnavailable) as refused:
        SharedMemorySlab("dalid-test-j1-1", 8 * MIB)
    message = str(refused.value)
    assert f"{small_shm} is full" in message and "dalid-test-j1-1" in message
    assert "--shm-size" in message and "--memory-limit" in message
    assert not list(small_shm.iterdir())


def test_a_slab_made_before_shm_filled_up_is_written_whole(small_shm: Path) -> None:
    # Without the reservation, this write of pages tmpfs no longer has raises SIGBUS.
    with SharedMemorySlab("dalid-test-j1-1", MIB) as slab:
        filler = fill(small_shm)
        assert filler.stat().st_size > 2 * MIB  # the rest was taken
        ctypes.memset(slab.address(0), 7, slab.size)
        assert bytes(slab.view(slab.size - 4, 4)) == b"\x07" * 4
        filler.unlink()
    assert not list(small_shm.iterdir())


def test_a_pool_that_cannot_grow_fails_the_allocation_and_stays_usable(
    small_shm: Path,
) -> None:
    pool = RegionPool(SharedMemoryBackend(), "dalid-test-j1", 8 * MIB, MIB)
    try:
        (first,) = pool.allocate([MIB // 2])
        filler = fill(small_shm)
        # All or none: the region that fit in the first slab is given back too.
        with pytest.raises(SlabUnavailable, match="is full"):
            pool.allocate([MIB // 4, 2 * MIB])
        assert pool.leased_regions == 1 and pool.slab_count == 1
        filler.unlink()
        regions = pool.allocate([MIB // 4, 2 * MIB])
        assert [r.nbytes for r in regions] == [MIB // 4, 2 * MIB]
        pool.release([first.region_id, *(r.region_id for r in regions)])
    finally:
        pool.close()
    assert not list(small_shm.iterdir())
