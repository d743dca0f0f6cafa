"""The bench's scaling logic: Jain's fairness index, job counts, the plan, per-job rates."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench.__main__ import parse_args, plan
from bench.config import Settings
from bench.contenders import CONTENDERS
from bench.measure import LoopResult, Probe
from bench.runner import daemon_options
from bench.scaling import add_scaling_runs, jain_index, parse_job_counts
from bench.scaling_report import added_per_job
from bench.summary import window_rates


@pytest.mark.parametrize(
    ("rates", "expected"),
    [
        ([5.0], 1.0),
        ([3.0, 3.0, 3.0, 3.0], 1.0),
        ([8.0, 0.0, 0.0, 0.0], 0.25),  # one job gets everything: 1/n
        ([1.0, 2.0], 0.9),  # 3^2 / (2 * 5)
        ([1.0, 1.0, 4.0], 36 / 54),
    ],
)
def test_jain_index(rates: list[float], expected: float) -> None:
    assert jain_index(rates) == pytest.approx(expected)


def test_jain_index_does_not_depend_on_the_unit() -> None:
    rates = [120.0, 80.0, 95.0]
    assert jain_index(rates) == pytest.approx(jain_index([rate / 7 for rate in rates]))
    assert 1 / len(rates) < jain_index(rates) < 1


def test_jain_index_refuses_what_is_not_a_set_of_rates() -> None:
    with pytest.raises(ValueError, match="at least one"):
        jain_index([])
    with pytest.raises(ValueError, match="negative"):
        jain_index([1.0, -1.0])
    assert math.isnan(jain_index([0.0, 0.0]))


def test_parse_job_counts() -> None:
    assert parse_job_counts("1,2,4,8") == (1, 2, 4, 8)
    assert parse_job_counts(" 4, 1,4,") == (1, 4)
    for wrong in ("", "0,2", "-1", "two"):
        with pytest.raises(ValueError):
            parse_job_counts(wrong)


def test_scaling_runs_are_added_once() -> None:
    runs = [("torch-pil", 1), ("dali", 1), ("dalid", 1), ("dali", 2)]
    planned = add_scaling_runs(runs, (1, 2, 4))
    assert planned[: len(runs)] == runs
    assert planned[len(runs) :] == [
        ("dalid-private", 1), ("dalid", 2), ("dalid-private", 2),
        ("dali", 4), ("dalid", 4), ("dalid-private", 4),
    ]  # fmt: skip


def test_plan_adds_the_scaling_runs_only_when_asked() -> None:
    settings = Settings(scaling_jobs=(1, 4))
    runs, planned = plan(settings, "scaling")
    assert runs == [
        ("dali", 1), ("dalid", 1), ("dalid-private", 1),
        ("dali", 4), ("dalid", 4), ("dalid-private", 4),
    ]  # fmt: skip
    assert planned.scaling_jobs == (1, 4)
    runs, planned = plan(settings, "dali,dalid")
    assert runs == [("dali", 1), ("dalid", 1), ("dali", 2), ("dalid", 2)]
    assert planned.scaling_jobs == ()


def test_the_private_pipelines_contender_is_dalid_with_sharing_off() -> None:
    runs, _ = plan(Settings(jobs=2), "dalid-private")
    assert runs == [("dalid-private", 1), ("dalid-private", 2)]
    shared, private = CONTENDERS["dalid"], CONTENDERS["dalid-private"]
    assert private.run is shared.run and private.needs_daemon
    assert private.daemon_args == ("--share-pipelines", "no") and shared.daemon_args == ()
    assert "shared" in shared.label and "private" in private.label
    assert daemon_options("dalid-private") == private.daemon_args
    assert daemon_options("transport") == ()


def test_scaling_jobs_from_the_command_line() -> None:
    assert parse_args(["--scaling-jobs", "8,1,2"]).scaling_jobs == (1, 2, 8)
    with pytest.raises(SystemExit):
        parse_args(["--scaling-jobs", "0"])


def test_settings_keep_scaling_jobs_through_json() -> None:
    settings = Settings(scaling_jobs=(1, 3))
    assert Settings.from_json(settings.to_json()) == settings


def _loop(job: int, stamps_s: list[float], warmup: int = 1) -> LoopResult:
    stamps = [round(s * 1e9) for s in stamps_s]
    probe = Probe(t_ns=0, trainer_cpu_s=0.0, workers_cpu_s=0.0, daemon_cpu_s=0.0)
    return LoopResult(
        contender="dalid", job=job, batch_size=10, warmup_batches=warmup, stamps_ns=stamps,
        start=Probe(**{**probe.__dict__, "t_ns": stamps[warmup - 1]}),
        end=Probe(**{**probe.__dict__, "t_ns": stamps[-1]}),
        first_batch_s=0.0, trainer_peak_rss_mb=0.0, workers_peak_rss_mb=0.0,
        daemon_peak_rss_mb=0.0, checksum=0.0,
    )  # fmt: skip


def test_per_job_rates_in_the_common_window_add_up_to_the_total() -> None:
    # Job 0 gets a batch every second, job 1 one every two seconds, both from t=1 to t=9.
    fast = _loop(0, [1.0 + i for i in range(9)])
    slow = _loop(1, [1.0 + 2 * i for i in range(5)])
    total, per_job, window = window_rates([fast, slow])
    assert window == "common window"
    assert per_job == pytest.approx([10.0, 5.0])
    assert total == pytest.approx(sum(per_job))
    assert jain_index(per_job) == pytest.approx(0.9)


def test_jobs_that_barely_overlap_are_each_measured_over_their_own_window() -> None:
    early = _loop(0, [1.0, 2.0, 3.0, 4.0, 5.0])
    late = _loop(1, [4.5, 6.5, 8.5, 10.5, 12.5])
    total, per_job, window = window_rates([early, late])
    assert window == "union window"
    assert per_job == pytest.approx([10.0, 5.0])
    assert total == pytest.approx(80 / 11.5)


def _memory_row(kind: str, jobs: int, pss: float, daemon_peak: float | None) -> dict[str, Any]:
    memory = {"all_pss_mb": {"n": 3, "median": pss}}
    if daemon_peak is not None:
        memory["daemon_peak_rss_mb"] = {"n": 3, "median": daemon_peak}
    return {"kind": kind, "jobs": jobs, "memory": memory}


def test_memory_each_job_adds_is_the_growth_from_one_job_over_the_jobs_added() -> None:
    rows = [
        _memory_row("dali", 1, 400.0, None),
        _memory_row("dalid", 1, 700.0, 500.0),
        _memory_row("dali", 8, 3200.0, None),
        _memory_row("dalid", 8, 2450.0, 850.0),
        _memory_row("dalid-private", 8, 2900.0, 1270.0),  # no one-job run to compare with
    ]
    assert added_per_job(rows, "all_pss_mb") == {("dali", 8): 400.0, ("dalid", 8): 250.0}
    assert added_per_job(rows, "daemon_peak_rss_mb") == {("dalid", 8): 50.0}


def test_the_cohort_runs_are_in_process_dalid_and_a_cohort_at_each_job_count() -> None:
    runs, planned = plan(Settings(scaling_jobs=(2, 4)), "cohort")
    assert runs == [
        ("dali", 2), ("dalid", 2), ("dalid-cohort", 2), ("dalid-cohort-trailing", 2),
        ("dali", 4), ("dalid", 4), ("dalid-cohort", 4), ("dalid-cohort-trailing", 4),
    ]  # fmt: skip
    assert planned.scaling_jobs == (2, 4)
    # Not part of a run that does not ask for them.
    default, _ = plan(Settings(scaling_jobs=(2, 4)), None)
    assert not [kind for kind, _ in default if kind.startswith("dalid-cohort")]
