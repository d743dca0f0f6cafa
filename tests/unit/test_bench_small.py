"""The bench's small profile: its settings and plan, its dataset of small JPEGs, the contender
fed by DataLoader workers, and its targets. Plain data, except the
dataset (real JPEGs, decoded) and the fed contender's source (a real DataLoader)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from torch.utils.data import DataLoader

from bench.__main__ import default_kinds, make_settings, parse_args, plan
from bench.config import PROFILES, SMALL, SMALL_QUICK, Settings
from bench.contenders import CONTENDERS, SMALL_KINDS, JpegDataset, LoaderSource, collate_jpegs
from bench.dataset import WIDTH_RANGE, dataset_dir, make_imagefolder
from bench.targets import SMALL_SHARED_TARGET, all_targets, row_id

LABELS = {kind: contender.label for kind, contender in CONTENDERS.items()}


def test_the_small_profile_is_the_issues_configuration() -> None:
    assert (SMALL.profile, SMALL.images, SMALL.batch_size) == ("small", 16384, 256)
    assert (SMALL.workers, SMALL.threads, SMALL.crop, SMALL.pipeline) == (2, 2, 32, "rrc")
    assert SMALL.image_widths == (40, 100) and SMALL.jobs == 4
    assert SMALL.repeats > 1  # interleaved repeats: each repeat runs every contender once
    assert SMALL_QUICK.quick and SMALL_QUICK.images < SMALL.images
    assert PROFILES["small"] == (SMALL, SMALL_QUICK)
    for settings in (SMALL, SMALL_QUICK):
        assert Settings.from_json(settings.to_json()) == settings
    assert make_settings(parse_args(["--profile", "small", "--cpu"])) == SMALL
    quick = make_settings(parse_args(["--profile", "small", "--quick", "--cpu", "--images", "512"]))
    assert quick == SMALL_QUICK.with_(images=512)


def test_the_small_profile_runs_its_contenders_with_1_and_4_jobs() -> None:
    assert default_kinds(SMALL) == list(SMALL_KINDS)
    assert set(SMALL_KINDS) == {"dali", "dali-fed", "dali-proxy", "dalid"}
    runs, settings = plan(SMALL, None)
    assert runs == [(kind, 1) for kind in SMALL_KINDS] + [("dali", 4), ("dalid", 4)]
    assert settings.scaling_jobs == ()
    # Elsewhere DALI fed by workers runs when asked only.
    assert "dali-fed" not in default_kinds(Settings())
    assert "dali-fed" not in default_kinds(Settings(quick=True))
    assert plan(Settings(jobs=1), "dali-fed")[0] == [("dali-fed", 1)]


def test_its_dataset_is_small_jpegs_cached_apart(tmp_path: Path) -> None:
    assert dataset_dir(64, 4, 0) == dataset_dir(64, 4, 0, widths=WIDTH_RANGE)
    assert dataset_dir(64, 4, 0, widths=(40, 100)).name.endswith("-w40-100")
    folder = make_imagefolder(tmp_path / "small", num_images=24, num_classes=3, widths=(40, 100))
    assert len(folder.paths) == 24 and folder.mean_bytes < 10_000
    for path in folder.paths:
        with Image.open(path) as image:
            assert 40 <= image.width <= 100
    # The same parameters reuse the folder; other widths make it again.
    again = make_imagefolder(tmp_path / "small", num_images=24, num_classes=3, widths=(40, 100))
    assert again.paths == folder.paths
    bigger = make_imagefolder(tmp_path / "small", num_images=24, num_classes=3, widths=(120, 130))
    with Image.open(bigger.paths[0]) as image:
        assert 120 <= image.width <= 130
    with pytest.raises(ValueError, match="widths"):
        make_imagefolder(tmp_path / "bad", num_images=4, num_classes=1, widths=(50, 40))


def test_workers_feed_file_bytes_an_epoch_at_a_time(tmp_path: Path) -> None:
    folder = make_imagefolder(tmp_path / "small", num_images=20, num_classes=2, widths=(40, 100))
    loader = DataLoader(
        JpegDataset(str(folder.root)), batch_size=8, drop_last=True, collate_fn=collate_jpegs
    )
    source = iter(LoaderSource(loader))
    for _ in range(2):  # each epoch ends with StopIteration, the next call starts the next
        batches = []
        while True:
            try:
                batches.append(next(source))
            except StopIteration:
                break
        assert len(batches) == 2
        jpegs, labels = batches[0]
        assert len(jpegs) == 8 and labels.dtype == np.int64 and labels.shape == (8,)
        assert bytes(jpegs[0]) == folder.paths[0].read_bytes()
        assert list(labels) == list(folder.labels[:8])


def _runs(dalid: float, dali: float, proxy: float, dalid4: float, dali4: float) -> Any:
    rates = {"dalid": dalid, "dali": dali, "dali-proxy": proxy,
             row_id("dalid", 4): dalid4, row_id("dali", 4): dali4}  # fmt: skip
    return {
        row: {0: {"samples_per_s": rate}, 1: {"samples_per_s": rate}} for row, rate in rates.items()
    }


def _targets(values: Any, profile: str = "small") -> dict[str, bool | None]:
    found = all_targets(values, {}, LABELS, profile=profile)
    return {target["name"]: target["met"] for target in found}


def test_the_small_profiles_targets() -> None:
    met = _targets(_runs(dalid=9_800, dali=10_000, proxy=9_700, dalid4=9_750, dali4=10_000))
    assert met["dalid (shared), 1 job: samples/s / DALI in-process, 1 job"] is True
    assert met["dalid (shared), 1 job: samples/s / DALI proxy, 1 job"] is True
    four = "dalid (shared), 4 jobs: samples/s / DALI in-process, 4 jobs (small profile)"
    assert met[four] is True
    # Not the CPU profile's sharing targets (parity at 4 jobs, 8 jobs' memory).
    assert not any("8 jobs" in name for name in met)
    missed = _targets(_runs(dalid=9_600, dali=10_000, proxy=9_700, dalid4=9_600, dali4=10_000))
    assert missed["dalid (shared), 1 job: samples/s / DALI in-process, 1 job"] is False
    assert missed["dalid (shared), 1 job: samples/s / DALI proxy, 1 job"] is False
    assert missed[four] is False and SMALL_SHARED_TARGET > 0.96
    values = _runs(dalid=9_800, dali=10_000, proxy=9_700, dalid4=0, dali4=0)
    del values[row_id("dalid", 4)], values[row_id("dali", 4)]
    assert _targets(values)[four] is None  # 4 jobs did not run: not measured, never met
    # The CPU profile keeps its own: parity at 4 jobs, no small-profile row.
    cpu = _targets(_runs(dalid=9_800, dali=10_000, proxy=9_700, dalid4=9_750, dali4=10_000), "cpu")
    assert four not in cpu
    assert cpu["dalid (shared), 4 jobs: samples/s / DALI in-process, 4 jobs"] is False
