"""Which DALI operators a pipeline may hold: an allow-list, checked before DALI sees a graph.

A registered graph is data the daemon builds into code it runs: an operator named in it runs
in the daemon, with the daemon's rights (root's, for a root daemon). Some DALI operators do
more than compute on their inputs: they call a Python function, or any address, that their
arguments name (a ``function_id`` edited in a serialized graph made the daemon call
0x4141414141), write files, or read the files their arguments name. So before
``Pipeline.deserialize`` the daemon reads the graph's operator names (``sharing.read_graph``)
and refuses, as ``invalid_pipeline`` naming the operator, any that is not in
:data:`ALLOWED`. A graph it cannot read is refused too: it fails closed.

:data:`ALLOWED` is every operator DALI 2.4 registers (``nvidia.dali.backend.RegisteredCPUOps``,
``...GPUOps``, ``...MixedOps``, internal ones included) but the families of :data:`EXCLUDED`,
each with its reason. It is a list, not a pattern: an operator a later DALI adds is refused
until it is added here (``tests/unit/test_operators.py`` lists those of the installed DALI that
are in neither).

Pipelines of the daemon's repository are code its operator installed, and run in the daemon
anyway; they follow the same list unless ``dalid serve --repository-operators`` widens it
(``any``, or more operator names), as a repository that uses ``fn.python_function`` needs.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from .sharing import Graph, Operator
from .wire import fields

# Families refused, by schema name (as a serialized graph names them; the Python names of
# Python operators too, as a repository pipeline's graph names them), and why.
_CALLS = "runs a Python function or calls an address that its arguments name"
_WRITES = "writes files where the daemon runs"
_READS = (
    "reads the files its arguments name, as the daemon's user (dalid feeds pipelines from "
    "their clients; file paths travel as path inputs, read by io.file.read)"
)
_CALLERS = (
    "PythonFunction", "PythonFunctionImpl", "DLTensorPythonFunction",
    "DLTensorPythonFunctionImpl", "TorchPythonFunction", "NumbaFunction", "NumbaFuncImpl",
    "experimental__NumbaFunction", "JaxFunction", "_JaxFunction",
)  # fmt: skip
_READERS = (
    "COCOReader", "Caffe2Reader", "CaffeReader", "FileReader", "MXNetReader", "NemoAsrReader",
    "NumpyReader", "SequenceReader", "VideoReader", "VideoReaderResize", "_TFRecordReader",
    "TFRecordReader", "readers__COCO", "readers__Caffe", "readers__Caffe2", "readers__File",
    "readers__MXNet", "readers__NemoAsr", "readers__Numpy", "readers__Sequence",
    "readers__Video", "readers__VideoResize", "readers__Webdataset", "readers___TFRecord",
    "readers__TFRecord", "experimental__readers__Fits", "experimental__readers__Video",
)  # fmt: skip
EXCLUDED: dict[str, str] = {
    **dict.fromkeys(_CALLERS, _CALLS),
    "DumpImage": _WRITES,
    **dict.fromkeys(_READERS, _READS),
}

ALLOWED = frozenset(
    {
        "AudioDecoder", "AudioResample", "BBoxPaste", "BBoxRotate", "BatchPermutation", "BbFlip",
        "BoxEncoder", "Brightness", "BrightnessContrast", "Cast", "CastLike", "Cat", "Clahe",
        "CoinFlip", "ColorSpaceConversion", "ColorTwist", "Constant", "Contrast", "CoordFlip",
        "CoordTransform", "Copy", "Crop", "CropMirrorNormalize", "Debayer", "ElementExtract",
        "Equalize", "Erase", "ExpandDims", "ExternalSource", "FastResizeCropMirror", "Filter",
        "Flip", "Full", "FullLike", "GaussianBlur", "GetProperty", "GridMask", "Hsv", "Hue",
        "ImageDecoder", "ImageDecoderCrop", "ImageDecoderRandomCrop", "ImageDecoderSlice",
        "Jitter", "JpegCompressionDistortion", "Laplacian", "LookupTable", "MFCC",
        "MakeContiguous", "MelFilterBank", "MultiPaste", "NonsilentRegion", "NormalDistribution",
        "Normalize", "OneHot", "Ones", "OnesLike", "OpticalFlow", "Pad", "Paste", "PeekImageShape",
        "PerFrame", "PermuteBatch", "PowerSpectrum", "PreemphasisFilter", "ROIRandomCrop",
        "RandomBBoxCrop", "RandomCropGenerator", "RandomResizedCrop", "Reinterpret", "Reshape",
        "Resize", "ResizeCropMirror", "Rotate", "SSDRandomCrop", "Saturation", "SequenceRearrange",
        "Shapes", "Slice", "Spectrogram", "Sphere", "Squeeze", "Stack", "TensorResize",
        "ToDecibels", "TransformTranslation", "Transpose", "Uniform", "WarpAffine", "Water",
        "Zeros", "ZerosLike", "_ArithmeticGenericOp", "_Shape", "_SubscriptDimCheck",
        "_TensorSubscript", "_conditional__Merge", "_conditional__Not_", "_conditional__Split",
        "_conditional__ValidateLogical", "decoders__Audio", "decoders__Image",
        "decoders__ImageCrop", "decoders__ImageRandomCrop", "decoders__ImageSlice",
        "decoders__Inflate", "decoders__Numpy", "decoders__Video", "experimental__AudioResample",
        "experimental__Debayer", "experimental__Dilate", "experimental__Equalize",
        "experimental__Erode", "experimental__Filter", "experimental__Inflate",
        "experimental__MedianBlur", "experimental__PeekImageShape", "experimental__Remap",
        "experimental__Resize", "experimental__TensorResize", "experimental__WarpPerspective",
        "experimental__decoders__Image", "experimental__decoders__ImageCrop",
        "experimental__decoders__ImageRandomCrop", "experimental__decoders__ImageSlice",
        "experimental__decoders__Video", "experimental__inputs__Video", "io__file__Read",
        "noise__Gaussian", "noise__SaltAndPepper", "noise__Shot", "random__Beta", "random__Choice",
        "random__CoinFlip", "random__Normal", "random__Uniform", "reductions__Max",
        "reductions__Mean", "reductions__MeanSquare", "reductions__Min", "reductions__RMS",
        "reductions__StdDev", "reductions__Sum", "reductions__Variance",
        "segmentation__RandomMaskPixel", "segmentation__RandomObjectBBox",
        "segmentation__SelectMasks", "transforms__Combine", "transforms__Crop",
        "transforms__Rotation", "transforms__Scale", "transforms__Shear",
        "transforms__Translation",
    }
)  # fmt: skip


class OperatorRefused(ValueError):
    """A graph holds an operator the daemon does not run; the message names it and why."""


@dataclass(frozen=True)
class OperatorPolicy:
    """What the daemon builds: :data:`ALLOWED`, and for repository pipelines also
    ``repository_extra`` (None: any operator)."""

    repository_extra: frozenset[str] | None = frozenset()

    def check(self, operators: Iterable[str], repository: bool = False) -> None:
        """Raises OperatorRefused for the first operator not allowed."""
        extra = self.repository_extra if repository else frozenset()
        if extra is None:
            return
        for name in operators:
            if name in ALLOWED or name in extra:
                continue
            why = EXCLUDED.get(name, "it is not on this daemon's list of DALI operators")
            hint = (
                " (dalid serve --repository-operators widens the list for the daemon's own "
                "repository)"
                if name in EXCLUDED
                else ""
            )
            raise OperatorRefused(f"operator {name[:80]!r} is refused: {why}{hint}")

    @classmethod
    def parse(cls, text: str) -> OperatorPolicy:
        """``--repository-operators``: "" (the list), "any", or more names, comma-separated."""
        if text.strip() == "any":
            return cls(None)
        return cls(frozenset(name.strip() for name in text.split(",") if name.strip()))


ALLOW_LIST = OperatorPolicy()
"""The default: every pipeline, the repository's too, holds operators of :data:`ALLOWED` only."""


# Arguments that fix dimensions of an operator's output (resize's size, resize_x and resize_y,
# crop sizes, the shape of constants): the product of their values is a lower bound of the
# elements of one output sample. ``resize_shorter`` N makes every side N at least.
_SIZE_ARGUMENTS = frozenset(
    {"size", "sizes", "resize_x", "resize_y", "resize_z", "crop", "crop_w", "crop_h", "crop_d",
     "shape"}
)  # fmt: skip
_ARG_FLOATS, _ARG_INTS, _ARG_ELEMENTS = 3, 4, 7


def declared_elements(operator: Operator) -> int:
    """A lower bound of the elements of one output sample of ``operator`` that its constant
    arguments fix (1: they fix none)."""
    total = 1
    for name, raw in operator.arguments:
        if name in _SIZE_ARGUMENTS:
            for value in argument_numbers(raw):
                total *= value
        elif name == "resize_shorter":
            total *= max(argument_numbers(raw), default=1) ** 2
    return total


def check_sizes(graph: Graph, max_batch_size: int, pool_bytes: int, max_pixels: int) -> None:
    """Refuses a graph one of whose operators' outputs, by its constant arguments, is larger
    than any a job could receive: before DALI allocates it (a 1x1 image resized to
    40,000x40,000 took the daemon's memory whole)."""
    for operator in graph.operators:
        elements = declared_elements(operator)
        if max_pixels and elements > max_pixels:
            raise OperatorRefused(
                f"operator {operator.schema} makes samples of {elements} elements or more, over "
                f"this daemon's limit of {max_pixels} (dalid serve --max-image-pixels)"
            )
        if elements * max_batch_size > pool_bytes:
            raise OperatorRefused(
                f"operator {operator.schema} makes batches of {max_batch_size} samples of "
                f"{elements} elements or more, at least {elements * max_batch_size} bytes: more "
                f"than the job's {pool_bytes} bytes of output memory (--pool-bytes)"
            )


def argument_numbers(raw: bytes) -> list[int]:
    """The positive whole values of an encoded argument (scalar or list); others count 1."""
    values: list[float] = []
    for number, _, value in fields(raw):
        if number == _ARG_FLOATS and isinstance(value, bytes) and len(value) == 4:
            values.append(struct.unpack("<f", value)[0])
        elif number == _ARG_INTS and isinstance(value, int):
            values.append(value - (1 << 64) if value >= 1 << 63 else value)
        elif number == _ARG_ELEMENTS and isinstance(value, bytes):
            values.extend(argument_numbers(value))
    return [int(min(v, 2**62)) if math.isfinite(v) and v >= 1 else 1 for v in values]
