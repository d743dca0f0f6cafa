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

1. Its outputs are copied into host buffers of their own (a GPU output through the host) and
   travel as frames of its ``batch_ready`` (``copies``, one per output, in output order); their
   descriptors name no slab (``slab`` "", ``region_id`` 0). Nothing of the job's memory is leased.
2. The trainer makes tensors of its own from the frames (on its GPU for a GPU output); they
   are its to keep, and nothing is released for them.
3. Only a trainer whose ``hello`` says it takes copies (``private_copies``) gets them; an older
   one waits for its memory as before.
4. Until a region of the job comes back, later batches that do not fit are copied at once,
   without the wait; the first release ends that (the pool is in use again).
5. The daemon says so once per job in its log, and counts the batches (``batches_copied`` in
   ``dalid status``). Memory stays bounded: a copy leaves the daemon as soon as it is sent, and
   the trainer asks for batches at its own pace (a DataLoader's prefetch).
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import numpy as np

# How long a batch waits for the trainer to release a region before it goes as a copy.
PRIVATE_COPY_AFTER_S = 1.0


class CopiedOutput(Protocol):
    """What a copy reads of one output of a run (``outputs.RunOutput``, whose module builds on
    this one to deliver private copies)."""

    tensors: Any

    def dense(self) -> Any: ...

    def row_bytes(self, rows: range) -> int: ...


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
