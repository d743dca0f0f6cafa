"""The trainer's view of a CPU output: a tensor on the slab's bytes, its region released once
no view of it is left, and a region that does not hold its shape refused."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from dalid.client.outputs.shm import SharedMemoryOutputs
from dalid.protocol import OutputDescriptor, slabs

SIZE = 1 << 20


@pytest.fixture
def segment() -> Iterator[str]:
    """A slab segment as the daemon leaves it: float32 0, 1, 2, ... from byte 4096 on."""
    name = slabs.new_name()
    fd = os.open(slabs.SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        slabs.write_record(fd, SIZE, slabs.SlabRecord(os.getpid(), "dalid-wraptest-j1-1"))
        os.pwrite(fd, np.arange(64, dtype=np.float32).tobytes(), 4096)
    finally:
        os.close(fd)
    yield name
    (slabs.SHM_DIR / name).unlink(missing_ok=True)


def _region(
    slab: str, region_id: int, offset: int, nbytes: int, shape: tuple[int, ...]
) -> OutputDescriptor:
    return OutputDescriptor(region_id, slab, SIZE, offset, nbytes, "float32", shape)


def test_a_tensor_views_its_region_of_the_slab_in_place(segment: str) -> None:
    outputs = SharedMemoryOutputs()
    try:
        (tensor,) = outputs.wrap([_region(segment, 1, 4096 + 16 * 4, 32 * 4, (4, 8))])
        assert tensor.shape == (4, 8)
        assert tensor.flatten().tolist() == list(range(16, 48))
        # Written through the tensor, read from the segment: the same memory, no copy.
        tensor[0, 0] = -1.0
        with open(slabs.SHM_DIR / segment, "rb") as file:
            file.seek(4096 + 16 * 4)
            assert np.frombuffer(file.read(4), np.float32)[0] == -1.0
        del tensor
    finally:
        gc.collect()
        outputs.close()


def test_a_region_goes_back_only_once_its_last_view_is_gone(segment: str) -> None:
    outputs = SharedMemoryOutputs()
    try:
        (tensor,) = outputs.wrap([_region(segment, 5, 4096, 64 * 4, (8, 8))])
        row = tensor[3]  # a view the user keeps after the batch's tensor is gone
        del tensor
        gc.collect()
        assert outputs.releases() == []
        assert row.tolist() == list(range(24, 32))
        del row
        gc.collect()
        (release,) = outputs.releases()
        assert release.region_ids == (5,)
    finally:
        outputs.close()


@pytest.mark.parametrize("shape", [(4, 9), (3, 8), ()])
def test_a_region_that_does_not_hold_its_shape_is_refused(segment: str, shape: Any) -> None:
    outputs = SharedMemoryOutputs()
    try:
        with pytest.raises(ValueError):
            outputs.wrap([_region(segment, 2, 4096, 32 * 4, shape)])
        assert outputs.live_regions == 0
    finally:
        outputs.close()
