"""CPU outputs in POSIX shared memory: the slabs, and the job's store of them.

A slab is one shared-memory segment that the daemon creates and maps once and exports to a
trainer by name; regions of it carry batch outputs. :class:`SharedMemoryStore` is the output
store (``store.py``) of a job's CPU outputs; the CUDA IPC store in ``cuda_store.py`` is its twin
for GPU outputs.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from dalid.protocol import Limits, slabs

from .copies import host_copy
from .job_outputs import JobOutputs, OutputsFactory
from .pool import PAGE, Region, RegionPool, SlabUnavailable
from .run_output import RunOutput
from .store import region_ids


class SharedMemorySlab:
    """A POSIX shared-memory segment (``/dev/shm/<random name>``, mode 0600), mapped once,
    its pages reserved when it is made (:func:`reserve`; else :class:`SlabUnavailable`).

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
            reserve(fd, size + slabs.RECORD_BYTES, label)
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

    def copy_into(self, offset: int, source: Any) -> None:
        """Copies a DALI CPU tensor (``copy_to_external``) into the slab at ``offset``."""
        # A ctypes pointer: given a plain int, DALI's CPU copy crashes the process.
        source.copy_to_external(ctypes.c_void_p(self.address(offset)))

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


def reserve(fd: int, nbytes: int, label: str) -> None:
    """Allocates every page of the segment open on ``fd`` now.

    A segment that is only ``ftruncate``d gets its pages as they are first written; where
    tmpfs has none left (``/dev/shm`` filled by anyone, or at its size limit) that write
    raises SIGBUS and kills the daemon, and every job with it. Reserved here, a full
    ``/dev/shm`` is an error at creation, which fails one batch or one pool's growth.
    """
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        full = error.errno == errno.ENOSPC
        raise SlabUnavailable(
            f"{nbytes} bytes of shared memory for output slab {label} could not be reserved in "
            f"{slabs.SHM_DIR} ({reason})"
            + (f": {slabs.SHM_DIR} is full" if full else "")
            + f"; free space there or enlarge it (df {slabs.SHM_DIR}; in a container, "
            "--shm-size), or lower this daemon's --memory-limit"
        ) from None


class SharedMemoryBackend:
    """Creates :class:`SharedMemorySlab`s for CPU outputs."""

    def create(self, name: str, size: int) -> SharedMemorySlab:
        """A new slab; ``name`` becomes its label (its segment gets a name of its own)."""
        return SharedMemorySlab(name, size)


class SharedMemoryStore:
    """A job's CPU outputs: regions of shared-memory slabs, leased as Note [Output buffer
    lifetime] in ``pool.py`` says. The trainer maps a slab by its name alone."""

    device = "cpu"
    takes = "cpu"
    peer_ordered = False

    def __init__(self, name_prefix: str, limits: Limits, ids: Iterator[int] | None = None) -> None:
        self.pool = RegionPool(
            SharedMemoryBackend(),
            name_prefix,
            limits.pool_bytes,
            limits.slab_bytes,
            region_ids=ids,
        )

    @property
    def stream(self) -> int | None:
        return None  # host memory: written by the daemon's host, never on a stream

    def holds(self, output: Any) -> bool:
        return type(output).__name__ == "TensorListCPU"

    def prepare(self, others: bool, source_stream: int | None) -> None:
        pass

    def write(self, region: Region, output: RunOutput, rows: range) -> None:
        dense = output.dense()
        address = region.slab.address(region.offset)
        # ctypes.memmove lets go of the GIL while it copies; DALI's copy_to_external holds it,
        # and the daemon's I/O thread would wait out every batch's copy.
        if dense is not None:
            # The run's output, or a job's rows of a shared run: one contiguous block.
            start = dense.data_ptr() + rows.start * output.row_bytes(rows)
            ctypes.memmove(address, start, region.nbytes)
        else:
            # The run's samples differ in shape, this job's do not: sample by sample.
            size = output.row_bytes(rows)
            for row in rows:
                ctypes.memmove(address, output.tensors[row].data_ptr(), size)
                address += size

    def export(self, region: Region) -> str:
        return ""

    def read(self, address: int, nbytes: int) -> np.ndarray:
        return host_copy(address, nbytes)

    def finish(self, wrote: bool, source_stream: int | None) -> str:
        return ""

    def fence(self, event: str) -> None:
        pass

    def peer_unmapped(self, slabs: Sequence[str]) -> None:
        pass

    def peer_leaving(self, kept: Sequence[str]) -> None:
        pass

    def close(self, unmap: bool) -> bool:
        # A trainer that still maps a segment keeps its pages on its own (POSIX semantics).
        self.pool.close(unmap=unmap)
        return False

    def free(self) -> None:
        self.pool.close()


def host_outputs() -> OutputsFactory:
    """Output stores of a CPU daemon: shared memory only."""

    def outputs(name_prefix: str, limits: Limits) -> JobOutputs:
        return JobOutputs([SharedMemoryStore(name_prefix, limits, region_ids())])

    return outputs
