"""Outputs that arrive as private copies: tensors of the trainer's own, not views of the daemon's.

A batch comes so when the job's output memory is all held by live tensors (a loop that keeps
its outputs): see protocol/SPEC.md, "Outputs", rule 4. Nothing is released for such tensors;
they live as long as the trainer keeps them, as with DALI's proxy. This module makes them from
frames; a GPU output's copy left on the device is copied on the GPU instead
(``CudaOutputs.take_copies`` in ``cuda.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from dalid.protocol import OutputDescriptor


def copied_tensor(descriptor: OutputDescriptor, frame: memoryview) -> torch.Tensor:
    """A CPU tensor holding the bytes of ``frame`` (copied once more: a received frame is
    read-only, and a tensor may be written to)."""
    array = np.frombuffer(frame, dtype=np.dtype(descriptor.dtype)).reshape(descriptor.shape)
    return torch.from_numpy(array.copy())
