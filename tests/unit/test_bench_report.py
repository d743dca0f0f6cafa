"""The bench's results as kept: a summary per run (the raw result less its runs) beside LATEST.md,
the raw result and per-run plots in ``raw/``, which git ignores; every committed summary still
reads as a result, and bench/results stays small."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench import cpu_split, scaling_report
from bench.report import RAW, RAW_KEYS, RESULTS_DIR, compact, markdown, plot, write

ROOT = Path(__file__).resolve().parents[2]
SUMMARIES = sorted(
    p for p in RESULTS_DIR.rglob("*.json") if RAW not in p.parts and "soak" not in p.parts
)
# The soak's results (bench/soak.py) are of their own form: samples of the daemon's memory.
SOAKS = sorted((RESULTS_DIR / "soak").glob("*-soak.json"))
LATEST_CPU = RESULTS_DIR / "20261125T215110Z.json"  # the run bench/results/LATEST.md shows


def _tracked_bytes() -> int:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "bench/results"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    return sum((ROOT / name).stat().st_size for name in listed.decode().split("\0") if name)


def test_the_committed_results_are_summaries_and_stay_small() -> None:
    assert len(SUMMARIES) > 40
    for path in SUMMARIES:
        data = json.loads(path.read_text())
        assert not set(RAW_KEYS) & set(data), path
        assert {"machine", "summary", "settings"} <= set(data), path
        assert {"rows", "ratios", "targets"} <= set(data["summary"]), path
        assert path.stat().st_size < 250_000, path
    assert _tracked_bytes() < 5_000_000


@pytest.mark.parametrize("path", SUMMARIES, ids=lambda p: str(p.relative_to(RESULTS_DIR)))
def test_every_summary_reads_as_a_result(path: Path) -> None:
    text = markdown(json.loads(path.read_text()))
    assert "| target | goal |" in text or "| contender |" in text, path


def _report() -> dict[str, Any]:
    report: dict[str, Any] = json.loads(LATEST_CPU.read_text())
    report["created_utc"] = "2030-01-02T03:04:05Z"
    return report


@pytest.fixture(scope="module", autouse=True)
def _fonts_loaded(tmp_path_factory: pytest.TempPathFactory) -> None:
    """matplotlib keeps each font file it has drawn with open for the life of the process: the
    plots are drawn once before the tests' leak checks look."""
    folder = tmp_path_factory.mktemp("fonts")
    plot(_report(), folder / "a.png")
    scaling_report.plot(_report(), folder / "b.png")


def test_a_run_writes_its_summary_beside_latest_and_its_raw_result_in_raw(tmp_path: Path) -> None:
    written = write(_report(), [], [], tmp_path, update_latest=True)
    summary, raw = tmp_path / "20300102T030405Z.json", tmp_path / RAW / "20300102T030405Z.json"
    assert {summary, raw, tmp_path / "LATEST.md", tmp_path / "latest.png"} <= set(written)
    assert {p.name for p in tmp_path.glob("*.png")} <= {"latest.png", "latest-scaling.png"}
    assert (tmp_path / RAW / "20300102T030405Z.png").exists()  # per-run plots stay local
    full, kept = json.loads(raw.read_text()), json.loads(summary.read_text())
    assert full["runs"] == [] and full["disturbed_runs_redone"] == []
    assert kept == compact(full) and "runs" not in kept
    assert kept["summary"]["rows"] == full["summary"]["rows"]
    latest = (tmp_path / "LATEST.md").read_text()
    assert "[20300102T030405Z.json](20300102T030405Z.json)" in latest
    assert "![latest results](latest.png)" in latest


def test_a_quick_run_or_no_latest_leaves_latest_alone(tmp_path: Path) -> None:
    write(_report(), [], [], tmp_path, update_latest=False)
    assert not (tmp_path / "LATEST.md").exists() and not list(tmp_path.glob("*.png"))
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_a_profiles_results_name_it_the_cpu_profiles_do_not(tmp_path: Path) -> None:
    report = _report()
    report["settings"] = {**report["settings"], "profile": "small", "quick": True}
    written = write(report, [], [], tmp_path, update_latest=False)
    assert written[0].name == "20300102T030405Z-small-quick.json"
    report["settings"] = {**report["settings"], "profile": "cpu", "quick": False}
    assert write(report, [], [], tmp_path, update_latest=False)[0].name == "20300102T030405Z.json"


def test_git_ignores_raw_results_under_bench_results() -> None:
    for path in ("bench/results/raw/x.json", "bench/results/gpu-h100-x/a-profile/raw/x.png"):
        ignored = subprocess.run(
            ["git", "check-ignore", "-q", path], cwd=ROOT, check=False
        ).returncode  # fmt: skip
        assert ignored == 0, path
    assert subprocess.run(
        ["git", "check-ignore", "-q", "bench/results/x.json"], cwd=ROOT, check=False
    ).returncode == 1  # fmt: skip


def test_cpu_split_reads_a_summarys_raw_result_and_says_when_there_is_none(
    tmp_path: Path,
) -> None:
    run = {"kind": "dalid", "jobs": 1, "repeat": 0, "results": []}
    (tmp_path / RAW).mkdir()
    (tmp_path / RAW / "r.json").write_text(json.dumps({"summary": {}, "runs": [run]}))
    (tmp_path / "r.json").write_text(json.dumps({"summary": {}}))
    assert cpu_split.load_runs(tmp_path / "r.json") == [run]
    assert cpu_split.load_runs(tmp_path / RAW / "r.json") == [run]
    (tmp_path / "s.json").write_text(json.dumps({"summary": {}}))
    with pytest.raises(SystemExit, match=r"is a run's summary.*raw/s\.json"):
        cpu_split.load_runs(tmp_path / "s.json")


@pytest.mark.parametrize("path", SOAKS, ids=lambda path: path.name)
def test_every_soak_result_says_its_targets_and_stays_small(path: Path) -> None:
    data = json.loads(path.read_text())
    assert {"slope_second_half_mib_per_min", "rss_anon_after_mib", "targets"} <= set(data), path
    assert data["missing"] == data["duplicated"] == 0, path
    assert path.stat().st_size < 100_000, path
