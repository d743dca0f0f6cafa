"""The bad-sample search and policies as logic; tests/integration/test_bad_samples.py runs them
on real corrupt files through a real daemon."""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np
import pytest
from PIL import Image

from dalid.protocol import BadSample, OnError
from dalid.server.samples.badsamples import (
    dali_message,
    find_bad,
    oversized_images,
    plan,
    select,
    summary,
)


class Batch:
    """A trial that fails when the run holds any of ``bad``, or is the whole batch-level set."""

    def __init__(self, bad: set[int], fails_together: frozenset[int] = frozenset()) -> None:
        self.bad = bad
        self.fails_together = fails_together
        self.runs: list[list[int]] = []

    def __call__(self, positions: list[int]) -> Exception | None:
        self.runs.append(positions)
        hit = sorted(self.bad & set(positions))
        if hit:
            return RuntimeError(f"decoding failed\nC++ context [x]\ndecoding failed\n#{hit[0]}")
        if self.fails_together and self.fails_together <= set(positions):
            return RuntimeError("batch-level failure")
        return None


@pytest.mark.parametrize(
    "bad", [set(), {0}, {31}, {3, 4}, {0, 7, 8, 30}, set(range(32)), set(range(0, 32, 2))]
)
def test_find_bad_finds_exactly_the_bad_samples(bad: set[int]) -> None:
    trial = Batch(bad)
    error = trial(list(range(32))) if bad else None
    found = find_bad(list(range(32)), trial, whole_failed=error)
    assert set(found) == bad
    for position in bad:
        # DALI's message without its context lines and repeats.
        assert found[position] == f"decoding failed #{position}"


def test_find_bad_is_cheaper_than_one_run_per_sample_for_few_bad() -> None:
    trial = Batch({13})
    found = find_bad(list(range(64)), trial, whole_failed=trial(list(range(64))))
    assert found.keys() == {13}
    assert len(trial.runs) - 1 <= 2 * 6  # two halves per level, log2(64) levels


def test_a_batch_level_failure_has_no_bad_sample() -> None:
    trial = Batch(set(), fails_together=frozenset(range(8)))
    assert find_bad(list(range(8)), trial, whole_failed=trial(list(range(8)))) == {}


def test_find_bad_runs_the_candidates_first_when_they_were_not_tried() -> None:
    trial = Batch(set())
    assert find_bad([1, 2, 5], trial, whole_failed=None) == {}
    assert trial.runs == [[1, 2, 5]]
    assert find_bad([], trial, whole_failed=None) == {}


def test_dali_message_keeps_what_names_the_error() -> None:
    text = (
        "Critical error in pipeline:\nError in CPU operator `nvidia.dali.fn.decoders.image`,\n"
        "which was used in the pipeline definition with the following traceback:\n"
        '  File "/x/train.py", line 31, in decode\n    images = fn.decoders.image(jpegs)\n'
        "encountered:\nnvImageCodec failure: '#4'\nC++ context: [a.cc:12]\n"
        "Current pipeline object is no longer valid."
    )
    assert dali_message(RuntimeError(text)) == (
        "Error in CPU operator `nvidia.dali.fn.decoders.image`, encountered: "
        "nvImageCodec failure: '#4'"
    )
    assert dali_message(RuntimeError("")) == "RuntimeError"


def test_plans() -> None:
    bad = {1: "corrupt", 3: "too large"}
    assert plan(OnError.RAISE, 5, bad) == ([], [BadSample(1, "corrupt"), BadSample(3, "too large")])
    assert plan(OnError.SKIP, 5, bad) == (
        [0, 2, 4],
        [BadSample(1, "corrupt"), BadSample(3, "too large")],
    )
    assert plan(OnError.REPLACE, 5, bad) == (
        [0, 0, 2, 2, 4],
        [BadSample(1, "corrupt", replaced_by=0), BadSample(3, "too large", replaced_by=2)],
    )
    # Round the good samples when there are more bad ones.
    positions, _ = plan(OnError.REPLACE, 4, {0: "x", 1: "x", 2: "x"})
    assert positions == [3, 3, 3, 3]


@pytest.mark.parametrize("policy", list(OnError))
def test_no_good_sample_means_the_batch_fails(policy: OnError) -> None:
    positions, report = plan(policy, 2, {0: "a", 1: "b"})
    assert positions == []
    assert [sample.position for sample in report] == [0, 1]


def test_summary_names_positions_and_shortens() -> None:
    report = [BadSample(p, f"m{p}") for p in range(6)]
    text = summary(report)
    assert "positions [0, 1, 2, 3, 4, 5]" in text and "sample 3: m3" in text
    assert "sample 4: m4" not in text and "and 2 more" in text


def jpeg(width: int, height: int) -> np.ndarray:
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, format="JPEG")
    data = out.getvalue()
    at = data.index(b"\xff\xc0")
    data = data[: at + 5] + struct.pack(">HH", height, width) + data[at + 9 :]
    return np.frombuffer(data, dtype=np.uint8)


def test_oversized_images_only_in_1d_uint8_samples() -> None:
    bomb = jpeg(30000, 30000)
    fine = jpeg(100, 100)
    arrays: dict[str, list[Any]] = {  # scalars too: only 1-D uint8 samples are images
        "images": [fine, bomb, fine, bomb.copy().reshape(1, -1)],
        "labels": [np.int32(0), np.int32(1), bomb.view(np.int8), np.int32(3)],
    }
    found = oversized_images(arrays, max_pixels=10_000_000)
    assert list(found) == [1]
    assert "30000x30000" in found[1] and "--max-image-pixels" in found[1]
    assert oversized_images(arrays, max_pixels=0) == {}
    assert list(oversized_images(arrays, max_pixels=9_999)) == [0, 1, 2]  # 100x100 is over
    assert oversized_images(arrays, max_pixels=10_000) == {1: found[1].replace("10000000", "10000")}


def test_select_keeps_views_in_order() -> None:
    a = [np.arange(3) + 10 * i for i in range(4)]
    chosen = select({"a": a}, [2, 0, 2])
    assert [int(x[0]) for x in chosen["a"]] == [20, 0, 20]
    assert chosen["a"][0] is a[2]
