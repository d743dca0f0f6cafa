"""The trainer's side of the output pool: map each slab once, view regions as torch tensors.

See Note [Output buffer lifetime] in ``dalid.server.pool`` for the whole contract. This side
keeps its half: a region is released only after the last tensor viewing it is gone, and a
mapping is closed only once no tensor views it.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dalid.protocol import OutputDescriptor

SHM_DIR = Path("/dev/shm")


@dataclass
class _Mapping:
    map: mmap.mmap
    bytes: np.ndarray


class SlabMappings:
    """Shared-memory slabs mapped into this process, each once; ``close()`` unmaps them.

    Tensors handed out keep their slab's pages alive on their own (through the numpy view
    they hold), so closing this object while tensors live is safe: those mappings are left
    to be unmapped when the last view goes.
    """

    def __init__(self) -> None:
        self._mappings: dict[str, _Mapping] = {}
        # Region ids whose last view died; filled from any thread by GC, drained by the session.
        self.released: collections.deque[int] = collections.deque()
        self.opened = 0

    def tensor(self, descriptor: OutputDescriptor) -> torch.Tensor:
        """A CPU tensor viewing the region of ``descriptor`` without a copy."""
        if descriptor.device != "cpu":
            raise ValueError(f"output on {descriptor.device!r}: this client maps CPU outputs only")
        mapping = self._mapping(descriptor.slab, descriptor.slab_size)
        region = mapping.bytes[descriptor.offset : descriptor.offset + descriptor.nbytes]
        array = region.view(np.dtype(descriptor.dtype)).reshape(descriptor.shape)
        # torch keeps `array` alive for as long as any tensor shares this storage; when the
        # last one goes, `array` dies and the region returns to the daemon.
        weakref.finalize(array, self.released.append, descriptor.region_id)
        return torch.from_numpy(array)

    def take_released(self) -> list[int]:
        released = []
        while self.released:
            released.append(self.released.popleft())
        return released

    def close(self) -> None:
        """Unmaps every slab that no tensor views any more. Idempotent."""
        mappings, self._mappings = self._mappings, {}
        for mapping in mappings.values():
            del mapping.bytes
            # A tensor that still views it keeps it: the mapping goes with the last view.
            with contextlib.suppress(BufferError):
                mapping.map.close()

    def _mapping(self, name: str, size: int) -> _Mapping:
        mapping = self._mappings.get(name)
        if mapping is None:
            if "/" in name or not name.startswith("dalid-"):
                raise ValueError(f"refusing to map {name!r}: not a dalid slab name")
            fd = os.open(SHM_DIR / name, os.O_RDWR)
            try:
                if os.fstat(fd).st_size < size:
                    raise ValueError(f"slab {name} is smaller than the daemon says ({size})")
                shared = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            # DataLoader workers forked later must not inherit the trainer's mappings.
            shared.madvise(mmap.MADV_DONTFORK)
            mapping = _Mapping(shared, np.frombuffer(shared, dtype=np.uint8))
            self._mappings[name] = mapping
            self.opened += 1
        return mapping
