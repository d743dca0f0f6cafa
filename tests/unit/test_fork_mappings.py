"""A forked child never unmaps the slab mappings of the process it was forked from (Note [Slab
mappings across fork] in ``dalid.protocol.slabs``), with real segments and a real fork."""

from __future__ import annotations

import gc
import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from dalid.client.shm import SharedMemoryOutputs
from dalid.protocol import OutputDescriptor, slabs
from dalid.server.pool import PAGE
from dalid.server.shm import SharedMemorySlab

SIZE = 64 << 20  # a slab's default size: sparse until written


def _in_child(body) -> int:  # type: ignore[no-untyped-def]
    """Runs ``body`` in a forked child; its exit status (a signal N as 128 + N)."""
    pid = os.fork()
    if pid == 0:
        try:
            body()
            code = 0
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


@pytest.fixture
def segment() -> Iterator[str]:
    """A slab segment as the daemon leaves it (not mapped in this process): 16 bytes of 7."""
    name = slabs.new_name()
    fd = os.open(slabs.SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        slabs.write_record(fd, SIZE, slabs.SlabRecord(os.getpid(), "dalid-forktest-j1-1"))
        os.pwrite(fd, bytes([7] * 16), 0)
    finally:
        os.close(fd)
    yield name
    (slabs.SHM_DIR / name).unlink(missing_ok=True)


def test_a_child_that_frees_and_closes_inherited_mappings_keeps_its_own_memory(
    segment: str,
) -> None:
    mappings = SharedMemoryOutputs()
    tensors = mappings.wrap([OutputDescriptor(1, segment, SIZE, 0, 16, "uint8", (16,))])
    holder = [mappings]
    where = tensors[0].data_ptr()

    def child() -> None:
        # The kernel puts the child's own mapping of that size where the trainer's was: the
        # child did not inherit that one (MADV_DONTFORK).
        own = np.frombuffer(mmap.mmap(-1, SIZE), dtype=np.uint8)
        assert own.ctypes.data == where, "the child's memory is elsewhere: nothing to show"
        # What a worker may do with what it inherited: free it, close it, collect it.
        tensors.clear()
        holder[0].close()
        holder.clear()
        gc.collect()
        own[::PAGE] = 1  # SIGSEGV, had the child unmapped the trainer's range
        assert int(own.sum()) == SIZE // PAGE

    assert _in_child(child) == 0
    # The parent's mapping and tensor are untouched.
    assert torch.equal(tensors[0], torch.full((16,), 7, dtype=torch.uint8))
    tensors.clear()
    gc.collect()
    mappings.close()


def test_only_the_process_that_mapped_a_slab_may_unmap_it() -> None:
    with SharedMemorySlab(f"dalid-{os.getpid()}-forktest-j1-2", PAGE) as slab:
        fd = os.open(slabs.SHM_DIR / slab.name, os.O_RDWR)
        try:
            mapping = slabs.map_slab(fd, PAGE)
        finally:
            os.close(fd)
        assert slabs.mapped_here(mapping)
        assert _in_child(lambda: None if not slabs.mapped_here(mapping) else 1 / 0) == 0
        mapping.close()
