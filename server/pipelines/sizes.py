"""Output sizes that a batch's inputs fix: bounded per batch, before DALI allocates them.

``fn.resize(images, size=sizes)`` with ``sizes`` an external_source input makes outputs as
large as the numbers the trainer sends: a batch asking for 40,000x40,000 OOM-killed the
daemon. Where an argument that fixes extents of an operator's output (:data:`SIZE_ARGUMENTS`)
is fed directly by a pipeline input, the daemon reads its values from each batch before it
runs and refuses a batch whose outputs would certainly be larger than its job can hold.

Note [Size inputs are a lower bound]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Only what is certainly over is refused: a sample counts the product of the extents its
arguments fix (1 byte an element, 1 channel, a side of 0 or below 1 counted as 1), summed
over the batch, and an operator counts only where those extents are what it makes (resize
without ``max_size``, in a mode that does not shrink below them). The graph is read once, when
the pipeline is built (:func:`sized_outputs`); a batch costs a numpy reduction over each size
input (:func:`size_refusal`). Why, and what it leaves open: docs/design/data-sizes.md.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from dalid.protocol import InputBatch

from ..samples.paths import size_text
from .operators import argument_numbers
from .sharing import Graph, Operator
from .wire import fields


class Extent(enum.Enum):
    """How an argument's values fix an output's extents."""

    SIDES = "sides"  # the product of its values: sides of the output, or a factor of them
    SHORTER = "shorter"  # every side at least its value (resize_shorter): its square


_RESIZE = {
    "size": Extent.SIDES,
    "resize_x": Extent.SIDES,
    "resize_y": Extent.SIDES,
    "resize_z": Extent.SIDES,
    "resize_shorter": Extent.SHORTER,
    "resize_longer": Extent.SIDES,
}
_CROP = dict.fromkeys(("crop", "crop_w", "crop_h", "crop_d"), Extent.SIDES)
_SHAPE = {"shape": Extent.SIDES}

# By DALI schema: the arguments whose values fix extents of the operator's output.
SIZE_ARGUMENTS: dict[str, dict[str, Extent]] = {
    "Resize": _RESIZE,
    "experimental__Resize": _RESIZE,
    "TensorResize": {"sizes": Extent.SIDES},
    "Crop": _CROP,
    "CropMirrorNormalize": _CROP,
    "ResizeCropMirror": _CROP,
    "FastResizeCropMirror": _CROP,
    "ImageDecoderCrop": _CROP,
    "decoders__ImageCrop": _CROP,
    "experimental__decoders__ImageCrop": _CROP,
    "Full": _SHAPE,
    "Zeros": _SHAPE,
    "Ones": _SHAPE,
    "Slice": _SHAPE,
    "Pad": _SHAPE,
    "WarpAffine": {"size": Extent.SIDES},
    "Rotate": {"size": Extent.SIDES},
}
# Resize's arguments fix its output only without ``max_size`` and in these modes ("" is none).
_RESIZE_SCHEMAS = frozenset({"Resize", "experimental__Resize", "TensorResize"})
_EXACT_MODES = frozenset({"", "default", "stretch", "not_smaller"})
_ARG_STRINGS = 5


@dataclass(frozen=True)
class SizedOutput:
    """An operator whose output's extents come, in part, from pipeline inputs: ``fed`` (the
    argument, the input that feeds it, how it counts), times ``constant`` elements that its
    constant arguments fix."""

    schema: str
    fed: tuple[tuple[str, str, Extent], ...]
    constant: int = 1


def sized_outputs(graph: Graph, input_names: Collection[str]) -> tuple[SizedOutput, ...]:
    """The operators of ``graph`` with a size argument fed directly by one of its inputs."""
    found = []
    for operator in graph.operators:
        rules = SIZE_ARGUMENTS.get(operator.schema)
        if not rules or not _fixes_its_size(operator):
            continue
        fed = tuple(
            (argument, tensor.decode(errors="replace"), rules[argument])
            for argument, tensor in operator.argument_inputs
            if argument in rules and tensor.decode(errors="replace") in input_names
        )
        if fed:
            constant = 1
            for argument, raw in operator.arguments:
                if argument in rules:
                    values = argument_numbers(raw)
                    if rules[argument] is Extent.SHORTER:
                        constant *= max(values, default=1) ** 2
                    else:
                        constant *= int(np.prod(values, dtype=np.float64))
            found.append(SizedOutput(operator.schema, fed, constant))
    return tuple(found)


def _fixes_its_size(operator: Operator) -> bool:
    """Whether the sizes an operator is given are sizes it makes (not a resize that may shrink
    below them: ``max_size``, modes ``not_larger`` and ``fit``)."""
    if operator.schema not in _RESIZE_SCHEMAS:
        return True
    arguments = dict(operator.arguments)
    if "max_size" in arguments or any(name == "max_size" for name, _ in operator.argument_inputs):
        return False
    mode = b""
    for number, _, value in fields(arguments.get("mode", b"")):
        if number == _ARG_STRINGS and isinstance(value, bytes):
            mode = value
    return mode.decode(errors="replace") in _EXACT_MODES


def size_refusal(
    sized: Sequence[SizedOutput],
    inputs: Sequence[InputBatch],
    max_bytes: int,
    max_pixels: int,
) -> str:
    """Why a batch is refused, or "": the outputs its size inputs fix come to more than
    ``max_bytes`` (its job's output memory) for the batch, or more than ``max_pixels``
    elements for one sample (0: no limit). Per batch: a numpy reduction an input."""
    by_name = {item.name: item for item in inputs}
    for output in sized:
        elements: np.ndarray | None = None
        for _, name, kind in output.fed:
            item = by_name.get(name)
            if item is None or not item.size or np.dtype(item.dtype).kind not in "iuf":
                continue
            values = _per_sample(item)
            if kind is Extent.SHORTER:
                values = values * values
            elements = values if elements is None else elements * values
        if elements is None:
            continue
        elements = elements * output.constant
        total, largest = float(elements.sum()), float(elements.max())
        arguments = ", ".join(f"{argument}={name!r}" for argument, name, _ in output.fed)
        if max_pixels and largest > max_pixels:
            return (
                f"operator {output.schema} would make a sample of {largest:.0f} elements or "
                f"more from this batch's {arguments}, over this daemon's limit of {max_pixels} "
                "(dalid serve --max-image-pixels): send smaller sizes"
            )
        if max_bytes and total > max_bytes:
            return (
                f"operator {output.schema} would make at least {size_text(int(total))} of "
                f"outputs for this batch from its {arguments}, more than the job's "
                f"{size_text(max_bytes)} of output memory: send smaller sizes or smaller "
                "batches, or ask for more output memory (dalid.connect(memory_bytes=...), up to "
                "dalid serve --pool-bytes)"
            )
    return ""


def _per_sample(item: InputBatch) -> np.ndarray:
    """The product of each sample's values, as sides: whole, at least 1 (a side of 0 is one
    that keeps the aspect ratio; a negative one flips), in floating point (no overflow)."""
    values = np.abs(np.frombuffer(item.data, np.dtype(item.dtype)).astype(np.float64))
    values[~np.isfinite(values)] = 1.0
    values = np.maximum(np.floor(values), 1.0)
    starts = item.sample_bytes() // np.dtype(item.dtype).itemsize
    # One more 1 at the end: reduceat then takes the last sample to the end, and an empty
    # last sample's start is still an index.
    products: np.ndarray = np.multiply.reduceat(np.append(values, 1.0), starts[:-1])
    products[starts[:-1] == starts[1:]] = 1.0
    return products
