"""Finding batch references in nested structures and replacing them (a fake resolver)."""

from __future__ import annotations

import dataclasses
import enum
from collections import namedtuple
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from dalid.client.refs import DALIOutputBatchRef, DALIPipelineRunRef
from dalid.client.structure import find_runs, replace_refs, take_rows


class Output:
    """What the fake resolver produces for output ``index`` of ``run``."""

    def __init__(self, run: DALIPipelineRunRef, index: int) -> None:
        self.run = run
        self.index = index

    def __repr__(self) -> str:
        return f"Output(pipeline={self.run.pipeline_id}, index={self.index})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Output) and other.run is self.run and other.index == self.index

    __hash__ = None  # type: ignore[assignment]


class FakeResolver:
    """Records each call; every run has ``outputs`` outputs, each resolved once."""

    def __init__(self, outputs: int = 3) -> None:
        self.outputs = outputs
        self.calls: list[list[DALIPipelineRunRef]] = []

    def __call__(self, runs: list[DALIPipelineRunRef]) -> dict[int, tuple[Any, ...]]:
        self.calls.append(list(runs))
        return {id(run): tuple(Output(run, i) for i in range(self.outputs)) for run in runs}


def _run(pipeline_id: int = 1) -> DALIPipelineRunRef:
    return DALIPipelineRunRef(pipeline_id, job_id=1, deterministic=False)


def _ref(run: DALIPipelineRunRef, output_idx: int = 0) -> DALIOutputBatchRef:
    return DALIOutputBatchRef(run, output_idx)


class Pair(NamedTuple):
    image: Any
    label: Any


OldPair = namedtuple("OldPair", ["image", "label"])


class PlainTuple(tuple[Any, ...]):
    __slots__ = ()


class Batch:
    def __init__(self, image: Any, label: Any) -> None:
        self.image = image
        self.label = label


@dataclasses.dataclass
class DataBatch:
    image: Any
    meta: dict[str, Any]


# --- Containers ---------------------------------------------------------------------------------


def test_list_is_replaced_in_place() -> None:
    run = _run()
    batch = [_ref(run, 0), _ref(run, 1), 3, "text"]
    resolve = FakeResolver()
    result = replace_refs(batch, resolve)
    assert result is batch
    assert batch == [Output(run, 0), Output(run, 1), 3, "text"]
    assert resolve.calls == [[run]]


def test_dict_is_replaced_in_place() -> None:
    run = _run()
    batch = {"image": _ref(run, 0), "label": _ref(run, 1), "index": 7}
    result = replace_refs(batch, FakeResolver())
    assert result is batch
    assert batch == {"image": Output(run, 0), "label": Output(run, 1), "index": 7}
    assert list(batch) == ["image", "label", "index"]  # key order kept


def test_tuple_is_rebuilt() -> None:
    run = _run()
    batch = (_ref(run, 1), 5)
    result = replace_refs(batch, FakeResolver())
    assert type(result) is tuple
    assert result == (Output(run, 1), 5)
    assert isinstance(batch[0], DALIOutputBatchRef)  # the original tuple is untouched


@pytest.mark.parametrize("cls", [Pair, OldPair], ids=["typing.NamedTuple", "namedtuple"])
def test_named_tuple_is_rebuilt_with_its_type(cls: type[Any]) -> None:
    run = _run()
    result = replace_refs(cls(image=_ref(run, 0), label=_ref(run, 1)), FakeResolver())
    assert type(result) is cls
    assert result.image == Output(run, 0)
    assert result.label == Output(run, 1)


def test_tuple_subclass_is_rebuilt_with_its_type() -> None:
    run = _run()
    result = replace_refs(PlainTuple([_ref(run), 2]), FakeResolver())
    assert type(result) is PlainTuple
    assert result == (Output(run, 0), 2)


def test_object_attributes_are_updated_in_place() -> None:
    run = _run()
    batch = Batch(_ref(run, 0), [_ref(run, 1)])
    result = replace_refs(batch, FakeResolver())
    assert result is batch
    assert batch.image == Output(run, 0)
    assert batch.label == [Output(run, 1)]


def test_dataclass_fields_are_updated_in_place() -> None:
    run = _run()
    batch = DataBatch(image=_ref(run, 2), meta={"labels": (_ref(run, 1),)})
    result = replace_refs(batch, FakeResolver())
    assert result is batch
    assert batch.image == Output(run, 2)
    assert batch.meta == {"labels": (Output(run, 1),)}


def test_deeply_nested_structures() -> None:
    run = _run()
    batch = {"a": [Pair(image={"x": [(_ref(run, 0),)]}, label=Batch(_ref(run, 1), None))]}
    replace_refs(batch, FakeResolver())
    pair = batch["a"][0]
    assert isinstance(pair, Pair)
    assert pair.image == {"x": [(Output(run, 0),)]}
    assert pair.label.image == Output(run, 1)


def test_a_bare_reference_is_replaced() -> None:
    run = _run()
    assert replace_refs(_ref(run, 2), FakeResolver()) == Output(run, 2)


# --- Sharing and cycles -------------------------------------------------------------------------


def test_shared_references_are_resolved_once() -> None:
    run = _run()
    ref = _ref(run, 0)
    inner: list[Any] = [ref]  # replace_refs replaces its item in place
    pair = (ref, 1)
    batch = {"a": inner, "b": inner, "c": pair, "d": pair, "e": ref}
    resolve = FakeResolver()
    replace_refs(batch, resolve)
    assert resolve.calls == [[run]]
    assert batch["a"] is batch["b"] is inner
    assert inner == [Output(run, 0)]
    assert batch["c"] is batch["d"]  # one rebuilt tuple for both places
    assert batch["c"] == (Output(run, 0), 1)
    assert batch["e"] is inner[0] is batch["c"][0]


def test_list_cycle() -> None:
    run = _run()
    batch: list[Any] = [_ref(run)]
    batch.append(batch)
    assert find_runs(batch) == [run]
    result = replace_refs(batch, FakeResolver())
    assert result is batch
    assert batch[0] == Output(run, 0)
    assert batch[1] is batch


def test_dict_and_object_cycles() -> None:
    run = _run()
    holder = Batch(_ref(run, 0), None)
    batch: dict[str, Any] = {"holder": holder, "ref": _ref(run, 1)}
    holder.label = batch
    batch["self"] = batch
    replace_refs(batch, FakeResolver())
    assert batch["self"] is batch
    assert holder.label is batch
    assert holder.image == Output(run, 0)
    assert batch["ref"] == Output(run, 1)


def test_cycle_through_a_tuple() -> None:
    run = _run()
    inner: list[Any] = [_ref(run, 1)]
    outer = (_ref(run, 0), inner)
    inner.append(outer)
    result = replace_refs(outer, FakeResolver())
    assert result[0] == Output(run, 0)
    assert result[1] is inner
    assert inner[0] == Output(run, 1)
    assert inner[1][0] == Output(run, 0)  # the list holds a rebuilt tuple without references


# --- Runs ---------------------------------------------------------------------------------------


def test_refs_of_one_run_take_one_resolver_call() -> None:
    first, second = _run(1), _run(2)
    batch = [_ref(first, 0), _ref(second, 0), {"x": _ref(first, 1), "y": _ref(second, 2)}]
    resolve = FakeResolver()
    replace_refs(batch, resolve)
    assert len(resolve.calls) == 1
    (runs,) = resolve.calls
    assert runs == [first, second]
    assert batch == [
        Output(first, 0),
        Output(second, 0),
        {"x": Output(first, 1), "y": Output(second, 2)},
    ]


def test_runs_are_in_the_order_first_met() -> None:
    a, b, c = _run(1), _run(2), _run(3)
    batch = [[_ref(b, 0)], {"k": _ref(a, 0), "j": Batch(_ref(c, 0), _ref(b, 1))}, _ref(a, 1)]
    assert find_runs(batch) == [b, a, c]
    resolve = FakeResolver()
    replace_refs(batch, resolve)
    assert resolve.calls == [[b, a, c]]


def test_runs_are_distinct_objects_not_equal_ids() -> None:
    # Two runs of one pipeline are two batches, even with equal fields.
    first, second = _run(1), _run(1)
    assert find_runs([_ref(first), _ref(second), _ref(first)]) == [first, second]


# --- Structures without references --------------------------------------------------------------


@pytest.mark.parametrize(
    "batch",
    [
        [1, 2, 3],
        {"a": (1, "b"), "c": [None, 2.5]},
        (1, (2, (3,))),
        Pair(1, 2),
        "text",
        b"bytes",
        42,
        None,
        Batch(1, [2]),
    ],
    ids=lambda batch: type(batch).__name__,
)
def test_structures_without_refs_are_returned_unchanged(batch: Any) -> None:
    resolve = FakeResolver()
    assert find_runs(batch) == []
    assert replace_refs(batch, resolve) is batch
    assert resolve.calls == []


def test_tensors_and_arrays_are_not_descended_into() -> None:
    run = _run()
    tensor = torch.zeros(2)
    tensor.stray = _ref(run)  # type: ignore[attr-defined]
    array = np.empty(2, dtype=object)
    array[0] = _ref(run)
    batch = {"tensor": tensor, "array": array}
    resolve = FakeResolver()
    assert find_runs(batch) == []
    assert replace_refs(batch, resolve) is batch
    assert resolve.calls == []
    assert batch["tensor"] is tensor
    assert isinstance(tensor.stray, DALIOutputBatchRef)
    assert isinstance(array[0], DALIOutputBatchRef)


def test_tensors_beside_refs_are_kept() -> None:
    run = _run()
    tensor = torch.arange(3)
    array = np.arange(3)
    batch = [tensor, _ref(run), array]
    replace_refs(batch, FakeResolver())
    assert batch[0] is tensor
    assert batch[2] is array
    assert batch[1] == Output(run, 0)


# --- Foreign objects beside references ----------------------------------------------------------


class Colour(enum.Enum):
    RED = "red"


class Marker:
    pass


@dataclasses.dataclass(frozen=True)
class FrozenMeta:
    source: str


FOREIGN = [Colour.RED, Marker, FrozenMeta("train")]
FOREIGN_IDS = ["enum-member", "class", "frozen-dataclass"]


@pytest.mark.parametrize("foreign", FOREIGN, ids=FOREIGN_IDS)
def test_foreign_objects_without_refs_are_returned_unchanged(foreign: Any) -> None:
    batch = {"meta": foreign, "x": [1]}
    assert replace_refs(batch, FakeResolver()) is batch
    assert batch["meta"] is foreign


@pytest.mark.parametrize("foreign", FOREIGN, ids=FOREIGN_IDS)
def test_foreign_objects_beside_refs_are_left_untouched(foreign: Any) -> None:
    run = _run()
    batch = {"image": _ref(run, 0), "meta": foreign}
    replace_refs(batch, FakeResolver())
    assert batch["image"] == Output(run, 0)
    assert batch["meta"] is foreign


def test_take_rows_follows_per_sample_fields_only() -> None:
    Pair = namedtuple("Pair", "labels names")
    outputs = torch.zeros(2, 3)  # the daemon's outputs, already with the rows taken
    other = torch.arange(8).reshape(4, 2)
    obj = {
        "images": outputs,
        "pair": Pair(torch.tensor([10, 11, 12, 13]), ("a", "b", "c", "d")),
        "array": np.arange(4) * 2,
        "files": ["w", "x", "y", "z"],
        "not_per_sample": torch.ones(3),
        "scalar": torch.tensor(5),
        "mixed": [torch.ones(1), "x", 1, 2],  # holds a tensor: a container, not a field
    }
    result = take_rows(obj, 4, [0, 2], {id(outputs)})
    assert result["images"] is outputs
    assert result["pair"].labels.tolist() == [10, 12] and result["pair"].names == ("a", "c")
    assert result["array"].tolist() == [0, 4]
    assert result["files"] == ["w", "y"]
    assert result["not_per_sample"].tolist() == [1, 1, 1]
    assert int(result["scalar"]) == 5
    assert len(result["mixed"]) == 4
    # Repeated rows stand one sample in for another.
    assert take_rows(other, 4, [0, 0, 2, 3], set()).tolist() == [[0, 1], [0, 1], [4, 5], [6, 7]]
