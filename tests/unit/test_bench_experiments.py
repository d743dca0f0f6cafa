"""The GPU experiments' summary (bench/experiments.py) over a real GPU run's results: the H100's
bench-gpu run (bench/results/gpu-h100-20261126b), read as the base experiment and as another
whose daemon ran with settings of its own."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from bench import experiments

H100 = Path(__file__).parents[2] / "bench/results/gpu-h100-20261126b/a-profile"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (results,) = H100.glob("*.json")
    for name in ("base", "run-batches-1"):
        (tmp_path / name).mkdir()
        shutil.copy(results, tmp_path / name)
    (tmp_path / "run-batches-1" / "daemon-env.txt").write_text("DALID_RUN_BATCHES=1\n")
    (tmp_path / "skipped.txt").write_text("experiment threads-8 skipped\n")
    return tmp_path


def test_rows_and_the_gpu_memory_of_each_extra_job(folder: Path) -> None:
    rows = experiments.read_experiment(folder / "base")
    by_id = {(row.kind, row.jobs): row for row in rows}
    assert set(by_id) == {("dali", 1), ("dalid", 1), ("dali", 8), ("dalid", 8)}
    dalid = by_id["dalid", 8]
    assert (dalid.daemon, dalid.daemon_gpu_mb, dalid.threads, dalid.instances) == (
        "defaults",
        4948,
        32,
        2,
    )
    assert (dalid.run_size, dalid.gpu_busy_pct) == (1024, 25)
    assert by_id["dali", 1].daemon_gpu_mb is None  # not read: no daemon
    # The bench's own target figure for this run: 84.8%.
    found = experiments.added_gpu_ratio(rows, by_id["dali", 1])
    assert found is not None and found[0] == 8 and found[1] == pytest.approx(0.848, abs=0.001)
    assert experiments.added_gpu_ratio(rows, None) is None
    one_job = [row for row in rows if row.jobs == 1]
    assert experiments.added_gpu_ratio(one_job, by_id["dali", 1]) is None


def test_the_summary_puts_the_base_first_and_says_what_each_daemon_ran_with(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert experiments.main([str(folder)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    table = [line for line in lines if line.startswith(("| base", "| run-"))]
    assert len(table) == 8 and all(line.startswith("| base") for line in table[:4])
    assert "| run-batches-1 | DALID_RUN_BATCHES=1 | dalid (shared) | 1 | 12,654 | 0.63 |" in text
    assert "| base | defaults | dalid (shared) | 8 | 12,083 | 0.50 | 25 |" in text
    assert (
        "- base: 0.85 (8 jobs and 1)" in lines and "- run-batches-1: 0.85 (8 jobs and 1)" in lines
    )
    assert experiments.main([]) == 2
    # Without GPU memory (a CPU run), the table and a line that says so.
    cpu = experiments.summary({"base": experiments.read_experiment(folder / "base")[:2]})
    assert cpu.endswith("- none: no experiment read GPU memory at both job counts")


def test_a_base_with_dali_proxy_names_its_rows(folder: Path) -> None:
    """bench-gpu's first run, the base when both run in one call, holds DALI's proxy rows too:
    named as such, against in-process with as many jobs, with no daemon settings."""
    base = experiments.read_experiment(folder / "base")
    proxy = [dataclasses.replace(row, kind="dali-proxy") for row in base if row.kind == "dali"]
    text = experiments.summary({"base": [*base, *proxy]})
    rows = [line for line in text.splitlines() if "| DALI proxy |" in line]
    assert len(rows) == 2 and all(line.startswith("| base |  | DALI proxy |") for line in rows)
    assert all("| 1.00 |" in line for line in rows)  # the same rate as in-process here
