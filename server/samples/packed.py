"""An input's samples that stay packed in their frame: 1-D samples of several lengths, such as
file paths, viewed one at a time only where one is asked for.

``InputBatch.arrays`` makes a list of one view a sample of such an input (a numpy slice each,
some 36 µs for 256 paths). A pipeline that reads them as files needs no view at all: DALI takes
them as one padded array made from the frame's bytes and the samples' offsets in a few numpy
steps (``paths.padded_paths``). So the planner keeps a path input of several lengths as
:class:`PackedSamples`, a sequence whose views are made only by those that still ask for
samples one by one (a bad sample's search, a pipeline that also returns its paths).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np


class PackedSamples(Sequence[np.ndarray]):
    """Sample ``i`` is ``flat[bounds[i]:bounds[i + 1]]``; ``bounds`` has one more offset
    than there are samples (int64s, in elements of ``flat``, the first 0)."""

    __slots__ = ("bounds", "flat")

    def __init__(self, flat: np.ndarray, bounds: np.ndarray) -> None:
        self.flat = flat
        self.bounds = bounds

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, index: slice) -> list[np.ndarray]: ...

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        position = operator.index(index)
        if position < 0:
            position += len(self)
        if not 0 <= position < len(self):
            raise IndexError(index)
        return self.flat[self.bounds[position] : self.bounds[position + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        flat = self.flat
        return (flat[a:b] for a, b in itertools.pairwise(self.bounds.tolist()))

    @classmethod
    def joined(cls, parts: Sequence[PackedSamples]) -> PackedSamples:
        """The samples of ``parts``, one after another, packed anew (one copy of their
        bytes: a run of several batches)."""
        flat = np.concatenate([part.flat[: part.bounds[-1]] for part in parts])
        offsets = np.cumsum([0, *(int(part.bounds[-1]) for part in parts[:-1])])
        bounds = np.concatenate(
            [
                *(part.bounds[:-1] + offset for part, offset in zip(parts, offsets, strict=True)),
                [offsets[-1] + parts[-1].bounds[-1]],
            ]
        )
        return cls(flat, bounds.astype(np.int64))
