"""How a DataLoader worker's batch reaches the trainer: small tensors by value.

torch sends every CPU tensor of a worker's batch to the trainer through shared memory: the
worker's queue thread moves the tensor's storage into a new shared-memory file, and the trainer
fetches that file's descriptor over a new, authenticated connection to the worker's
resource-sharing thread (``multiprocessing.resource_sharer``). For the batch of labels that
sits beside dalid's outputs (256 bytes at batch 32) that is most of what a batch costs the
trainer and its workers besides decoding (docs/design/decisions.md, "A worker's small CPU
tensors go to the trainer by value").

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

import contextvars
import io
import pickle
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

# Up to this size a tensor's bytes cost less to copy through the queue's pipe (twice) than a
# shared-memory file and a connection to pass its descriptor.
BY_VALUE_MAX_BYTES = 256 * 1024

# Tensor dtypes numpy has (torch.Tensor.numpy works for exactly these), each with its code in a
# pickled batch and the numpy dtype it is rebuilt with.
_DTYPES = (
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
)
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_NUMPY = tuple(torch.empty(0, dtype=dtype).numpy().dtype for dtype in _DTYPES)


def _by_value(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is rebuilt exactly from a copy of its bytes: a plain CPU tensor that
    is its whole storage, small, with nothing that torch's pickling would carry besides."""
    return (
        type(tensor) is torch.Tensor
        and tensor.dtype in _CODES
        and tensor.nbytes <= BY_VALUE_MAX_BYTES
        and not tensor.requires_grad
        and tensor.layout is torch.strided
        and tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.untyped_storage().nbytes() == tensor.nbytes
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def _tensor(data: bytearray, code: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of a batch, sent by value: its bytes, its dtype's code and its shape."""
    return torch.from_numpy(np.frombuffer(data, _NUMPY[code]).reshape(shape))


# While a batch is unpickled: what torch's pickler carried beside it (see _BatchPickler).
_handed: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar("dalid_handed")


def _handed_over(index: int) -> Any:
    return _handed.get()[index]


class _BatchPickler(pickle.Pickler):
    """Pickles a batch; what torch's pickler must see goes to ``handed`` instead.

    ``reducer_override`` is not called for the builtin types (numbers, strings, lists, dicts,
    tuples): it sees the batch's tensors and other objects only.
    """

    def __init__(self, file: io.BytesIO, handed: list[Any]) -> None:
        # Protocol 5: a tensor's bytes go in as one buffer, and come out as a bytearray.
        super().__init__(file, protocol=5)
        self.handed = handed

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if _by_value(obj):
                data = pickle.PickleBuffer(obj.numpy().data)
                return _tensor, (data, _CODES[obj.dtype], tuple(obj.shape))
        elif type(obj) not in ForkingPickler._extra_reducers:  # type: ignore[attr-defined]
            return NotImplemented
        self.handed.append(obj)
        return _handed_over, (len(self.handed) - 1,)


def _unpickle_batch(payload: bytes, handed: tuple[Any, ...]) -> Any:
    token = _handed.set(handed)
    try:
        return pickle.loads(payload)
    finally:
        _handed.reset(token)


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
