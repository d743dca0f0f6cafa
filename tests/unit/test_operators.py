"""The allow-list of DALI operators, and the graph checker that applies it before DALI sees a
graph: real serialized graphs, edited as an attacker would, and a seeded fuzz of 1,000."""

from __future__ import annotations

import importlib
import random
from typing import Any

import pytest
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode

from dalid.server.pipelines.operators import (
    ALLOW_LIST,
    ALLOWED,
    EXCLUDED,
    OperatorPolicy,
    OperatorRefused,
)
from dalid.server.pipelines.sharing import UnreadablePipeline, read_graph

from ..dali_typing import pipeline_def
from ..graphs import hostile_graph, int_argument, operator_names, renamed


@pipeline_def(batch_size=2, num_threads=1, device_id=None, seed=3)
def small() -> tuple[DataNode, DataNode]:
    data = fn.external_source(name="data", layout="HWC")
    resized: DataNode = fn.resize(data, size=(8, 8))  # type: ignore[assignment]
    return fn.cast(data, dtype=types.DALIDataType.FLOAT) * 0.5, resized


def check(serialized: bytes, policy: OperatorPolicy = ALLOW_LIST) -> None:
    """What the daemon does with a registered graph before DALI sees it."""
    policy.check(operator.schema for operator in read_graph(serialized).operators)


def test_every_operator_dali_registers_is_allowed_or_excluded_for_a_reason() -> None:
    # A later DALI's new operator is refused (not in ALLOWED) until someone decides on it:
    # this lists it, so that the decision is made.
    importlib.import_module("nvidia.dali.ops")  # registers the operators of its plugins
    backend: Any = importlib.import_module("nvidia.dali.backend")
    listings = (backend.RegisteredCPUOps, backend.RegisteredGPUOps, backend.RegisteredMixedOps)
    registered = {name for listing in listings for name in listing(True)}
    assert not ALLOWED & set(EXCLUDED)
    assert registered - ALLOWED - set(EXCLUDED) == set()
    assert all(reason for reason in EXCLUDED.values())


def test_a_real_graph_passes() -> None:
    serialized = small().serialize()
    check(serialized)
    assert {"ExternalSource", "Cast", "Resize"} <= set(operator_names(serialized))


@pytest.mark.parametrize(
    "name",
    ["DLTensorPythonFunctionImpl", "PythonFunctionImpl", "NumbaFuncImpl", "_JaxFunction"],
)
def test_an_operator_that_calls_an_address_is_refused_by_name(name: str) -> None:
    # The reproduction: an edited graph whose Python function is at 0x4141414141.
    crafted = renamed(small().serialize(), "Cast", name, int_argument("function_id", 0x4141414141))
    assert name in operator_names(crafted)
    with pytest.raises(OperatorRefused, match=f"operator '{name}' is refused: runs a Python"):
        check(crafted)


def test_dump_image_and_readers_are_refused_unless_the_repository_is_widened() -> None:
    for name, why in (("DumpImage", "writes files"), ("readers__File", "reads the files")):
        crafted = renamed(small().serialize(), "Resize", name)
        with pytest.raises(OperatorRefused, match=why):
            check(crafted)
        # Only the daemon's own repository may be widened, by its operator.
        OperatorPolicy.parse(name).check(operator_names(crafted), repository=True)
        OperatorPolicy.parse("any").check(operator_names(crafted), repository=True)
        with pytest.raises(OperatorRefused):
            OperatorPolicy.parse(name).check(operator_names(crafted))


def test_an_unknown_operator_is_refused() -> None:
    crafted = renamed(small().serialize(), "Cast", "CastButNew")
    with pytest.raises(OperatorRefused, match="not on this daemon's list"):
        check(crafted)


def test_a_thousand_hostile_graphs_are_each_accepted_or_refused_never_more() -> None:
    rng = random.Random(20261126)
    base = small().serialize()
    outcomes = {"accepted": 0, "refused": 0, "unreadable": 0}
    for _ in range(1000):
        graph = hostile_graph(rng, base)
        try:
            check(graph)
        except OperatorRefused:
            outcomes["refused"] += 1
        except UnreadablePipeline:
            outcomes["unreadable"] += 1
        else:
            # What passes holds nothing but allowed operators.
            assert set(operator_names(graph)) <= ALLOWED
            outcomes["accepted"] += 1
    # The fuzz reached every outcome, not one path a thousand times.
    assert min(outcomes.values()) >= 50, outcomes


def test_outputs_larger_than_a_job_could_hold_are_refused_by_their_arguments() -> None:
    from nvidia.dali.pipeline import pipeline_def as untyped_pipeline_def

    from dalid.server.pipelines.operators import check_sizes

    def checked(batch: int = 8, **arguments: Any) -> None:
        @untyped_pipeline_def(batch_size=8, num_threads=1, device_id=None)  # type: ignore[call-overload,untyped-decorator]
        def sized() -> Any:
            data = fn.external_source(name="data", layout="HWC")
            return fn.resize(data, **arguments)

        graph = read_graph(sized().serialize())
        check_sizes(graph, batch, 1 << 30, 89_478_485)

    checked(size=(224, 224))
    checked(resize_x=640, resize_y=480)
    checked(resize_shorter=256)
    # The reproduction: a 1x1 image resized to 40,000x40,000 (DALI allocated it first).
    with pytest.raises(OperatorRefused, match="Resize makes samples of 1600000000 elements"):
        checked(size=(40_000, 40_000))
    with pytest.raises(OperatorRefused, match="max-image-pixels"):
        checked(resize_shorter=20_000)
    # Under the pixel limit, but no batch of it fits the job's output memory.
    with pytest.raises(OperatorRefused, match="more than the job's 1073741824 bytes"):
        checked(batch=32, resize_x=8000, resize_y=8000)
