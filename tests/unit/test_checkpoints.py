"""Checkpoints in-process: the runner takes and restores a real DALI pipeline's checkpoint
between runs; the client's state checks; the loader's recorded indices across a resume.

The same paths with a daemon and killed trainers: tests/integration/test_resume.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from nvidia.dali import fn, types

import dalid.client as dalid
from dalid.client.checkpoint import check_state, fingerprint
from dalid.client.errors import InputError
from dalid.protocol import PROTOCOL_VERSION, RegisterPipeline
from dalid.server.pipelines.checkpoints import CheckpointUnavailable
from dalid.server.pipelines.runner import PipelineRunner
from dalid.server.pipelines.spec import PipelineSpec

from ..dali_typing import pipeline_def

BATCH = 4


@pipeline_def(batch_size=BATCH, num_threads=1, device_id=None, seed=77, enable_checkpointing=True)
def _augment() -> Any:
    image = fn.external_source(name="image", layout="HWC")
    cropped = fn.crop(
        image,
        crop=(4, 4),
        crop_pos_x=fn.random.uniform(range=(0.0, 1.0)),
        crop_pos_y=fn.random.uniform(range=(0.0, 1.0)),
    )
    return fn.flip(cropped, horizontal=fn.random.coin_flip()), fn.random.uniform(
        range=(0.0, 1.0), dtype=types.DALIDataType.FLOAT
    )


def _request(pipeline: Any) -> RegisterPipeline:
    return RegisterPipeline(
        serialized=memoryview(pipeline.serialize()),
        input_names=("image",),
        num_outputs=2,
        max_batch_size=pipeline.max_batch_size,
        num_threads=1,
        prefetch_queue_depth=2,
        seed=pipeline.seed,
    )


def _runner(pipeline: Any) -> PipelineRunner:
    return PipelineRunner(PipelineSpec.from_message(_request(pipeline)), None)


def _images(number: int) -> list[np.ndarray]:
    return [
        (np.arange(8 * 8 * 3).reshape(8, 8, 3) + 11 * (number * BATCH + row)).astype(np.uint8)
        for row in range(BATCH)
    ]


def _run(runner: PipelineRunner, number: int) -> list[np.ndarray]:
    runner.schedule({"image": _images(number)})
    outputs = runner.collect()
    runner.release()
    return [np.array(output.as_tensor()) for output in outputs]


def test_a_restored_pipeline_draws_as_the_one_it_was_taken_from() -> None:
    runner = _runner(_augment())
    for number in range(3):
        _run(runner, number)
    checkpoint, runs = runner.checkpoint()
    assert runs == 3 and checkpoint
    after = [_run(runner, number) for number in range(3, 6)]

    restored = _runner(_augment())
    _run(restored, 0)  # it has run: the restore sets its state all the same
    restored.restore(checkpoint)
    assert restored.runs == 0
    again = [_run(restored, number) for number in range(3, 6)]
    for expected, got in zip(after, again, strict=True):
        for a, b in zip(expected, got, strict=True):
            np.testing.assert_array_equal(a, b)
    fresh = _runner(_augment())
    differs = [_run(fresh, number) for number in range(3, 6)]
    assert not all(np.array_equal(a[1], b[1]) for a, b in zip(after, differs, strict=True))


def test_no_checkpoint_while_a_run_is_inside_dali() -> None:
    runner = _runner(_augment())
    runner.schedule({"image": _images(0)})
    with pytest.raises(CheckpointUnavailable, match="inside DALI"):
        runner.checkpoint()
    with pytest.raises(CheckpointUnavailable, match="inside DALI"):
        runner.restore(b"anything")
    runner.collect()
    runner.release()
    assert runner.checkpoint()[1] == 1


def test_a_pipeline_without_checkpointing_says_what_to_do() -> None:
    runner = _runner(_augment(enable_checkpointing=False))
    with pytest.raises(CheckpointUnavailable, match=r"enable_checkpointing=True"):
        runner.checkpoint()


def test_a_checkpoint_dali_cannot_read_is_refused() -> None:
    runner = _runner(_augment())
    with pytest.raises(CheckpointUnavailable, match="DALI could not restore"):
        runner.restore(b"not a checkpoint")


def test_fingerprints_tell_pipelines_apart() -> None:
    same = fingerprint(_request(_augment()))
    assert same == fingerprint(_request(_augment()))
    assert same != fingerprint(_request(_augment(seed=78)))
    assert same != fingerprint(_request(_augment(batch_size=BATCH + 1)))


def test_state_checks_name_what_differs() -> None:
    check_state({"protocol": PROTOCOL_VERSION, "dataset_length": 10}, 10)
    with pytest.raises(
        InputError, match=f"protocol 1, and this one speaks protocol {PROTOCOL_VERSION}"
    ):
        check_state({"protocol": 1, "dataset_length": 10}, 10)
    with pytest.raises(InputError, match="dataset of 10 samples, and this loader's dataset has 9"):
        check_state({"protocol": PROTOCOL_VERSION, "dataset_length": 10}, 9)


class _Recorder:
    """A producer without pipelines: passes batches on and keeps the indices it is told."""

    def __init__(self) -> None:
        self.indices: list[list[int] | None] = []

    def produce_data(self, obj: Any) -> Any:
        return obj

    def produce(self, obj: Any, *, step: int | None = None, indices: Any = None) -> Any:
        self.indices.append(indices)
        return obj


@pytest.mark.parametrize("workers", [0, 2])
def test_the_recorded_indices_follow_a_resume(workers: int) -> None:
    """The loader's batch sampler, wrapped to record each batch's indices, passes torchdata's
    sampler state through: a resumed loader yields what the uninterrupted one did, and the
    indices it records are those of its batches (the dataset's samples are their indices)."""

    def loader(producer: _Recorder) -> dalid.DataLoader:
        torch.manual_seed(3)
        return dalid.DataLoader(producer, list(range(20)), batch_size=3, shuffle=True,
                                num_workers=workers)  # fmt: skip

    whole = loader(_Recorder())
    expected = _one_epoch(whole) + _one_epoch(whole)
    producer = _Recorder()
    first = loader(producer)
    iterator = iter(first)
    head = [next(iterator).tolist() for _ in range(4)]
    state = first.state_dict()
    del iterator
    resumed = loader(producer)
    resumed.load_state_dict(state)
    rest = _one_epoch(resumed) + _one_epoch(resumed)
    assert head + rest == expected
    assert producer.indices == head + rest


def _one_epoch(loader: dalid.DataLoader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]
