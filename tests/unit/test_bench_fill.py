"""The bench's reading of the daemon's pipelines: trainers' readings merged, and a run's figures."""

from __future__ import annotations

from typing import Any

import pytest

from bench.fill import merge_readings, pipeline_figures, run_pipelines


def _pipeline(number: int, jobs: list[int], runs: int, samples: int, **more: Any) -> dict[str, Any]:
    shared = more.pop("shared", True)
    run_size = more.pop("run_size", 128 if shared else 32)
    return {
        "pipeline": number, "name": "pipe", "shared": shared, "jobs": jobs,
        "run_size": run_size, "threads": more.pop("threads", 2), "runs": runs,
        "samples": samples, "mean_fill": samples / (runs * run_size) if runs else 0.0,
        "mixed_runs": more.pop("mixed_runs", 0), "private_reason": "" if shared else "off",
    }  # fmt: skip


def test_a_pipeline_counts_once_at_its_last_reading_with_every_job_it_served() -> None:
    # Job 1 ends first and reads the shared pipeline serving jobs 1 and 2; job 2 reads it last,
    # after job 1 has left it.
    first = {"t_ns": 10, "pipelines": [_pipeline(1, [1, 2], runs=5, samples=400)]}
    last = {"t_ns": 20, "pipelines": [_pipeline(1, [2], runs=9, samples=800)]}
    (merged,) = merge_readings([last, first])
    assert merged["runs"] == 9 and merged["samples"] == 800
    assert merged["jobs"] == [1, 2]


def test_private_pipelines_of_jobs_that_ended_are_kept_from_their_own_readings() -> None:
    # Each job's pipeline leaves the daemon with it: only its own reading sees it whole.
    readings = [
        {"t_ns": 10, "pipelines": [_pipeline(1, [1], 4, 128, shared=False),
                                   _pipeline(2, [2], 3, 96, shared=False)]},
        {"t_ns": 20, "pipelines": [_pipeline(2, [2], 6, 192, shared=False)]},
    ]  # fmt: skip
    merged = merge_readings(readings)
    assert [(p["pipeline"], p["runs"]) for p in merged] == [(1, 4), (2, 6)]


def test_readings_that_failed_are_left_out() -> None:
    readings = [{"t_ns": 5, "error": "DaemonFailed: no status"}, {"t_ns": 6, "pipelines": []}]
    assert merge_readings(readings) == []
    assert pipeline_figures([]) is None


def test_mean_fill_is_the_samples_over_what_the_runs_could_hold() -> None:
    pipelines = [
        _pipeline(1, [1, 2, 3], runs=10, samples=960, mixed_runs=6),  # 10 runs of 128
        _pipeline(2, [4], runs=5, samples=160, shared=False, threads=3),  # 5 runs of 32
    ]
    figures = pipeline_figures(pipelines)
    assert figures is not None
    assert figures["mean_fill"] == pytest.approx((960 + 160) / (10 * 128 + 5 * 32))
    assert figures["mixed_share"] == pytest.approx(6 / 15)
    assert figures["pipelines"] == 2 and figures["shared"] == 1
    assert figures["jobs_per_pipeline"] == 3
    assert figures["threads"] == 5
    assert figures["run_size"] == 128
    assert (figures["runs"], figures["samples"], figures["mixed_runs"]) == (15, 1120, 6)


def test_a_pipeline_that_never_ran_has_no_fill() -> None:
    figures = pipeline_figures([_pipeline(1, [1], runs=0, samples=0)])
    assert figures is not None
    assert figures["mean_fill"] is None and figures["mixed_share"] is None


def test_a_runs_pipelines_come_from_its_trainers_results() -> None:
    results: list[dict[str, Any]] = [
        {"loop": {}, "pipelines": {"t_ns": 1, "pipelines": [_pipeline(1, [1, 2], 2, 256)]}},
        {"loop": {}, "pipelines": {"t_ns": 2, "error": "ZMQError: gone"}},
        {"loop": {}},  # a contender without a daemon reads none
    ]
    found = run_pipelines(results)
    assert [p["pipeline"] for p in found["pipelines"]] == [1]
    assert found["figures"]["mean_fill"] == pytest.approx(1.0)
    assert found["errors"] == ["ZMQError: gone"]
    assert found["batches_copied"] is None  # no reading named a job
    assert run_pipelines([{"loop": {}}]) == {
        "pipelines": [],
        "figures": None,
        "errors": [],
        "batches_copied": None,
    }
    # Each job's copies from the last reading that names it, the jobs' added up.
    jobs = [
        {"loop": {}, "pipelines": {"t_ns": 1, "jobs": [{"job_id": 1, "batches_copied": 2}]}},
        {"loop": {}, "pipelines": {"t_ns": 2, "jobs": [{"job_id": 1, "batches_copied": 5},
                                                       {"job_id": 2, "batches_copied": 1}]}},
    ]  # fmt: skip
    assert run_pipelines(jobs)["batches_copied"] == 6


def test_a_pipeline_on_several_instances_counts_their_threads_and_says_why() -> None:
    reason = "2 instances: 1->2 raised 8,100 to 11,900 samples/s; CPU 1.9 of 2 cores busy"
    shared = _pipeline(1, [1, 2], runs=10, samples=960)
    shared.update(instances=2, instances_reason=reason)
    figures = pipeline_figures([shared, _pipeline(2, [3], runs=5, samples=160, shared=False)])
    assert figures is not None
    assert figures["instances"] == 2 and figures["instances_reasons"] == [reason]
    assert figures["threads"] == 2 * 2 + 2
