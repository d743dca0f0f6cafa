"""The output-store interface: one job's memory of one kind, as the daemon's other parts see it.

A job has one :class:`OutputStore` per kind of memory the daemon delivers outputs in: POSIX
shared memory for CPU outputs (``shm.py``) and, on a GPU daemon, device memory exported through
CUDA IPC (``cuda_store.py``) or pinned shared memory (``cuda_staged.py``) for GPU outputs. A
store carves regions out of slabs it creates and exports once (a
:class:`~dalid.server.outputs.pool.RegionPool` over its slab backend), copies DALI outputs into
them, and takes them back when the trainer releases them. Also here: the streams a shared
pipeline hands its outputs over on, and the one sequence of region ids of a job's stores.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from typing import Any, Protocol

import numpy as np

from .pool import Region, RegionPool
from .run_output import RunOutput


class OutputRoute(StrEnum):
    """How a job's outputs reach its trainer, as ``dalid status`` and ``output_path`` say."""

    SHM = "shm"  # CPU outputs only, in shared memory
    CUDA_IPC = "cuda_ipc"  # GPU outputs in the daemon's device memory, opened by CUDA IPC
    STAGED = "staged"  # GPU outputs staged in shared memory, uploaded by the trainer


class ReleaseRefused(ValueError):
    """A release the job's stores cannot apply (a fence for memory that takes none, say)."""


class OutputStore(Protocol):
    """One job's output memory of one kind, and how DALI outputs get into it.

    ``device`` is what descriptors of its regions say ("cpu", "cuda", "staged"); ``takes`` the
    DALI outputs it holds ("cpu" or "cuda": DALI's CPU or GPU TensorLists). ``stream`` is the CUDA
    stream the store writes on, on which DALI may hand outputs over (None: the host).
    ``peer_ordered``: releases of its regions come with the trainer's fence, and its slabs are
    freed only once the trainer reports them unmapped (device memory; Note [GPU output
    lifetime]). Only such a store is given fences and unmapped slabs.
    """

    device: str
    takes: str
    pool: RegionPool
    peer_ordered: bool

    @property
    def stream(self) -> int | None: ...

    def holds(self, output: Any) -> bool:
        """Whether a DALI output (a TensorList) lies in this store's kind of memory."""

    def prepare(self, others: bool, source_stream: int | None) -> None:
        """Called before a batch's outputs are copied; ``others``: some go to other stores.
        ``source_stream``: the stream DALI handed the outputs over on (None: the host)."""

    def write(self, region: Region, output: RunOutput, rows: range) -> None:
        """Copies ``rows`` of one output of a run into ``region``."""

    def export(self, region: Region) -> str:
        """The handle a descriptor of ``region`` carries ("" where the slab name is enough);
        from then on the trainer may map its slab."""

    def read(self, address: int, nbytes: int) -> np.ndarray:
        """``nbytes`` at ``address`` of one of its regions, in a new host buffer (a private
        copy of a region still leased: ``JobOutputs.copies_of``)."""

    def finish(self, wrote: bool, source_stream: int | None) -> str:
        """Called once a batch's outputs are copied; the batch's event handle, or ""."""

    def fence(self, event: str) -> None:
        """Later writes wait for the trainer's release fence ``event`` (hex); raises
        ReleaseRefused for one that cannot be used."""

    def peer_unmapped(self, slabs: Sequence[str]) -> None:
        """The trainer reports these slabs unmapped."""

    def peer_leaving(self, kept: Sequence[str]) -> None:
        """The trainer, ending its job, still maps ``kept`` and has unmapped every other slab."""

    def close(self, unmap: bool) -> bool:
        """Closes the pool (``unmap=False``: a writer could not be stopped); whether memory is
        left that the trainer still maps, which :meth:`free` frees once it is gone."""

    def free(self) -> None:
        """Frees everything left. Idempotent."""


class Stream(Protocol):
    """A CUDA stream that a pipeline shared by several jobs hands its outputs over on; each
    job's store orders its copies after it (``prepare``) and it after them (``finish``)."""

    handle: int

    def close(self) -> None: ...


StreamFactory = Callable[[], "Stream | None"]
"""A new stream for a shared pipeline; None where outputs are ready on the host (CPU daemon)."""


def no_streams() -> Stream | None:
    """The stream factory of a CPU daemon: DALI hands outputs over on the host."""
    return None


def region_ids() -> Iterator[int]:
    """One sequence of region ids for all the stores of a job."""
    return itertools.count(1)
