"""The bench's weighted run: epochs by weight, per-job rates in the common window, the ratio to
the weights and its target, the jobs' queues, the plan and the report's table."""

from __future__ import annotations

from typing import Any

import pytest

from bench.__main__ import default_kinds, plan
from bench.config import QUICK, Settings
from bench.contenders import CONTENDERS
from bench.measure import LoopResult, Probe
from bench.report import markdown, targets_table
from bench.runner import Outcome
from bench.scaling_report import weighted_markdown
from bench.summary import summarize, weighted_metrics
from bench.targets import weight_target
from bench.weights import JOB_WEIGHTS, WEIGHTS, by_weight, queue_figures, weight_ratio, within

LABELS = {kind: contender.label for kind, contender in CONTENDERS.items()}
TARGET = "dalid (shared), 2 jobs of weights 1 and 3: samples/s of the heavy job / of the light job"


def test_heavier_jobs_get_as_many_more_as_they_weigh() -> None:
    assert by_weight(1, 1.0, (1.0, 3.0)) == 1
    assert by_weight(1, 3.0, (1.0, 3.0)) == 3
    assert by_weight(2, 3.0, (1.0, 3.0)) == 6
    assert by_weight(1, 3.0, (2.0, 3.0)) == 2  # 1.5, rounded up
    assert by_weight(2, 2.0, (2.0, 2.0)) == 2
    with pytest.raises(ValueError, match="positive"):
        by_weight(1, 1.0, (0.0, 1.0))


def test_each_trainer_gets_its_weight_its_epochs_and_its_batches_in_flight() -> None:
    settings = Settings(images=512, batch_size=32, workers=2, weights=JOB_WEIGHTS)
    light, heavy = settings.with_(job=0), settings.with_(job=1)
    assert (light.job_weight, light.job_passes, light.job_prefetch) == (1.0, 2, 2)
    assert (heavy.job_weight, heavy.job_passes, heavy.job_prefetch) == (3.0, 6, 6)
    # An epoch of the heavy job is three of the light job's: at 3:1 they end together. The
    # light job's goes over the images twice: half as many epoch ends as one pass would make.
    assert (light.batches_per_epoch, heavy.batches_per_epoch) == (32, 96)
    assert light.epochs == heavy.epochs == 5
    # Without weights every job weighs 1, goes over the images once, prefetches as torch does.
    plain = Settings(images=512, batch_size=32).with_(job=3)
    assert (plain.job_weight, plain.job_passes, plain.job_prefetch) == (1.0, 1, None)
    assert plain.batches_per_epoch == 16
    assert heavy.with_(workers=0).job_prefetch is None  # no workers, nothing to prefetch
    assert Settings.from_json(settings.to_json()) == settings


def test_the_weighted_contender_is_shared_dalid_with_weights_1_and_3() -> None:
    weighted, shared = CONTENDERS[WEIGHTS], CONTENDERS["dalid"]
    assert weighted.run is shared.run and weighted.needs_daemon and weighted.watch_queues
    assert weighted.daemon_args == shared.daemon_args == ()  # the default: a shared pipeline
    assert weighted.configure(Settings()).weights == JOB_WEIGHTS == (1.0, 3.0)
    assert shared.configure(Settings()).weights == ()


def test_the_weighted_run_is_planned_as_its_two_jobs() -> None:
    runs, _ = plan(Settings(), WEIGHTS)
    assert runs == [(WEIGHTS, 2)]
    runs, _ = plan(Settings(jobs=4), f"dalid,{WEIGHTS}")
    assert runs == [("dalid", 1), (WEIGHTS, 2), ("dalid", 4)]
    # In the default run, full and quick.
    assert WEIGHTS in default_kinds(Settings())
    assert WEIGHTS in default_kinds(QUICK)
    assert (WEIGHTS, 2) in plan(QUICK, None)[0]


def test_the_ratio_is_the_heaviest_jobs_rate_over_the_lightests() -> None:
    ratio = weight_ratio([170.0, 527.0], [1.0, 3.0])
    assert ratio is not None
    assert ratio["ratio"] == pytest.approx(3.1)
    assert ratio["expected"] == 3.0
    assert ratio["error"] == pytest.approx(3.1 / 3 - 1)
    # The jobs' order does not matter.
    assert weight_ratio([527.0, 170.0], [3.0, 1.0]) == ratio
    # Nothing to take a ratio of: equal weights, or a light job that got nothing.
    assert weight_ratio([100.0, 300.0], [2.0, 2.0]) is None
    assert weight_ratio([0.0, 300.0], [1.0, 3.0]) is None
    with pytest.raises(ValueError):
        weight_ratio([100.0], [1.0, 3.0])


def test_within_ten_percent() -> None:
    assert within(0.0) and within(0.1) and within(-0.1)
    assert within(2.7 / 3 - 1) and within(3.3 / 3 - 1)  # the bounds themselves
    assert not within(0.11) and not within(-0.2)
    assert not within(2.6 / 3 - 1) and not within(3.4 / 3 - 1)


def test_queue_figures_per_job_in_the_window() -> None:
    def reading(t_s: float, light: int, heavy: int) -> dict[str, Any]:
        jobs = [{"job_id": 7, "queued": light}, {"job_id": 8, "queued": heavy}]
        return {"t_ns": round(t_s * 1e9), "jobs": jobs}

    readings = [
        reading(0.5, 0, 0),  # before the window
        reading(1.0, 3, 1),
        reading(2.0, 2, 0),
        reading(3.0, 4, 2),
        reading(4.0, 1, 0),
        reading(9.0, 0, 0),  # after it
        {"t_ns": round(2.5e9), "jobs": []},  # the jobs had gone
    ]
    light, heavy, gone = queue_figures(readings, [7, 8, 9], round(1e9), round(4e9))
    assert light == {"queued": 2.5, "backlogged": 1.0, "readings": 4}
    assert heavy == {"queued": 0.5, "backlogged": 0.5, "readings": 4}
    assert gone is None


def _loop(job: int, stamps_s: list[float], warmup: int = 1, batch: int = 10) -> LoopResult:
    stamps = [round(s * 1e9) for s in stamps_s]
    probe = Probe(t_ns=0, trainer_cpu_s=0.0, workers_cpu_s=0.0, daemon_cpu_s=0.0)
    return LoopResult(
        contender=WEIGHTS, job=job, batch_size=batch, warmup_batches=warmup, stamps_ns=stamps,
        start=Probe(**{**probe.__dict__, "t_ns": stamps[warmup - 1]}),
        end=Probe(**{**probe.__dict__, "t_ns": stamps[-1]}),
        first_batch_s=0.0, trainer_peak_rss_mb=0.0, workers_peak_rss_mb=0.0,
        daemon_peak_rss_mb=0.0, checksum=0.0,
    )  # fmt: skip


def _light_heavy(heavy_every_s: float) -> tuple[LoopResult, LoopResult]:
    """The light job: a batch every second from t=1 to 21, its first warming up; the heavy job
    a batch every ``heavy_every_s`` from then on, three times as many, two warming up."""
    light = _loop(0, [1.0 + i for i in range(21)])
    heavy = _loop(1, [heavy_every_s * (i + 1) for i in range(63)], warmup=2)
    return light, heavy


def test_rates_over_the_common_window_give_the_weights_ratio() -> None:
    light, heavy = _light_heavy(1 / 3)
    measured = weighted_metrics([light, heavy], [1.0, 3.0], [7, 8], [])
    assert measured is not None
    # Common window: from the light job's warm-up (t=1; the heavy job's ended at t=2/3) to
    # both jobs' last batch (t=21).
    assert measured["window_s"] == pytest.approx(20.0)
    assert measured["rates"] == pytest.approx([10.0, 30.0])
    assert measured["ratio"] == pytest.approx(3.0)
    assert measured["error"] == pytest.approx(0.0)
    assert measured["queues"] == [None, None]  # no readings


def test_a_heavy_job_that_gets_too_little_is_measured_in_the_common_window_too() -> None:
    # Only twice the light job's rate: the heavy job runs on long after the light job ends,
    # but the rates are taken only while both ran (window_rates would take the union window).
    light, heavy = _light_heavy(1 / 2)
    measured = weighted_metrics([light, heavy], [1.0, 3.0], [7, 8], [])
    assert measured is not None
    assert measured["window_s"] == pytest.approx(20.0)
    assert measured["ratio"] == pytest.approx(2.0)
    assert measured["error"] == pytest.approx(-1 / 3)


def test_no_weighted_figures_for_equal_weights_or_without_a_common_window() -> None:
    light, heavy = _light_heavy(1 / 3)
    assert weighted_metrics([light, heavy], [1.0, 1.0], [7, 8], []) is None
    early, late = _loop(0, [1.0, 2.0, 3.0]), _loop(1, [4.0, 5.0, 6.0])
    assert weighted_metrics([early, late], [1.0, 3.0], [7, 8], []) is None


def test_the_weight_target_holds_the_ratio_within_ten_percent_of_3() -> None:
    def values(*ratios: float) -> dict[str, dict[int, dict[str, float | None]]]:
        return {"weights-x2": {r: {"weight_ratio": ratio} for r, ratio in enumerate(ratios)}}

    met = weight_target(values(3.2, 2.9, 3.25), LABELS)
    assert met["name"] == TARGET
    assert met["goal"] == "3.0x ± 10% (2.70-3.30x)"
    assert met["measured"]["median"] == pytest.approx(3.2)
    assert met["met"] is True and met["unit"] == "times"
    assert weight_target(values(2.6, 2.65), LABELS)["met"] is False
    assert weight_target(values(3.4), LABELS)["met"] is False
    assert weight_target(values(1.0, 3.0, 3.1), LABELS)["met"] is True  # the median
    unmeasured = weight_target({}, LABELS)
    assert unmeasured["met"] is None and unmeasured["measured"] is None


def _outcome(repeat: int, heavy_every_s: float) -> Outcome:
    light, heavy = _light_heavy(heavy_every_s)
    queues = [
        {"t_ns": round(t * 1e9), "jobs": [{"job_id": 7, "queued": 2}, {"job_id": 8, "queued": 1}]}
        for t in (2.0, 5.0, 9.0)
    ]
    # Each job iterates 3 epochs (the light job's of 7 batches, the heavy job's of 21), each
    # mapping 1 slab.
    results = [
        {
            "loop": loop.to_dict(),
            "weight": weight,
            "handles": {
                "job_id": job_id,
                "slabs_opened": [1] * epochs,
                "events_opened": [0] * epochs,
            },
        }
        for loop, weight, job_id, epochs in ((light, 1.0, 7, 3), (heavy, 3.0, 8, 3))
    ]
    return Outcome(WEIGHTS, 2, repeat, results=results, queues=queues)


def test_the_summary_and_the_report_show_the_weighted_run() -> None:
    summary = summarize([_outcome(0, 1 / 3), _outcome(1, 1 / 2)])
    (row,) = summary["rows"]
    weighted = row["weighted"]
    assert weighted["weights"] == [1.0, 3.0]
    assert (weighted["ratio"]["min"], weighted["ratio"]["max"]) == pytest.approx((2.0, 3.0))
    assert weighted["ratio"]["median"] == pytest.approx(2.5)
    assert weighted["error"]["median"] == pytest.approx(2.5 / 3 - 1)
    assert weighted["queued"][0]["median"] == 2 and weighted["backlogged"][1]["median"] == 1.0
    assert [run["repeat"] for run in row["weighted_per_run"]] == [0, 1]
    assert row["handles_per_run"][0]["opens_per_epoch"] == [2, 0, 0]
    (target,) = [t for t in summary["targets"] if t["name"] == TARGET]
    assert target["met"] is False  # 2.5 < 2.7
    assert f"| {TARGET} | 3.0x ± 10% (2.70-3.30x) | 2.50 [2.00-3.00]x | **no** |" in "\n".join(
        targets_table(summary)
    )
    table = "\n".join(weighted_markdown({"summary": summary}))
    assert "| dalid (shared), weights 1 and 3, 2 jobs | 35 [30-40] |" in table
    assert "| 1: 10 [10-10] / 3: 25 [20-30] | 2.50 [2.00-3.00]x | -16.7% [-33.3 to +0.0%] |" in (
        table
    )
    assert "| 1: 2.0 [2.0-2.0] / 3: 1.0 [1.0-1.0] | 1: 100 [100-100]% / 3: 100 [100-100]% |" in (
        table
    )


def test_the_weighted_run_is_not_a_row_of_the_contenders_table() -> None:
    summary = summarize([_outcome(0, 1 / 3)])
    report: dict[str, Any] = {
        "created_utc": "2026-11-25T18:00:00Z",
        "command": "python -m bench --only weights",
        "elapsed_s": 60.0,
        "settings": {**Settings().describe(), "scaling_jobs": []},
        "machine": {
            "cpu_model": "test", "usable_cpus": 2, "memory_gib": 1, "gpus": [], "git": {},
            "packages": dict.fromkeys(
                ("python", "dali", "torch", "pyzmq", "libzmq", "msgpack", "numpy"), "0"
            ),
        },
        "dataset": {"images": 512, "classes": 8, "mean_kb": 100.0},
        "foreign_cores": 0.0,
        "summary": summary,
    }  # fmt: skip
    text = markdown(report)
    assert "| contender | samples/s | per job |" not in text
    assert "Weights: two jobs through one dalid daemon" in text
    assert f"| {TARGET} |" in text
