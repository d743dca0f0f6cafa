"""Memory backends of the output pool: where a slab's bytes live.

A slab is one block of memory that the daemon creates and maps once and exports to a trainer
by name; regions of it carry batch outputs. The shared-memory backend below holds CPU outputs;
the device backend in ``cuda.py`` (CUDA IPC) exports GPU slabs the same way, so the pool above
does not care.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from typing import Protocol

import numpy as np

from dalid.protocol import slabs

PAGE = mmap.PAGESIZE


class Slab(Protocol):
    """One exported block of memory; ``close()`` is idempotent and frees it.

    ``device`` is the descriptor's: "cpu" or "cuda". ``view`` is for host memory only.
    """

    name: str
    size: int
    device: str

    def address(self, offset: int) -> int: ...

    def view(self, offset: int, nbytes: int) -> np.ndarray: ...

    def copy_into(self, offset: int, source: object) -> None: ...

    def close(self, unmap: bool = True) -> None: ...


class SlabBackend(Protocol):
    device: str

    def create(self, name: str, size: int) -> Slab: ...


class SharedMemorySlab:
    """A POSIX shared-memory segment (``/dev/shm/<random name>``, mode 0600), mapped once.

    ``label`` is the daemon's name for it; the segment's own name is a fresh unguessable one
    (``name``), and the label and this process's pid go in its record (see
    :mod:`dalid.protocol.slabs`). The daemon owns it: ``close()`` unmaps it and unlinks the
    name. A trainer that still maps it keeps its pages until it unmaps them (POSIX semantics),
    so closing never pulls memory from under a tensor; only the name disappears.
    """

    device = "cpu"

    def __init__(self, label: str, size: int) -> None:
        if size <= 0 or size % PAGE:
            raise ValueError(f"slab size must be a positive multiple of {PAGE}, got {size}")
        self.label = label
        self.name = slabs.new_name()
        self.size = size
        self._path = slabs.SHM_DIR / self.name
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self._path, flags, 0o600)
        try:
            slabs.write_record(fd, size, slabs.SlabRecord(os.getpid(), label))
            # A child forked by the daemon (a Python operator's worker, say) neither inherits
            # the mapping nor can unmap it (Note [Slab mappings across fork]).
            self._map: mmap.mmap | None = slabs.map_slab(fd, size)
        except BaseException:
            os.close(fd)
            self._path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self._bytes: np.ndarray | None = np.frombuffer(self._map, dtype=np.uint8)
        self._base = self._bytes.ctypes.data

    def address(self, offset: int) -> int:
        return self._base + offset

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        if self._bytes is None:
            raise ValueError(f"slab {self.name} is closed")
        return self._bytes[offset : offset + nbytes]

    def copy_into(self, offset: int, source: object) -> None:
        """Copies a DALI CPU tensor (``copy_to_external``) into the slab at ``offset``."""
        source.copy_to_external(ctypes.c_void_p(self.address(offset)))  # type: ignore[attr-defined]

    def close(self, unmap: bool = True) -> None:
        """Unlinks the name and, with ``unmap``, unmaps the memory. Idempotent."""
        if self._map is None:
            return
        self._path.unlink(missing_ok=True)
        if not unmap:
            return  # the mapping stays until the daemon exits
        # Views handed out by view() must be gone by now; the numpy base is ours to drop.
        self._bytes = None
        # A view still alive somewhere in the daemon keeps the mapping until the GC takes it;
        # the name goes now all the same, so nothing else can attach.
        with contextlib.suppress(BufferError):
            self._map.close()
        self._map = None

    def __enter__(self) -> SharedMemorySlab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SharedMemoryBackend:
    """Creates :class:`SharedMemorySlab`s for CPU outputs."""

    device = "cpu"

    def create(self, name: str, size: int) -> SharedMemorySlab:
        """A new slab; ``name`` becomes its label (its segment gets a name of its own)."""
        return SharedMemorySlab(name, size)
