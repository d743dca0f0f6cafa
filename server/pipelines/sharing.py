"""Which registrations may share one DALI pipeline, read from the pipeline's operators.

Jobs whose pipelines are the same graph with the same operator arguments share one pipeline
in the daemon, whatever seed DALI picked for each: the *graph key* compares the operators,
their arguments and how they connect, and leaves out what differs between two definitions of
one pipeline (the seed, thread count and device of the pipeline; DALI's own bookkeeping
arguments, whose names start with ``_``, such as where in a script the operator was defined;
the names DALI gave to intermediate tensors).

A shared pipeline runs samples of several jobs in one batch, so it is only for pipelines
whose output for a sample depends on that sample alone. That is decided from the operator
list: every operator must be one this module knows to work sample by sample, and none may be
asked to look across the batch (an argument ``batch`` set to true, as ``fn.normalize`` takes).
Anything else (``fn.batch_permutation``, ``fn.permute_batch``, ``fn.multi_paste``, ``fn.pad``,
Python operators, an operator this module does not know) keeps a pipeline of its own: when
unsure, dalid does not share.

A serialized pipeline is DALI's ``PipelineDef`` protocol buffer, read with ``wire.py``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from dalid.protocol.file_inputs import FILE_READER

from .wire import (
    ARG_ELEMENTS,
    ARG_NAME,
    ARG_STRINGS,
    GRAPH_FIELDS,
    IO_ARGUMENT,
    IO_NAME,
    OP_ARG,
    OP_INPUT,
    OP_NAME,
    OP_OUTPUT,
    UnreadablePipeline,
    fields,
    string_field,
    true_argument,
)

__all__ = ["Graph", "Operator", "UnreadablePipeline", "batches_a_run", "read_graph"]

# Operators (DALI schema names) whose output for a sample depends on that sample's inputs only.
PER_SAMPLE_OPERATORS = frozenset(
    {
        # Inputs, files and decoding.
        "ExternalSource",
        "io__file__Read",
        "decoders__Image",
        "decoders__ImageCrop",
        "decoders__ImageRandomCrop",
        "decoders__ImageSlice",
        "decoders__Audio",
        "decoders__Numpy",
        "ImageDecoder",
        "ImageDecoderCrop",
        "ImageDecoderRandomCrop",
        "ImageDecoderSlice",
        "experimental__decoders__Image",
        "experimental__decoders__ImageCrop",
        "experimental__decoders__ImageRandomCrop",
        "experimental__decoders__ImageSlice",
        "PeekImageShape",
        "experimental__PeekImageShape",
        # Geometry and resampling.
        "Resize",
        "experimental__Resize",
        "ResizeCropMirror",
        "FastResizeCropMirror",
        "RandomResizedCrop",
        "TensorResize",
        "experimental__TensorResize",
        "Crop",
        "CropMirrorNormalize",
        "Slice",
        "Flip",
        "Rotate",
        "WarpAffine",
        "experimental__WarpPerspective",
        "experimental__Remap",
        "Paste",
        "Sphere",
        "Water",
        "Jitter",
        "GridMask",
        "Erase",
        "RandomCropGenerator",
        "ROIRandomCrop",
        "RandomBBoxCrop",
        "SSDRandomCrop",
        "BbFlip",
        "BBoxPaste",
        "BBoxRotate",
        "CoordFlip",
        "CoordTransform",
        "BoxEncoder",
        "transforms__Combine",
        "transforms__Crop",
        "transforms__Rotation",
        "transforms__Scale",
        "transforms__Shear",
        "transforms__Translation",
        "TransformTranslation",
        # Colour, filters and noise.
        "ColorSpaceConversion",
        "ColorTwist",
        "Hsv",
        "Hue",
        "Saturation",
        "Brightness",
        "Contrast",
        "BrightnessContrast",
        "GaussianBlur",
        "Laplacian",
        "Filter",
        "experimental__Filter",
        "experimental__MedianBlur",
        "experimental__Dilate",
        "experimental__Erode",
        "Equalize",
        "experimental__Equalize",
        "Clahe",
        "Debayer",
        "experimental__Debayer",
        "JpegCompressionDistortion",
        "noise__Gaussian",
        "noise__SaltAndPepper",
        "noise__Shot",
        # Normalizing, casting and reshaping (Normalize unless told to use the whole batch).
        "Normalize",
        "Cast",
        "CastLike",
        "Reshape",
        "Reinterpret",
        "Transpose",
        "ExpandDims",
        "Squeeze",
        "Copy",
        "Cat",
        "Stack",
        "ElementExtract",
        "LookupTable",
        "OneHot",
        "Shapes",
        "GetProperty",
        "PerFrame",
        "SequenceRearrange",
        "_ArithmeticGenericOp",
        "_Shape",
        "_SubscriptDimCheck",
        "_TensorSubscript",
        "_conditional__Split",
        "_conditional__Merge",
        "_conditional__Not_",
        "_conditional__ValidateLogical",
        "reductions__Max",
        "reductions__Mean",
        "reductions__MeanSquare",
        "reductions__Min",
        "reductions__RMS",
        "reductions__StdDev",
        "reductions__Sum",
        "reductions__Variance",
        "segmentation__RandomMaskPixel",
        "segmentation__RandomObjectBBox",
        "segmentation__SelectMasks",
        # Constants and per-sample random draws.
        "Constant",
        "Full",
        "FullLike",
        "Zeros",
        "ZerosLike",
        "Ones",
        "OnesLike",
        "CoinFlip",
        "Uniform",
        "NormalDistribution",
        "random__CoinFlip",
        "random__Uniform",
        "random__Normal",
        "random__Choice",
        "random__Beta",
        # Audio.
        "AudioResample",
        "experimental__AudioResample",
        "MelFilterBank",
        "MFCC",
        "NonsilentRegion",
        "PowerSpectrum",
        "PreemphasisFilter",
        "Spectrogram",
        "ToDecibels",
    }
)


@dataclass(frozen=True)
class Operator:
    """One operator of a graph: its schema name, its tensors' names, and its arguments (name,
    raw encoded value) without DALI's own bookkeeping ones."""

    schema: str
    inputs: tuple[bytes, ...]
    outputs: tuple[bytes, ...]
    arguments: tuple[tuple[str, bytes], ...]
    origin: str = ""
    # The arguments fed by a tensor of the graph (argument inputs): (argument, tensor name).
    argument_inputs: tuple[tuple[str, bytes], ...] = ()

    def flag(self, name: str) -> bool:
        """Whether the boolean argument ``name`` is given and true."""
        return any(argument == name and true_argument(value) for argument, value in self.arguments)


@dataclass(frozen=True)
class Graph:
    """A pipeline's operators, and a key equal for every definition of the same graph.

    ``origin`` names the function that defined its first operator, as DALI recorded it (a name
    to show for a pipeline registered without one; "" if DALI recorded none).
    """

    operators: tuple[Operator, ...]
    key: bytes
    origin: str = ""
    # The tensors the pipeline returns, by their names in the serialized pipeline.
    outputs: tuple[bytes, ...] = ()

    def read_as_files_only(self, name: str) -> bool:
        """Whether the input ``name`` goes to ``fn.io.file.read`` and nowhere else: not to
        another operator (as an argument either), not out of the pipeline. Its samples' bytes
        then matter only as the file they name (``runner.padded_paths``)."""
        tensor = name.encode()
        readers = [op.schema for op in self.operators if tensor in op.inputs]
        return (
            bool(readers)
            and all(schema == FILE_READER for schema in readers)
            and tensor not in self.outputs
        )

    def unshareable(self) -> str:
        """Why the graph's samples must not share a run with other jobs' samples ("" if they
        may)."""
        for operator in self.operators:
            if operator.schema not in PER_SAMPLE_OPERATORS:
                return f"operator {operator.schema} is not known to work sample by sample"
            if operator.flag("batch"):
                return f"operator {operator.schema} uses the whole batch (batch=True)"
        return ""


def read_graph(serialized: bytes) -> Graph:
    """The graph of a serialized pipeline (``Pipeline.serialize()``)."""
    operators: list[Operator] = []
    outputs: list[bytes] = []
    canonical: list[bytes] = []
    # Tensors are named by their producer's position in the operator list and the output's
    # place, so that names DALI made up for intermediate tensors do not count; the pipeline's
    # inputs keep their names, which clients feed.
    renamed: dict[bytes, bytes] = {}
    for number, _, value in fields(serialized):
        if number not in GRAPH_FIELDS:
            continue
        if not isinstance(value, bytes):
            raise UnreadablePipeline(f"field {number} of the serialized pipeline is not a message")
        if number == 6:
            canonical.append(b"external\0" + value)
            continue
        if number == 7:
            outputs.append(string_field(value, IO_NAME))
            canonical.append(b"output\0" + _rename_io(value, renamed))
            continue
        operator = _read_operator(value)
        for place, name in enumerate(operator.outputs):
            if operator.schema != "ExternalSource":
                renamed[name] = f"@{len(operators)}.{place}".encode()
        operators.append(operator)
        canonical.append(
            b"op\0"
            + operator.schema.encode()
            + b"\0in\0"
            + b"\0".join(renamed.get(name, name) for name in operator.inputs)
            + b"\0out\0"
            + b"\0".join(renamed.get(name, name) for name in operator.outputs)
            + b"".join(b"\0arg\0" + name.encode() + b"=" + raw for name, raw in operator.arguments)
        )
    if not operators:
        raise UnreadablePipeline("the serialized pipeline has no operators")
    origin = next((op.origin for op in operators if op.origin), "")
    key = hashlib.sha256(b"\n".join(canonical)).digest()
    return Graph(tuple(operators), key, origin, tuple(outputs))


def _read_operator(raw: bytes) -> Operator:
    schema = ""
    inputs: list[bytes] = []
    outputs: list[bytes] = []
    arguments: list[tuple[str, bytes]] = []
    argument_inputs: list[tuple[str, bytes]] = []
    origin = ""
    for number, _, value in fields(raw):
        if not isinstance(value, bytes):
            continue  # the logical id: a number of the build, not of the graph
        if number == OP_NAME:
            schema = value.decode(errors="replace")
        elif number in (OP_INPUT, OP_OUTPUT):
            (inputs if number == OP_INPUT else outputs).append(string_field(value, IO_NAME))
            argument = string_field(value, IO_ARGUMENT)
            if number == OP_INPUT and argument:
                argument_inputs.append(
                    (argument.decode(errors="replace"), string_field(value, IO_NAME))
                )
        elif number == OP_ARG:
            name = string_field(value, ARG_NAME)
            if name == b"_origin_stack_name":
                # A list: its first element is the function the operator was called in.
                origin = string_field(string_field(value, ARG_ELEMENTS), ARG_STRINGS).decode(
                    errors="replace"
                )
            elif not name.startswith(b"_"):
                arguments.append((name.decode(errors="replace"), value))
    if not schema:
        raise UnreadablePipeline("an operator of the serialized pipeline has no name")
    return Operator(
        schema,
        tuple(inputs),
        tuple(outputs),
        tuple(sorted(arguments)),
        origin,
        tuple(argument_inputs),
    )


def _rename_io(raw: bytes, renamed: dict[bytes, bytes]) -> bytes:
    """A pipeline output (an InputOutput message) with its tensor named canonically."""
    name = string_field(raw, IO_NAME)
    return renamed.get(name, name)


# A shared pipeline's run under --run-batches auto: as many batches as fit AUTO_RUN_SAMPLES
# samples, from 1 to AUTO_RUN_BATCHES. DALI sizes every stage's buffers (on a GPU, device
# memory) for the largest run it has seen, and keeps them: runs of 4 batches of 256 made a
# daemon of 8 jobs hold 6.4 GiB against 2.4 with runs of one batch, for the same samples/s
# (docs/design/decisions.md, "`--run-batches auto`"). Small batches still share
# runs, where fewer DALI calls a sample are what a run buys.
AUTO_RUN_SAMPLES = 256
AUTO_RUN_BATCHES = 4


def batches_a_run(run_batches: int, max_batch_size: int) -> int:
    """How many batches of ``max_batch_size`` one run of a shared pipeline holds: ``run_batches``
    as set (``dalid serve --run-batches``), or for 0 (``auto``) as many as fit
    :data:`AUTO_RUN_SAMPLES` samples, at least one and at most :data:`AUTO_RUN_BATCHES`."""
    if run_batches:
        return run_batches
    return max(1, min(AUTO_RUN_BATCHES, AUTO_RUN_SAMPLES // max(1, max_batch_size)))
