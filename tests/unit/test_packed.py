"""Paths of several lengths left packed in their frame (server/samples/packed.py): the same samples
as their views, one run of several batches, and the same padded array DALI is fed."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dalid.protocol import InputBatch, OnError, SubmitBatch
from dalid.server.outputs.job_outputs import JobOutputs
from dalid.server.runs.run_planner import RunPlanner
from dalid.server.runs.runs import Member, PendingBatch, Run
from dalid.server.runs.scheduler import ServiceClock
from dalid.server.samples.packed import PackedSamples
from dalid.server.samples.paths import padded_paths

PATHS = [b"/data/a/1.jpg", b"/data/bbb/22.jpg", b"/e.jpg", b"/data/a/333.jpg"]


def _item(paths: list[bytes], dtype: type = np.uint8, name: str = "paths") -> InputBatch:
    return InputBatch.of(name, [np.frombuffer(path, dtype) for path in paths])


def _packed(paths: list[bytes], dtype: type = np.uint8) -> PackedSamples:
    item = _item(paths, dtype)
    return PackedSamples(np.frombuffer(item.data, item.dtype), item.sample_bytes())


def test_packed_samples_are_the_views_of_the_frame() -> None:
    packed = _packed(PATHS)
    views = _item(PATHS).arrays()
    assert len(packed) == len(PATHS)
    assert [sample.tobytes() for sample in packed] == PATHS
    assert [packed[i].tobytes() for i in range(len(PATHS))] == [v.tobytes() for v in views]
    assert packed[-1].tobytes() == PATHS[-1]
    assert [sample.tobytes() for sample in packed[1:3]] == PATHS[1:3]
    assert packed[0].dtype == np.uint8
    with pytest.raises(IndexError):
        packed[len(PATHS)]


def test_batches_of_packed_samples_join_into_one_run() -> None:
    more = [b"/x/yy.jpg", b"/z.jpg"]
    joined = PackedSamples.joined([_packed(PATHS), _packed(more), _packed(PATHS[:1])])
    assert [sample.tobytes() for sample in joined] == [*PATHS, *more, PATHS[0]]
    assert joined.bounds.dtype == np.int64


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_packed_paths_are_padded_as_their_views_are(dtype: type) -> None:
    packed = padded_paths(_packed(PATHS, dtype))
    viewed = padded_paths([np.frombuffer(path, dtype) for path in PATHS])
    assert packed is not None and viewed is not None
    assert packed.dtype == viewed.dtype == dtype
    np.testing.assert_array_equal(packed, viewed)
    assert [row.tobytes().lstrip(b"/") for row in packed] == [p.lstrip(b"/") for p in PATHS]
    # What padding would change is not padded, packed or not.
    assert padded_paths(_packed([b"/a.jpg", b"b/c.jpg"])) is None
    assert padded_paths(_packed([b"/a.jpg", b""])) is None


def test_the_planner_keeps_path_inputs_of_several_lengths_packed() -> None:
    member = Member(1, 1, JobOutputs([]), lambda batch, result: None, OnError.RAISE)
    planner = RunPlanner(None, ServiceClock(), threading.Event(), 0)
    planner.path_inputs = ("paths", "same_length")
    inputs = (
        _item(PATHS),
        _item([b"/a/1", b"/b/2", b"/c/3", b"/d/4"], name="same_length"),
        _item(PATHS, name="not_paths"),
    )
    batch = PendingBatch(1, SubmitBatch(1, inputs), member)
    planner.prepare(batch)
    assert isinstance(batch.arrays["paths"], PackedSamples)
    assert isinstance(batch.arrays["same_length"], np.ndarray)
    np.testing.assert_array_equal(batch.arrays["same_length"], inputs[1].arrays())
    assert isinstance(batch.arrays["not_paths"], list)
    other = PendingBatch(2, SubmitBatch(1, inputs), member)
    planner.prepare(other)
    both = Run([batch, other], 1).arrays()["paths"]
    assert isinstance(both, PackedSamples)
    assert [sample.tobytes() for sample in both] == PATHS * 2
