"""A forked child never unmaps the slab mappings of the process it was forked from (Note [Slab
mappings across fork] in ``dalid.protocol.slabs``), with real segments and a real fork."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from dalid.client.outputs.shm import SharedMemoryOutputs
from dalid.protocol import OutputDescriptor, slabs
from dalid.server.outputs.pool import PAGE
from dalid.server.outputs.shm import SharedMemorySlab

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


# mmap(2) flags of Linux (MAP_FIXED_NOREPLACE since 4.17: refuses a range where anything is).
_PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED_NOREPLACE = 0x100000


def _own_memory_at(address: int, size: int) -> np.ndarray:
    """``size`` bytes of new anonymous memory at exactly ``address``, which must be free."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE
    got = libc.mmap(address, size, _PROT_READ_WRITE, flags, -1, 0)
    assert got == address, f"no memory at {address:#x}: {os.strerror(ctypes.get_errno())}"
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))


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
        # The child's own memory where the trainer's mapping was, as a worker's allocations
        # come to be: the range is free in the child, which did not inherit that mapping
        # (MADV_DONTFORK). Placed there on purpose, not left to where the kernel puts it.
        own = _own_memory_at(where, SIZE)
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
