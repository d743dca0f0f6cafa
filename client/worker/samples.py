"""What a proxy call may be given as a sample, and how it becomes the array that is sent.

DALI's external_source takes, on the CPU, numpy arrays, torch tensors and anything numpy can
read without a copy through ``__array_interface__`` or ``__array__`` (a PIL image, say), since
it ends in ``np.asarray``. dalid takes the same, and also ``bytes`` (an encoded file, as uint8)
and plain numbers (0-d arrays), which DALI refuses for want of a shape. Every sample leaves
here as a C-contiguous numpy array: a non-contiguous one (a transposed view, a crop with a
step, a Fortran-ordered array) is copied once, here, so the frame can be sent as it is.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dalid.protocol import DTYPES

from ..errors import InputError

# The allowed dtypes as numpy dtypes: a set lookup, where ``dtype.name`` is a Python property.
_NATIVE_DTYPES = frozenset(np.dtype(name) for name in DTYPES)

ACCEPTED = (
    "a numpy array, a CPU torch tensor, an object numpy reads as an array (a PIL image, "
    "anything with __array_interface__ or __array__), bytes or a number"
)


def as_sample(value: Any, input_name: str) -> np.ndarray:
    """``value`` as a C-contiguous numpy array, without a copy where its layout allows."""
    if type(value) is np.ndarray and value.dtype in _NATIVE_DTYPES and value.flags.c_contiguous:
        return value  # what a dataset usually gives: sent as it is (this runs per sample)
    array = _as_array(value, input_name)
    if array.dtype not in _NATIVE_DTYPES and array.dtype.name not in DTYPES:
        raise InputError(
            f"input {input_name!r}: dtype {array.dtype} is not supported; use one of "
            f"{sorted(DTYPES)}"
        )
    # np.ascontiguousarray would turn a 0-d sample (a label) into shape (1,).
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _as_array(value: Any, input_name: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return np.frombuffer(value, dtype=np.uint8)
    if _is_torch_tensor(value):
        if value.device.type != "cpu":
            raise InputError(
                f"input {input_name!r}: a sample on {value.device} must be moved to the CPU "
                "(tensor.cpu()) before it is sent to the daemon"
            )
        try:
            array: np.ndarray = value.detach().numpy()
            return array
        except TypeError as error:  # bfloat16 and other types numpy does not have
            raise InputError(
                f"input {input_name!r}: a torch tensor of {value.dtype} cannot be sent ({error}); "
                f"convert it to one of {sorted(DTYPES)}"
            ) from None
    if isinstance(value, bool | int | float | np.generic):
        return np.asarray(value)
    if isinstance(value, str):
        raise InputError(
            f"input {input_name!r}: got a str; pass bytes or a numpy array, for example "
            "np.frombuffer(path.encode(), dtype=np.int8) for a file path"
        )
    if hasattr(value, "__cuda_array_interface__"):
        raise InputError(
            f"input {input_name!r}: a {type(value).__name__} in GPU memory must be copied to "
            "the CPU before it is sent to the daemon"
        )
    if hasattr(value, "__array_interface__") or hasattr(value, "__array__"):
        try:
            array = np.asarray(value)
        except Exception as error:
            raise InputError(
                f"input {input_name!r}: numpy could not read the {type(value).__name__} as an "
                f"array ({type(error).__name__}: {error}); pass {ACCEPTED}"
            ) from None
        if isinstance(array, np.ndarray) and array.dtype != object:
            return array
    raise InputError(f"input {input_name!r}: cannot send a {type(value).__name__}; pass {ACCEPTED}")


def _is_torch_tensor(value: Any) -> bool:
    # torch is imported only where a tensor exists already: a sample's module says so.
    if not type(value).__module__.startswith("torch"):
        return False
    import torch

    return isinstance(value, torch.Tensor)
