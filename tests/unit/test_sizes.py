"""Output sizes from a batch's inputs: found in real serialized graphs, bounded per batch."""

from __future__ import annotations

import numpy as np
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode

from dalid.protocol import InputBatch
from dalid.server.pipelines.sharing import read_graph
from dalid.server.pipelines.sizes import Extent, SizedOutput, size_refusal, sized_outputs

from ..dali_typing import pipeline_def

GiB = 1 << 30


@pipeline_def(batch_size=4, num_threads=1, device_id=None)
def _sized() -> tuple[DataNode, ...]:
    images = fn.external_source(name="images", dtype=types.DALIDataType.UINT8, ndim=3, layout="HWC")
    sizes = fn.external_source(name="sizes", dtype=types.DALIDataType.FLOAT, ndim=1)
    side = fn.external_source(name="side", dtype=types.DALIDataType.FLOAT, ndim=0)
    # DALI's stubs type resize's result as a union.
    by_size = fn.resize(images, size=sizes)
    by_sides = fn.resize(images, resize_x=side, resize_y=64)
    shorter = fn.resize(images, resize_shorter=side)
    capped = fn.resize(images, size=sizes, max_size=256)  # may be smaller: not counted
    fitting = fn.resize(images, size=sizes, mode="not_larger")  # so neither
    computed = fn.resize(images, resize_x=side * 2)  # a size computed in the graph: unknown
    return by_size, by_sides, shorter, capped, fitting, computed  # type: ignore[return-value]


def _sizes(*rows: list[float], name: str = "sizes") -> InputBatch:
    return InputBatch.of(name, [np.array(row, np.float32) for row in rows])


def test_size_arguments_fed_by_inputs_are_found_in_the_serialized_graph() -> None:
    graph = read_graph(_sized().serialize())
    assert sized_outputs(graph, ("images", "sizes", "side")) == (
        SizedOutput("Resize", (("size", "sizes", Extent.SIDES),)),
        SizedOutput("Resize", (("resize_x", "side", Extent.SIDES),), constant=64),
        SizedOutput("Resize", (("resize_shorter", "side", Extent.SHORTER),)),
    )
    # Fed by a tensor that is not an input of the pipeline: nothing to read.
    assert sized_outputs(graph, ("images",)) == ()


def test_a_batch_is_refused_only_where_its_sizes_are_certainly_too_large() -> None:
    sized = sized_outputs(read_graph(_sized().serialize()), ("images", "sizes", "side"))
    side = InputBatch.of("side", [np.float32(1)] * 2)
    # The reproduction: 40,000x40,000 from one sample's sizes.
    huge = (_sizes([40000, 40000], [2, 2]), side)
    message = size_refusal(sized, huge, GiB, 0)
    assert "operator Resize would make at least 1.49 GiB of outputs" in message
    assert "from its size='sizes', more than the job's 1 GiB of output memory" in message
    assert "send smaller sizes or smaller batches" in message
    assert "over this daemon's limit of 89478485" in size_refusal(sized, huge, GiB, 89_478_485)
    # Within the limit: runs. Zeros, fractions, negative (flipped) and infinite sides count as
    # what they certainly are at least; an empty sample counts 1.
    assert size_refusal(sized, (_sizes([224, 224], [0, 1e9]), side), GiB, 0) == ""
    first = sized[:1]
    assert size_refusal(first, (_sizes([-40000, 0.5], [np.inf, np.nan]), side), 40_001, 0) == ""
    assert size_refusal(first, (_sizes([-40000, 0.5], [np.inf, np.nan]), side), 40_000, 0)
    assert size_refusal(first, (_sizes([], [3, 3]), side), 10, 0) == ""
    assert size_refusal(first, (_sizes([], [3, 3]), side), 9, 0)
    # A scalar side, times the constant one; resize_shorter counts its square.
    wide = InputBatch.of("side", [np.float32(100_000)] * 2)
    assert size_refusal(sized[1:2], (wide,), 2 * 64 * 100_000, 0) == ""
    assert "at least 12.2 MiB" in size_refusal(sized[1:2], (wide,), 2 * 64 * 100_000 - 1, 0)
    assert size_refusal(sized[2:], (wide,), 2 * 10**10, 0) == ""
    assert size_refusal(sized[2:], (wide,), 2 * 10**10 - 1, 0)
    # Integer sizes read the same; no limit, no refusal.
    ints = InputBatch.of("sizes", [np.array([40000, 40000], np.int32)])
    assert "at least 1.49 GiB" in size_refusal(sized, (ints,), GiB, 0)
    assert size_refusal(sized, huge, 0, 0) == ""
