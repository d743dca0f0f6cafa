"""The DALI output adapter: one output of a run read once, and the descriptors of its rows.

The only module of ``outputs/`` that reads DALI's TensorLists (its dtypes through DALI's
types); the stores copy from a :class:`RunOutput`, never from DALI directly.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dalid.protocol import ErrorCode, OutputDescriptor

from .pool import Region


class OutputFailure(Exception):
    """A batch whose outputs cannot be delivered; ``code`` says why."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class RunOutput:
    """One output of a run (a DALI TensorList), read once for all the jobs that get rows of it.

    A run of a shared pipeline holds the samples of several jobs' batches; each job's rows of
    each output go to that job's memory (``JobOutputs.write_batch``).
    """

    def __init__(self, index: int, tensors: Any) -> None:
        self.index = index
        self.tensors = tensors
        self._dense: Any = None
        # The one shape of every sample, where they have one (None: they differ).
        self._sample_shape: tuple[int, ...] | None = None
        # A dense output (every sample of one shape, the common case) tells its shape at once,
        # and no more is made of it, per run or per sample. Otherwise one row of extents per
        # sample, as an array: the checks below are numpy operations on the whole run, not a
        # Python step per sample (DALI's shape() makes a tuple per sample).
        self._shapes: np.ndarray | None = None
        if tensors.is_dense_tensor():
            self._dense = tensors.as_tensor()
            samples, *shape = self._dense.shape()
            self._samples: int = samples
            self._sample_shape = tuple(shape)
        else:
            shapes = tensors.shape()
            ndim = len(shapes[0]) if shapes else 0
            self._shapes = np.array(shapes, np.int64).reshape(len(shapes), ndim)
            self._samples = len(shapes)
        self.dtype = _dtype_name(tensors.dtype)
        self.itemsize = np.dtype(self.dtype).itemsize
        self.layout = tensors.layout() or ""

    @property
    def samples(self) -> int:
        return self._samples

    def shape_of(self, rows: range) -> tuple[int, ...]:
        """The shape of ``rows`` as one tensor; rows of different shapes cannot be one."""
        if self._sample_shape is not None:
            return (len(rows), *self._sample_shape)
        assert self._shapes is not None
        selected = self._shapes[rows.start : rows.stop]
        if len(selected) and not (selected == selected[0]).all():
            shown = [tuple(shape) for shape in selected[:4].tolist()]
            raise OutputFailure(
                ErrorCode.INVALID_OUTPUT,
                f"output {self.index} has samples of different shapes ({shown}...): "
                "a batch is delivered as one tensor, so resize, crop or pad to one shape",
            )
        return (len(selected), *(selected[0].tolist() if len(selected) else ()))

    @property
    def whole(self) -> range:
        return range(self._samples)

    def dense(self) -> Any:
        """The whole output as one contiguous DALI tensor, or None if its samples differ."""
        if self._dense is None and self.tensors.is_dense_tensor():
            self._dense = self.tensors.as_tensor()
        return self._dense

    def row_bytes(self, rows: range) -> int:
        """Bytes of one of ``rows`` (rows of one shape)."""
        if self._sample_shape is not None:
            return math.prod(self._sample_shape) * self.itemsize if rows else 0
        assert self._shapes is not None
        return math.prod(self._shapes[rows.start].tolist()) * self.itemsize if rows else 0


def descriptor(
    device: str,
    region: Region,
    output: RunOutput,
    shape: tuple[int, ...],
    ipc_handle: str,
    *,
    copy: bool = False,
) -> OutputDescriptor:
    """The descriptor of one output written into ``region``."""
    return OutputDescriptor(
        region_id=region.region_id,
        slab=region.slab.name,
        slab_size=region.slab.size,
        offset=region.offset,
        nbytes=region.nbytes,
        dtype=output.dtype,
        shape=shape,
        layout=output.layout,
        device=device,
        ipc_handle=ipc_handle,
        copy=copy,
    )


def host_descriptor(
    device: str, output: RunOutput, shape: tuple[int, ...], nbytes: int
) -> OutputDescriptor:
    """The descriptor of an output whose private copy travels as a frame: it names no slab."""
    return OutputDescriptor(
        region_id=0,
        slab="",
        slab_size=nbytes,
        offset=0,
        nbytes=nbytes,
        dtype=output.dtype,
        shape=shape,
        layout=output.layout,
        device=device,
    )


_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dali_dtype: Any) -> str:
    """The numpy name of a DALI dtype (looked up once per dtype: every run asks)."""
    name = _DTYPE_NAMES.get(dali_dtype)
    if name is None:
        from nvidia.dali.types import to_numpy_type

        name = _DTYPE_NAMES[dali_dtype] = np.dtype(to_numpy_type(dali_dtype)).name
    return name
