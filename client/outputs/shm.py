"""The shared-memory output backend: map each slab once, view regions as CPU torch tensors.

The contract is protocol/SPEC.md, "Outputs", rules 1 to 6. This side keeps the trainer's half:
a region is released only after the last tensor viewing it is gone, and a mapping is closed
only once no tensor views it, and only by this process (Note [Slab mappings across fork] in
``dalid.protocol.slabs``).
"""

from __future__ import annotations

import collections
import math
import mmap
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dalid.protocol import OutputDescriptor, ReleaseRegions, slabs

from .copies import copied_tensor


def map_daemon_slab(name: str, size: int) -> mmap.mmap:
    """Maps the daemon's shared-memory slab ``name`` of ``size`` bytes, refusing anything that is
    not a dalid slab of this user's (the daemon runs as this user: its socket is checked)."""
    if not slabs.is_slab_name(name):
        raise ValueError(f"refusing to map {name!r}: not a dalid slab name")
    fd = os.open(slabs.SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            raise ValueError(f"refusing to map {name}: it belongs to uid {info.st_uid}")
        if info.st_size < size:
            raise ValueError(f"slab {name} is smaller than the daemon says ({size})")
        # DataLoader workers forked later get neither the mapping nor a way to unmap it.
        return slabs.map_slab(fd, size)
    finally:
        os.close(fd)


# numpy's dtype of each output dtype name, made once: np.dtype(name) parses the name each time.
_DTYPES: dict[str, np.dtype[Any]] = {}


@dataclass
class _Mapping:
    map: mmap.mmap
    bytes: np.ndarray | None


def _try_unmap(mapping: _Mapping) -> bool:
    """Unmaps the slab unless a tensor still views it; whether it is unmapped (or, in a forked
    child, forgotten: see Note [Slab mappings across fork] in ``dalid.protocol.slabs``)."""
    mapping.bytes = None
    if not slabs.mapped_here(mapping.map):
        return True
    try:
        mapping.map.close()
    except BufferError:
        return False
    return True


class SharedMemoryOutputs:
    """CPU outputs: shared-memory slabs mapped into this process, each once (an
    :class:`~dalid.client.outputs.outputs.OutputBackend`).

    Tensors handed out keep their slab's pages alive on their own (through the numpy view
    they hold), so unmapping while tensors live is safe: those mappings are left to be unmapped
    when the last view goes. The daemon needs no word of unmapped slabs, and nothing of the
    trainer's to wait on: a region is free for it once released.
    """

    # Its outputs are complete when their batch arrives: there is no event to open.
    events_opened = 0

    def __init__(self) -> None:
        self._mappings: dict[str, _Mapping] = {}
        # Region ids whose last view died; filled from any thread by GC, drained by releases().
        self.released: collections.deque[int] = collections.deque()
        self.opened = 0
        self.handed_out = 0
        self._returned = 0
        # Retired by the daemon but still viewed by a tensor: unmapped once no view is left.
        self._retiring: list[_Mapping] = []

    @property
    def live_regions(self) -> int:
        """Regions handed out as tensors that are not yet released."""
        return self.handed_out - self._returned - len(self.released)

    def wrap(self, outputs: Sequence[OutputDescriptor], event: str = "") -> list[torch.Tensor]:
        """CPU tensors viewing the regions of ``outputs`` without a copy (``event``: unused).

        Raises FileNotFoundError for a slab whose segment is gone.
        """
        return [self._tensor(descriptor) for descriptor in outputs]

    def _tensor(self, descriptor: OutputDescriptor) -> torch.Tensor:
        if descriptor.device != "cpu":
            raise ValueError(f"output on {descriptor.device!r} is not in shared memory")
        mapping = self._mapping(descriptor.slab, descriptor.slab_size)
        assert mapping.bytes is not None
        dtype = _DTYPES.get(descriptor.dtype) or _DTYPES.setdefault(
            descriptor.dtype, np.dtype(descriptor.dtype)
        )
        shape = descriptor.shape
        if math.prod(shape) * dtype.itemsize != descriptor.nbytes:
            raise ValueError(
                f"output region of {descriptor.nbytes} bytes does not hold a {shape} "
                f"{descriptor.dtype} array"
            )
        # One array made straight on the slab's bytes (its base, which keeps the mapping
        # alive), where a slice, a view and a reshape made three: this runs once per output
        # of every batch, and each step costs most in place, with the caches cold.
        array = np.ndarray(shape, dtype, mapping.bytes, descriptor.offset)
        # torch keeps `array` alive for as long as any tensor shares this storage; when the
        # last one goes, `array` dies and the region returns to the daemon.
        weakref.finalize(array, self.released.append, descriptor.region_id)
        self.handed_out += 1
        return torch.from_numpy(array)

    def releases(self) -> list[ReleaseRegions]:
        """The regions whose last view died since the last call, as one message (if any)."""
        released = []
        while self.released:
            released.append(self.released.popleft())
        self._returned += len(released)
        if self._retiring:
            self._retiring = [m for m in self._retiring if not _try_unmap(m)]
        return [ReleaseRegions(tuple(released))] if released else []

    def copy(self, output: OutputDescriptor, frame: memoryview) -> torch.Tensor:
        return copied_tensor(output, frame)

    def retire(self, slabs: Sequence[str]) -> None:
        """Unmaps slabs the daemon has freed (now, or once no tensor views them)."""
        for name in slabs:
            mapping = self._mappings.pop(name, None)
            if mapping is not None and not _try_unmap(mapping):
                self._retiring.append(mapping)

    def unmap(self) -> tuple[str, ...]:
        """Unmaps every slab that no tensor views any more. Idempotent.

        A slab that a tensor still views stays mapped until that view is gone: its numpy
        base holds the mapping, which Python unmaps when the last reference goes. The daemon
        may free such slabs all the same, so none is named for it to keep.
        """
        mappings, self._mappings = self._mappings, {}
        for mapping in [*mappings.values(), *self._retiring]:
            _try_unmap(mapping)
        self._retiring = []
        return ()

    def close(self) -> None:
        """Unmaps what ``unmap`` left (nothing, after it). Idempotent."""
        self.unmap()

    def _mapping(self, name: str, size: int) -> _Mapping:
        mapping = self._mappings.get(name)
        if mapping is None:
            shared = map_daemon_slab(name, size)
            mapping = _Mapping(shared, np.frombuffer(shared, dtype=np.uint8))
            self._mappings[name] = mapping
            self.opened += 1
        return mapping
