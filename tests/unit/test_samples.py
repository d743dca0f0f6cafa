"""What a proxy call takes as a sample: what DALI's external_source takes on the CPU, and more."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from dalid.client.errors import InputError
from dalid.client.worker.samples import as_sample


def test_pil_images_become_their_pixels() -> None:
    pixels = np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3)
    sample = as_sample(Image.fromarray(pixels, "RGB"), "images")
    assert sample.flags.c_contiguous
    np.testing.assert_array_equal(sample, pixels)
    gray = as_sample(Image.fromarray(pixels[..., 0], "L"), "images")
    np.testing.assert_array_equal(gray, pixels[..., 0])
    assert as_sample(Image.new("F", (4, 2)), "images").dtype == np.float32


class WithArrayInterface:
    def __init__(self, array: np.ndarray) -> None:
        self.__array_interface__ = array.__array_interface__
        self._keep = array


class WithArrayMethod:
    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self._array


def test_objects_numpy_reads_as_arrays() -> None:
    array = np.arange(12, dtype=np.int16).reshape(3, 4)
    np.testing.assert_array_equal(as_sample(WithArrayInterface(array), "x"), array)
    np.testing.assert_array_equal(as_sample(WithArrayMethod(array), "x"), array)
    # A strided view through the interface is copied into a contiguous sample.
    strided = as_sample(WithArrayInterface(array[:, ::2]), "x")
    assert strided.flags.c_contiguous
    np.testing.assert_array_equal(strided, array[:, ::2])


@pytest.mark.parametrize(
    "layout",
    [
        lambda a: a,
        np.asfortranarray,
        lambda a: a[::-1],
        lambda a: a[:, 1:3],
        lambda a: a.transpose(1, 0, 2),
        lambda a: np.broadcast_to(a[:1], a.shape),
    ],
    ids=["contiguous", "fortran", "reversed", "cropped", "transposed", "broadcast"],
)
def test_numpy_arrays_of_any_layout(layout: Any) -> None:
    array = layout(np.arange(4 * 5 * 3, dtype=np.float32).reshape(4, 5, 3))
    sample = as_sample(array, "x")
    assert sample.flags.c_contiguous
    np.testing.assert_array_equal(sample, array)
    if array.flags.c_contiguous:
        assert sample is array  # no copy where none is needed


def test_torch_tensors_on_the_cpu() -> None:
    tensor = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    shared = as_sample(tensor, "x")
    assert np.shares_memory(shared, tensor.numpy())  # no copy
    np.testing.assert_array_equal(as_sample(tensor.t(), "x"), tensor.t().numpy())
    assert as_sample(torch.ones(2, requires_grad=True), "x").dtype == np.float32


def test_torch_types_numpy_lacks_say_what_to_do() -> None:
    with pytest.raises(InputError, match="bfloat16") as caught:
        as_sample(torch.ones(2, dtype=torch.bfloat16), "x")
    assert "convert it" in str(caught.value)


def test_gpu_memory_is_refused_with_what_to_do() -> None:
    class CudaArray:
        __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False)}

    with pytest.raises(InputError, match="copied to the CPU"):
        as_sample(CudaArray(), "x")


@pytest.mark.parametrize(
    "value",
    [[1, 2], {"a": 1}, object(), None, WithArrayMethod(np.array([{}], dtype=object))],
    ids=["list", "dict", "object", "None", "object-array"],
)
def test_the_rest_is_refused_naming_what_is_accepted(value: Any) -> None:
    with pytest.raises(InputError, match="PIL image") as caught:
        as_sample(value, "images")
    assert "'images'" in str(caught.value)
