"""Private copies: a batch delivered outside the job's output memory once the trainer holds it all.

Note [Private copies]
---------------------
A trainer that keeps its outputs (``kept.append(batch)``: validation metrics, embeddings) holds
the regions they view for as long as it keeps them; DALI's proxy gives it new tensors each step,
so such a loop works there and must work here. A job normally holds a few batches at once (Note
[A job's window] in run_planner.py); a trainer that holds them all and waits for another one
for ``PRIVATE_COPY_AFTER_S`` makes its batches pass that window (point 4 there), and its output
memory grows up to its quota (``memory_bytes``); when a batch does not fit and no region comes
back for ``PRIVATE_COPY_AFTER_S``, the batch is delivered as a private copy instead of waiting
for ever. A loop that releases its batches never gets one:

1. Its CPU outputs are copied into host buffers of their own and travel as frames of its
   ``batch_ready`` (``copies``, one per output, in output order); their descriptors name no slab
   (``slab`` "", ``region_id`` 0). Nothing of the job's memory is leased for them.
2. Its GPU outputs, for a trainer that maps CUDA IPC and says so (``device_copies`` in its
   ``hello``), stay on the device: the daemon writes them, on the job's stream, into regions of
   the job's *copy memory* (``CudaStore.copy_pool``: slabs of the job's device memory outside
   its pool, at most ``COPY_BATCHES`` batches of the batch at hand), and records the batch's
   event, as for any GPU output; their descriptors say ``copy``, and their frames are empty.
   The trainer, on taking the batch, makes its stream wait for the event, copies each region
   into a tensor of its own (device to device, from torch's caching allocator), and lets the
   region go at once: its release goes with a fence recorded after that copy. No host copy
   and no host wait on either side. Where the copy memory has no room now (the trainer has
   not taken the earlier copies yet) or cannot be had, the GPU outputs go through the host as
   frames instead (device to host in the daemon, host to device in the trainer): the
   executor never waits for copy memory, since the copies that hold it may be of batches the
   trainer takes only after this one. So do GPU outputs for a trainer that does not map CUDA
   IPC (its GPU outputs are staged) or does not say ``device_copies`` (an older one).
3. The trainer makes tensors of its own from the frames and the copy regions (on its GPU for a
   GPU output); they are its to keep, and nothing is released for them once taken.
4. Only a trainer whose ``hello`` says it takes copies (``private_copies``) gets them; an older
   one waits for its memory as before.
5. Until a region of the job's pool comes back, later batches that do not fit are copied at
   once, without the wait; the first release ends that (the pool is in use again). Releases
   of copy regions do not count: they say nothing about the memory the trainer keeps.
6. The daemon says so once per job in its log, and counts the batches (``batches_copied`` in
   ``dalid status``, and ``batches_copied_on_device`` of them, whose GPU outputs stayed on the
   device; the copy memory counts in the job's slabs and in ``copy_slab_bytes``). Memory stays
   bounded: a frame leaves the daemon as soon as it is sent, the copy memory holds
   ``COPY_BATCHES`` batches and goes with the job's (an idle copy slab is freed as the job's
   pool frees its own: Note [Output buffer lifetime], point 4), and the trainer asks for
   batches at its own pace (a DataLoader's prefetch).
7. A cohort's keeper (Note [Cohort outputs], point 6, in runs/cohorts.py) gets its copies the
   same way: its GPU outputs from the cohort's device memory into the member's copy memory, on
   the member's stream after the cohort's (no host wait under the cohort's lock), and the
   cohort's stream after that copy before it writes the regions again.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .pool import Region, RegionPool

# How long a batch waits for the trainer to release a region before it goes as a copy.
PRIVATE_COPY_AFTER_S = 1.0
# Batches of GPU outputs a job's copy memory holds at once (point 2 of the note).
COPY_BATCHES = 2


class CopiedOutput(Protocol):
    """What a copy reads of one output of a run (``outputs.RunOutput``, whose module builds on
    this one to deliver private copies)."""

    tensors: Any

    def dense(self) -> Any: ...

    def row_bytes(self, rows: range) -> int: ...


class DeviceCopies(Protocol):
    """The store that keeps a job's GPU outputs' private copies on the device (point 2 of the
    note): ``cuda.CudaStore``, for a trainer that maps CUDA IPC."""

    device: str
    copy_pool: RegionPool

    @property
    def stream(self) -> int | None: ...

    def holds(self, output: Any) -> bool: ...

    def copy_regions(self, sizes: Sequence[int]) -> list[Region] | None:
        """Regions of ``sizes`` in the copy memory, all or none; None where it has no room now
        (never waits)."""

    def write_copies(
        self,
        regions: Sequence[Region],
        outputs: Sequence[Any],
        rows: range,
        others: bool,
        source_stream: int | None,
    ) -> str:
        """Copies ``rows`` of each of a run's ``outputs`` into its region, on the job's stream
        (``others``: the batch has outputs elsewhere); the batch's event handle."""

    def copy_from(self, source: DeviceCopies, copies: Sequence[tuple[Region, int]]) -> str:
        """Copies device memory of ``source``'s (each region's bytes from the address paired
        with it) into these regions, on the job's stream after ``source``'s work queued so
        far, and ``source``'s later work after these copies; the batch's event handle."""

    def export(self, region: Region) -> str: ...


def private_copy(output: CopiedOutput, rows: range, nbytes: int) -> np.ndarray:
    """The bytes of ``rows`` of one output of a run (CPU or GPU) in a new host buffer."""
    if not nbytes:
        return np.empty(0, dtype=np.uint8)
    dense = output.dense()
    if dense is not None:
        # A GPU output comes through the host (as_cpu waits for it); a CPU one is copied once.
        host = dense.as_cpu() if "GPU" in type(dense).__name__ else dense
        return host_copy(host.data_ptr() + rows.start * output.row_bytes(rows), nbytes)
    buffer = np.empty(nbytes, dtype=np.uint8)
    address = buffer.ctypes.data
    for row in rows:
        sample = output.tensors[row]
        sample = sample.as_cpu() if "GPU" in type(sample).__name__ else sample
        sample.copy_to_external(ctypes.c_void_p(address))
        address += output.row_bytes(rows)
    return buffer


def host_copy(address: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of host memory from ``address`` in a new buffer: a private copy's bytes."""
    buffer = np.empty(nbytes, dtype=np.uint8)
    if nbytes:
        ctypes.memmove(buffer.ctypes.data, address, nbytes)
    return buffer
