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

from collections.abc import Iterable
from dataclasses import dataclass

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
