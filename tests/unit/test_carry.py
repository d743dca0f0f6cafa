"""A worker's batch on its way to the trainer: small tensors by value, the rest as torch sends it.

Each batch goes through torch's own queue pickler (``ForkingPickler`` with torch's reductions,
what a DataLoader worker's result queue uses) and back, as in a real DataLoader; the end to
end path through workers is in tests/integration/test_dropin.py.
"""

from __future__ import annotations

import dataclasses
import gc
import pickle
from collections import namedtuple
from collections.abc import Iterator
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing  # registers torch's reductions with ForkingPickler
from torch.utils.data import DataLoader, Dataset

from dalid.client.loader import DataLoader as DalidLoader
from dalid.client.worker.carry import BY_VALUE_MAX_BYTES, CarriedBatch, CarryingCollate

Pair = namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass(frozen=True)
class Frozen:
    name: str
    labels: torch.Tensor


@pytest.fixture(autouse=True)
def _stop_resource_sharer() -> Iterator[None]:
    # torch's path shares a tensor's file descriptor through a thread that the first such
    # tensor starts in the sending process, here this one: it is stopped after each test.
    yield
    resource_sharer.stop()


def _through_queue(batch: Any) -> Any:
    return pickle.loads(ForkingPickler.dumps(CarriedBatch(batch)))


def test_small_tensors_arrive_as_copies_with_the_structure_kept() -> None:
    labels = torch.arange(32)
    weights = torch.rand(4, 3, dtype=torch.float64)
    pair = Pair(torch.tensor([True, False]), [weights, "name", 3])
    frozen = Frozen("x", torch.zeros(2, dtype=torch.int8))
    batch = {"labels": labels, "pair": pair, "frozen": frozen}
    got = _through_queue(batch)
    assert set(got) == {"labels", "pair", "frozen"}
    assert type(got["pair"]) is Pair and type(got["frozen"]) is Frozen
    for sent, arrived in [
        (labels, got["labels"]),
        (pair.left, got["pair"].left),
        (weights, got["pair"].right[0]),
        (frozen.labels, got["frozen"].labels),
    ]:
        assert type(arrived) is torch.Tensor
        assert arrived.dtype == sent.dtype and arrived.shape == sent.shape
        assert arrived.stride() == sent.stride()
        assert torch.equal(arrived, sent)
        # Memory of its own, not a shared-memory file, and writable as a collated tensor is.
        assert not arrived.is_shared()
        arrived.zero_()
    assert got["pair"].right[1:] == ["name", 3]
    assert got["frozen"].name == "x"


@pytest.mark.parametrize(
    "tensor",
    [
        pytest.param(torch.tensor(3.5), id="0-d"),
        pytest.param(torch.zeros(0, 3), id="empty"),
        pytest.param(torch.tensor([1 + 2j, 3j]), id="complex"),
        pytest.param(torch.arange(6, dtype=torch.float16).reshape(2, 3), id="float16"),
        pytest.param(torch.zeros(BY_VALUE_MAX_BYTES // 4), id="at-the-limit"),
    ],
)
def test_every_small_plain_tensor_arrives_the_same(tensor: torch.Tensor) -> None:
    arrived = _through_queue([tensor])[0]
    assert arrived.dtype == tensor.dtype and arrived.shape == tensor.shape
    assert arrived.stride() == tensor.stride()
    assert torch.equal(arrived, tensor) and not arrived.is_shared()


def test_a_tensor_met_twice_arrives_as_one() -> None:
    labels = torch.arange(4)
    large = torch.zeros(BY_VALUE_MAX_BYTES)
    got = _through_queue({"a": labels, "b": [labels, large], "c": large})
    assert got["a"] is got["b"][0]
    assert got["b"][1] is got["c"] and got["c"].is_shared()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.zeros(BY_VALUE_MAX_BYTES // 4 + 1), id="large"),
        pytest.param(lambda: torch.zeros(4, dtype=torch.bfloat16), id="no-numpy-dtype"),
        pytest.param(lambda: torch.arange(12).reshape(3, 4).t(), id="not-contiguous"),
        pytest.param(lambda: torch.arange(12)[2:5], id="part-of-its-storage"),
        pytest.param(lambda: torch.nn.Parameter(torch.zeros(3)), id="subclass"),
    ],
)
def test_other_tensors_go_as_torch_sends_them(make: Any) -> None:
    tensor = make()
    got = _through_queue([tensor, torch.arange(3)])
    arrived = got[0]
    assert type(arrived) is type(tensor)
    assert arrived.dtype == tensor.dtype and arrived.shape == tensor.shape
    assert arrived.stride() == tensor.stride()
    assert torch.equal(arrived.detach(), tensor.detach())
    assert arrived.is_shared()  # torch's own path: a shared-memory file
    assert not got[1].is_shared()


def test_a_small_tensor_in_shared_memory_arrives_as_a_copy() -> None:
    # What torch's default_collate makes of per-sample label tensors in a worker.
    labels = torch.arange(8).share_memory_()
    arrived = _through_queue([labels])[0]
    assert torch.equal(arrived, labels) and not arrived.is_shared()
    labels[0] = 99  # the worker's memory, no longer the trainer's batch
    assert arrived[0] == 0


def test_a_batch_without_tensors_arrives_as_it_was() -> None:
    batch = [np.arange(3), ("a", b"b"), {"n": None, "f": 1.5}]
    got = _through_queue(batch)
    np.testing.assert_array_equal(got[0], batch[0])
    assert got[1:] == batch[1:]


class _Labelled(Dataset[tuple[torch.Tensor, int]]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((2,), float(index)), index


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataloader_with_the_carrying_collate_gives_the_same_batches(num_workers: int) -> None:
    loader = DataLoader(_Labelled(), batch_size=4, num_workers=num_workers)
    loader.collate_fn = CarryingCollate(loader.collate_fn)
    batches = list(loader)
    assert len(batches) == 3
    for step, (values, labels) in enumerate(batches):
        expected = torch.arange(4 * step, 4 * step + 4)
        assert torch.equal(labels, expected)
        assert torch.equal(values, expected.float().repeat_interleave(2).reshape(4, 2))
        assert not labels.is_shared()


def test_a_dalid_loader_made_from_another_wraps_the_collate_fn_once() -> None:
    # Frameworks (Lightning) make a loader again from the attributes of another one.
    first = DalidLoader(object(), _Labelled(), batch_size=4)  # type: ignore[arg-type]
    again = DalidLoader(object(), _Labelled(), batch_size=4, collate_fn=first.collate_fn)  # type: ignore[arg-type]
    assert isinstance(again.collate_fn, CarryingCollate)
    assert not isinstance(again.collate_fn.collate_fn, CarryingCollate)


_initialised: list[int] = []


def _init_worker(worker_id: int) -> None:
    _initialised.append(worker_id)


class _FreezeCounts(Dataset[tuple[int, int]]):
    """Each sample: how many objects its worker's garbage collector leaves alone (frozen), and
    how many times the loader's own worker_init_fn ran in that worker."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[int, int]:
        return gc.get_freeze_count(), len(_initialised)


class _Passing:
    """A producer of DALI's kind whose batches hold no dalid references (there is nothing to
    replace): the loader's worker set-up alone is under test here."""

    def produce_data(self, batch: Any) -> Any:
        return batch


def test_a_dalid_loaders_workers_leave_the_heap_they_inherited_shared() -> None:
    before = gc.get_freeze_count()
    loader = DalidLoader(
        _Passing(), _FreezeCounts(), batch_size=2, num_workers=2, worker_init_fn=_init_worker
    )
    for frozen, initialised in list(loader):
        # The trainer's objects a worker inherited are frozen: its collections do not write
        # to (and so copy) their pages. And the worker_init_fn given still ran, once.
        assert (frozen > 10_000).all() and (initialised == 1).all()
    assert gc.get_freeze_count() == before and not _initialised  # the trainer's own: untouched
