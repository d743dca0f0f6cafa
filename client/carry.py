"""How a DataLoader worker's batch reaches the trainer: small tensors by value.

torch sends every CPU tensor of a worker's batch to the trainer through shared memory: the
worker's queue thread moves the tensor's storage into a new shared-memory file, and the trainer
fetches that file's descriptor over a new, authenticated connection to the worker's
resource-sharing thread (``multiprocessing.resource_sharer``). For the batch of labels that
sits beside dalid's outputs (256 bytes at batch 32) that is most of what a batch costs the
trainer and its workers besides decoding (bench/README.md, "Where the client's time goes").

dalid's DataLoader wraps its ``collate_fn`` so that, in a worker, the batch travels as one
pickle of its own (:class:`CarriedBatch`) in which each small plain CPU tensor is a copy of its
bytes; every other tensor, and anything torch's queue pickles in its own way (storages, file
descriptors), is handed back to torch's pickler as it is. The trainer unpickles the batch as
the user's ``collate_fn`` made it: same structure, same tensors (dtype, shape, strides,
values), each small one in memory of its own instead of a shared-memory file. That includes
the small tensors torch's ``default_collate`` puts in shared memory itself when it runs in a
worker (labels that a dataset returns as tensors): what the trainer gets is a batch of its own
either way, and no process but the trainer uses that memory once the batch is sent.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.utils.data import get_worker_info

# Up to this size a tensor's bytes cost less to copy through the queue's pipe (twice) than a
# shared-memory file and a connection to pass its descriptor.
BY_VALUE_MAX_BYTES = 256 * 1024

# Tensor dtypes numpy has (torch.Tensor.numpy works for exactly these).
_NUMPY_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)

_BY_VALUE = 0
_BY_TORCH = 1


def _by_value(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is rebuilt exactly from a copy of its bytes: a plain CPU tensor that
    is its whole storage, small, with nothing that torch's pickling would carry besides."""
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout is torch.strided
        and tensor.dtype in _NUMPY_DTYPES
        and not tensor.requires_grad
        and tensor.nbytes <= BY_VALUE_MAX_BYTES
        and tensor.is_contiguous()
        and tensor.untyped_storage().nbytes() == tensor.nbytes
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


class _BatchPickler(pickle.Pickler):
    """Pickles a batch; what torch's pickler must see goes to ``handed`` instead."""

    def __init__(self, file: io.BytesIO, handed: list[Any]) -> None:
        super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL)
        self.handed = handed

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if _by_value(obj):
                return (_BY_VALUE, obj.numpy())
        elif type(obj) not in ForkingPickler._extra_reducers:  # type: ignore[attr-defined]
            return None
        self.handed.append(obj)
        return (_BY_TORCH, len(self.handed) - 1)


class _BatchUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, handed: tuple[Any, ...]) -> None:
        super().__init__(file)
        self.handed = handed

    def persistent_load(self, pid: Any) -> Any:
        kind, value = pid
        if kind == _BY_VALUE:
            return torch.from_numpy(value)
        return self.handed[value]


def _unpickle_batch(payload: bytes, handed: tuple[Any, ...]) -> Any:
    return _BatchUnpickler(io.BytesIO(payload), handed).load()


class CarriedBatch:
    """A worker's batch on its way to the trainer, which unpickles it as the batch itself."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[bytes, tuple[Any, ...]]]:
        handed: list[Any] = []
        buffer = io.BytesIO()
        _BatchPickler(buffer, handed).dump(self.batch)
        # torch's pickler (the queue's) shares what was handed to it, as it would have.
        return _unpickle_batch, (buffer.getvalue(), tuple(handed))


class CarryingCollate:
    """A ``collate_fn`` whose batches, made in a worker, travel as :class:`CarriedBatch`;
    in the trainer's own process (``num_workers=0``) it returns the batch as it is."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    @property
    def __wrapped__(self) -> Callable[[Any], Any]:
        return self.collate_fn

    def __call__(self, data: Any) -> Any:
        batch = self.collate_fn(data)
        return batch if get_worker_info() is None else CarriedBatch(batch)
