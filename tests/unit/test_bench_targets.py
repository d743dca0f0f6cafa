"""The bench's targets: which rows each compares, met or not from the medians, or not measured."""

from __future__ import annotations

import threading
import time
import types
from typing import Any

import pytest

from bench import threads, threads_report
from bench.contenders import CONTENDERS
from bench.report import targets_table
from bench.stats import spread
from bench.targets import (
    all_targets,
    daemon_thread_targets,
    paired_ratio,
    row_id,
    row_kind,
    sharing_targets,
)
from bench.threads import DAEMON_THREAD_FIGURES, figures, window

LABELS = {kind: contender.label for kind, contender in CONTENDERS.items()}


def _run(
    rate: float, pss: float | None = None, peak: float | None = None, fair: float = 1.0
) -> dict[str, float | None]:
    return {"samples_per_s": rate, "fairness": fair, "all_pss_mb": pss,
            "daemon_peak_rss_mb": peak}  # fmt: skip


def _by_name(targets: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {target["name"]: target for target in targets}


def test_row_ids_and_their_contenders() -> None:
    assert row_id("dalid", 1) == "dalid"
    assert row_id("dalid-private", 8) == "dalid-private-x8"
    assert row_kind("dalid-private-x8") == "dalid-private"
    assert row_kind("dalid-private") == "dalid-private"
    assert row_kind("dali-x2") == "dali"


def test_ratios_pair_runs_by_repeat() -> None:
    values = {
        "dalid-x2": {0: _run(100.0), 1: _run(90.0), 2: _run(80.0)},
        "dali-x2": {0: _run(100.0), 1: _run(100.0)},  # repeat 2 failed
    }
    ratio = paired_ratio(values, "dalid-x2", "dali-x2", "samples_per_s")
    assert ratio["n"] == 2
    assert ratio["median"] == pytest.approx(0.95)
    assert (ratio["min"], ratio["max"]) == pytest.approx((0.9, 1.0))
    assert paired_ratio(values, "dalid-x2", "dali-x2", "all_pss_mb")["n"] == 0  # unread


def _full_run() -> dict[str, dict[int, dict[str, float | None]]]:
    values: dict[str, dict[int, dict[str, float | None]]] = {
        "dalid": {0: _run(500.0, pss=600, peak=400)},
        "dali": {0: _run(550.0, pss=500)},
    }
    for jobs, shared_rate in ((2, 600.0), (4, 560.0), (8, 590.0)):
        values[f"dali-x{jobs}"] = {0: _run(580.0, pss=380.0 * jobs, fair=0.999)}
        values[f"dalid-x{jobs}"] = {0: _run(shared_rate, pss=1700.0, peak=560.0, fair=0.995)}
    values["dalid-x8"][0]["fairness"] = 0.98
    return values


def test_the_sharing_targets_from_a_run_of_every_job_count() -> None:
    targets = _by_name(sharing_targets(_full_run(), LABELS))
    throughput = {
        jobs: targets[f"dalid (shared), {jobs} jobs: samples/s / DALI in-process, {jobs} jobs"]
        for jobs in (2, 4, 8)
    }
    assert throughput[2]["measured"]["median"] == pytest.approx(600 / 580)
    assert [throughput[jobs]["met"] for jobs in (2, 4, 8)] == [True, False, True]
    assert throughput[2]["goal"] == ">= 100%" and throughput[2]["unit"] == "ratio"
    pss = targets["dalid (shared), 8 jobs: all processes' PSS / DALI in-process, 8 jobs"]
    assert pss["measured"]["median"] == pytest.approx(1700 / 3040)
    assert pss["met"] is True and pss["goal"] == "<= 60%"
    daemon = targets["dalid (shared): the daemon's peak RSS with 8 jobs / with 1 job"]
    assert daemon["measured"]["median"] == pytest.approx(1.4)
    assert daemon["met"] is True and daemon["unit"] == "times"
    fairness = [
        targets[f"dalid (shared), {n} jobs of equal weight: Jain's fairness"] for n in (2, 4, 8)
    ]
    assert [f["met"] for f in fairness] == [True, True, False]
    assert fairness[2]["measured"]["median"] == pytest.approx(0.98)


def test_a_target_over_the_limit_is_not_met() -> None:
    values = _full_run()
    values["dalid-x8"][0]["all_pss_mb"] = 0.61 * 3040
    values["dalid-x8"][0]["daemon_peak_rss_mb"] = 601.0
    targets = _by_name(sharing_targets(values, LABELS))
    assert (
        targets["dalid (shared), 8 jobs: all processes' PSS / DALI in-process, 8 jobs"]["met"]
        is False
    )
    assert targets["dalid (shared): the daemon's peak RSS with 8 jobs / with 1 job"]["met"] is False


def test_targets_of_job_counts_not_run_are_not_measured_not_met() -> None:
    values = _full_run()
    for row in ("dali-x8", "dalid-x8"):
        del values[row]  # a quick run: 1, 2 and 4 jobs
    targets = sharing_targets(values, LABELS)
    eight = [target for target in targets if "8 jobs" in target["name"]]
    assert len(eight) == 4  # throughput, PSS, daemon growth, fairness
    assert all(t["met"] is None and t["measured"] is None for t in eight)
    (weights,) = [target for target in targets if "weights 1 and 3" in target["name"]]
    assert weights["met"] is None and weights["measured"] is None  # the weighted run did not run
    assert all(t["met"] is not None for t in targets if t not in [*eight, weights])


def test_the_sharing_targets_appear_when_any_of_their_contenders_ran() -> None:
    transport: dict[str, Any] = {}
    assert all_targets({"torch-pil": {0: _run(400.0)}}, transport, LABELS) == []
    only_two = all_targets({"dali-x2": {0: _run(500.0)}}, transport, LABELS)
    assert len(only_two) == 9 and all(t["met"] is None for t in only_two)
    headline = all_targets(_full_run(), transport, LABELS)[0]
    assert headline["name"] == "dalid (shared), 1 job: samples/s / DALI in-process, 1 job"
    assert headline["met"] is False  # 500 / 550 < 95%


def test_the_targets_table_says_not_measured() -> None:
    values = _full_run()
    del values["dalid-x8"]
    lines = targets_table({"targets": all_targets(values, {}, LABELS)})
    table = "\n".join(lines)
    assert (
        "| dalid (shared), 8 jobs of equal weight: Jain's fairness | >= 0.99 | n/a | not measured |"
        in table
    )
    assert (
        "| dalid (shared), 2 jobs: samples/s / DALI in-process, 2 jobs | >= 100% | 103.4% | yes |"
        in table
    )
    assert (
        "| dalid (shared), 4 jobs of equal weight: Jain's fairness | >= 0.99 | 0.995 | yes |"
        in table
    )
    assert (
        "| dalid (shared), 4 jobs: samples/s / DALI in-process, 4 jobs | >= 100% | 96.6% | **no** |"
        in table
    )


def test_one_job_targets_against_in_process_and_the_proxy() -> None:
    values: dict[str, dict[int, dict[str, float | None]]] = {
        "dalid": {0: {"samples_per_s": 560.0, "cpu_ms_per_sample": 3.4},
                  1: {"samples_per_s": 540.0, "cpu_ms_per_sample": 3.6}},
        "dali": {0: {"samples_per_s": 570.0, "cpu_ms_per_sample": 3.3},
                 1: {"samples_per_s": 550.0, "cpu_ms_per_sample": 3.3}},
        "dali-proxy": {0: {"samples_per_s": 580.0}, 1: {"samples_per_s": 545.0}},
    }  # fmt: skip
    targets = _by_name(all_targets(values, {}, LABELS))
    inprocess = targets["dalid (shared), 1 job: samples/s / DALI in-process, 1 job"]
    assert inprocess["goal"] == ">= 97%"
    assert inprocess["measured"]["median"] == pytest.approx((560 / 570 + 540 / 550) / 2)
    assert inprocess["met"] is True
    proxy = targets["dalid (shared), 1 job: samples/s / DALI proxy, 1 job"]
    assert proxy["measured"]["median"] == pytest.approx((560 / 580 + 540 / 545) / 2)
    assert proxy["met"] is False and proxy["goal"] == ">= 100%"
    cpu = targets["dalid (shared), 1 job: all processes' CPU per sample / DALI in-process, 1 job"]
    assert cpu["measured"]["median"] == pytest.approx((3.4 / 3.3 + 3.6 / 3.3) / 2)
    assert cpu["met"] is False and cpu["unit"] == "times"
    on_gpu = _by_name(all_targets(values, {}, LABELS, gpu=True))
    assert on_gpu["dalid (shared), 1 job: samples/s / DALI in-process, 1 job"]["goal"] == ">= 98%"


def test_transport_targets_are_ratios_to_the_floors_of_the_same_run() -> None:
    def run(b1: float, echo: float, b32: float, pipe_run: float) -> dict[str, Any]:
        return {
            "dalid_b1": {"p50": b1, "p99": 3 * b1},
            "zmq_echo": {"p50": echo, "p99": echo},
            "dalid_b32": {"p50": b32, "p99": b32},
            "dali_b32": {"p50": pipe_run, "p99": pipe_run},
        }

    transport = {"runs": [run(400.0, 200.0, 900.0, 700.0), run(500.0, 200.0, 1200.0, 700.0)]}
    targets = _by_name(all_targets({}, transport, LABELS))
    p50 = targets["transport: submit -> ready, 1 tiny sample, p50 / the ZeroMQ echo, p50"]
    assert p50["measured"]["median"] == pytest.approx(2.25)
    assert p50["met"] is False and p50["goal"] == "<= 2.0x"
    p99 = targets["transport: submit -> ready, 1 tiny sample, p99 / the ZeroMQ echo, p99"]
    assert p99["met"] is False  # 6x and 7.5x
    b32 = targets["transport: submit -> ready, 32 tiny samples, p50 / DALI's pipe.run, p50"]
    assert b32["measured"]["median"] == pytest.approx((900 / 700 + 1200 / 700) / 2)
    assert b32["met"] is True
    assert all_targets({}, {"runs": []}, LABELS) == []


def test_the_daemons_own_threads_are_held_per_sample_and_per_message() -> None:
    """bench.threads' totals become per-sample and per-message figures, and the targets hold
    the dalid rows to them: the output copies are shown apart and left out of the target."""
    snapshots = [
        {"t_ns": t, "io_loop_cpu_s": 0.001 * k, "messages": 5 * k, "message_wall_s": 0.0015 * k,
         "message_cpu_s": 0.001 * k, "by_op": {"submit_batch": [k, 0.0001 * k]},
         "executor_cpu_s": 0.25 * k, "copy_out_cpu_s": 0.248 * k, "dali_calls_cpu_s": 0.001 * k,
         "executor_samples": 500 * k}
        for k, t in enumerate([0, 10, 20, 30, 40])
    ]  # fmt: skip
    # The window's start and end fall between snapshots: the ones around them are taken.
    used = window(snapshots, 15, 25)
    assert used["seconds"] == pytest.approx(20e-9) and used["by_op"]["submit_batch"][0] == 2
    assert window(snapshots, -1, 25) == {} and window(snapshots[:1], 0, 5) == {}
    one = figures(used)
    assert one["daemon_own_us_per_sample"] == pytest.approx(6.0)
    assert one["daemon_all_us_per_sample"] == pytest.approx(502.0)
    assert one["copy_out_us_per_sample"] == pytest.approx(496.0)
    assert one["dali_calls_us_per_sample"] == pytest.approx(2.0)
    assert one["io_messages_us_per_sample"] == pytest.approx(2.0)
    assert one["io_chores_ms_per_s"] == pytest.approx(0.0)
    assert one["io_cpu_us_per_message"] == pytest.approx(200.0)
    assert one["io_wall_over_cpu"] == pytest.approx(1.5)
    assert figures({}) == dict.fromkeys(DAEMON_THREAD_FIGURES)
    eight = {**one, "daemon_own_us_per_sample": 4.0, "io_wall_over_cpu": 2.5}
    values = {"dalid": {0: one}, "dalid-x8": {0: eight}}
    one["batches_copied"] = 0
    eight["batches_copied"] = 3
    found = _by_name(daemon_thread_targets(values, LABELS))
    assert len(found) == 5
    single, many, copied_one, copied_eight, wall = found.values()
    assert copied_one["met"] is True and copied_eight["met"] is False
    assert single["met"] is False and single["measured"]["median"] == pytest.approx(6.0)
    assert many["met"] is True and "8 jobs" in many["name"]
    assert wall["met"] is False and wall["unit"] == "times"
    assert "not measured" not in "".join(targets_table({"targets": list(found.values())}))
    assert daemon_thread_targets({"dali": {0: one}}, LABELS) == []
    # At another batch the figure is shown under its batch, and its goal (set at 256) is not
    # judged: most of it is per batch. The copies and the I/O thread's wait still are.
    small = _by_name(daemon_thread_targets(values, LABELS, batch_size=32))
    single, many, copied_one, copied_eight, wall = small.values()
    assert "batch 32," in single["name"] and "batch 256" not in single["name"]
    assert single["met"] is None and many["met"] is None
    assert single["measured"]["median"] == pytest.approx(6.0)
    assert copied_eight["met"] is False and wall["met"] is False
    table = "".join(targets_table({"targets": list(small.values())}))
    assert table.count("n/a: goal set at batch 256") == 2 and "not measured" not in table


def test_a_snapshot_counts_a_copy_under_way_up_to_its_moment() -> None:
    """An output copy is counted as it runs, as the executor's clock is: a window never holds
    more copying than executor time (a copy counted only at its end did, by a whole batch's)."""
    totals = threads._Totals()
    ident = threading.get_ident()
    totals.executors[ident] = types.SimpleNamespace(samples=0, runs=0)
    totals.copying[ident] = time.thread_time()
    spent = time.thread_time() + 0.02
    while time.thread_time() < spent:
        pass
    snapshot = totals.snapshot()
    assert snapshot["copy_out_cpu_s"] >= 0.02
    assert snapshot["executor_cpu_s"] >= snapshot["copy_out_cpu_s"]


def test_heap_trims_after_departures_are_the_jobs_ends_not_the_loops_chores() -> None:
    used = {"seconds": 10.0, "io_loop_cpu_s": 0.5, "messages": 10, "message_cpu_s": 0.1,
            "message_wall_s": 0.1, "by_op": {"goodbye": [1, 0.05, 0.05]},
            "departure_trim_cpu_s": 0.3, "executor_cpu_s": 0.0, "copy_out_cpu_s": 0.0,
            "executor_samples": 1000}  # fmt: skip
    found = figures(used)
    assert found["io_lifecycle_ms"] == pytest.approx(350.0)
    # The loop's own: 0.5 s less the goodbye and the trim, less the messages' 0.05 s.
    assert found["io_chores_ms_per_s"] == pytest.approx(10.0)
    assert found["io_messages_us_per_sample"] == pytest.approx(50.0)


def test_the_cohort_targets_compare_a_cohort_with_as_many_in_process_jobs() -> None:
    from bench.summary import cohort_hit_rate

    values: dict[str, dict[int, dict[str, float | None]]] = {
        "dali-x4": {0: _run(300.0, pss=4000.0)},
        "dalid-cohort-x4": {
            0: {**_run(1000.0, pss=2000.0), "hit_rate": 0.74, "members_per_job": 250.0}
        },
        "dalid-cohort-trailing-x4": {0: {**_run(800.0), "members_per_job": 200.0}},
    }
    found = _by_name(all_targets(values, {}, LABELS))
    name = f"{LABELS['dalid-cohort']}, 4 jobs: samples/s / {LABELS['dali']}, 4 jobs"
    assert found[name]["met"] is True and found[name]["measured"]["median"] == pytest.approx(10 / 3)
    pss = found[f"{LABELS['dalid-cohort']}, 4 jobs: all processes' PSS / {LABELS['dali']}, 4 jobs"]
    assert pss["met"] is True
    hits = found[f"{LABELS['dalid-cohort']}, 4 jobs: batches served from another job's run"]
    assert hits["met"] is True  # 0.74 of the ideal 0.75, at least 90% of it
    trailing = found[
        f"{LABELS['dalid-cohort-trailing']}, 4 jobs: samples/s per job of the others / "
        f"{LABELS['dalid-cohort']}, 4 jobs"
    ]
    assert trailing["met"] is False and trailing["measured"]["median"] == pytest.approx(0.8)
    on_gpu = _by_name(all_targets(values, {}, LABELS, gpu=True))
    eight = f"{LABELS['dalid-cohort']}, 8 jobs: samples/s / {LABELS['dali']}, 8 jobs"
    assert on_gpu[eight]["met"] is None  # 8 jobs did not run
    readings: list[dict[str, Any]] = [{"cohorts": []}, {"cohorts": [{"hit_rate": 0.5}]}]
    assert cohort_hit_rate(readings) == 0.5 and cohort_hit_rate([]) is None


def test_how_well_the_dali_threads_were_fed_over_a_window() -> None:
    """Run fullness, the executors' waits and DALI's workers asleep or waiting for a core come
    from the snapshots' scheduler figures, by thread, over the threads alive at both ends."""

    def snapshot(t_ns: int, k: int, threads: dict[str, list[Any]]) -> dict[str, Any]:
        return {
            "t_ns": t_ns,
            "by_op": {},
            "executor_samples": 100 * k,
            "executor_runs": k,
            "next_run_wall_s": 0.1 * k,
            "collect_wall_s": 0.5 * k,
            "sched_by_thread": threads,
        }

    second = 1_000_000_000
    snapshots = [
        snapshot(0, 0, {"7": ["[DALI][TP0]Exec", 1.0, 1.0], "8": ["[DALI][TP1]Exec", 1.0, 1.0]}),
        # A pipeline built inside the window (thread 9) is left out: it has no start.
        snapshot(
            second,
            4,
            {
                "7": ["[DALI][TP0]Exec", 1.6, 1.3],
                "8": ["[DALI][TP1]Exec", 1.5, 1.3],
                "9": ["[DALI][TP0]Exec", 0.5, 0.0],
            },
        ),
        # After the window the pipeline's threads are gone: its last snapshot inside counts.
        snapshot(2 * second, 5, {}),
    ]
    used = window(snapshots, 0, 3 * second // 2)
    assert used["seconds"] == pytest.approx(2.0) and used["sched_seconds"] == pytest.approx(1.0)
    assert used["sched_by_thread_name"]["[DALI][TP0]Exec"] == pytest.approx([1, 0.6, 0.3])
    found = figures(used)
    assert found["samples_per_run"] == pytest.approx(100.0)
    assert found["executors_waiting_for_batches"] == pytest.approx(0.25)
    assert found["executors_waiting_for_dali"] == pytest.approx(1.25)
    assert found["dali_workers_waiting_for_a_core"] == pytest.approx(0.3)
    assert found["dali_workers_asleep"] == pytest.approx(0.15)


def test_the_scheduler_figures_of_this_process_threads() -> None:
    """Each live thread's time on a CPU and waiting for one, read from the kernel: a thread
    that sleeps gains neither, one that spins gains CPU."""
    before = threads._sched_by_thread()
    spent = time.thread_time() + 0.02
    while time.thread_time() < spent:
        pass
    after = threads._sched_by_thread()
    me = str(threading.get_native_id())
    assert after[me][1] - before[me][1] >= 0.02
    assert all(cpu >= 0 and wait >= 0 for _, cpu, wait in after.values())


def test_what_the_io_threads_messages_waited_for_per_message() -> None:
    """The I/O thread's wait a message (wall less CPU), its blocks and preemptions inside
    messages, its time without a core, and the messages a run, over a window; the report's
    table of the daemon's threads shows them per dalid row."""
    snapshots = [
        {"t_ns": t, "io_loop_cpu_s": 0.004 * k, "messages": 4 * k, "message_wall_s": 0.003 * k,
         "message_cpu_s": 0.001 * k, "message_blocks": 2 * k, "message_preemptions": k,
         "message_core_wait_s": 0.0005 * k, "io_run_delay_s": 0.0008 * k, "io_wakes": 30 * k,
         "reap_cpu_s": 0.0001 * k,
         "by_op": {"submit_batch": [k, 0.0001 * k, 0.0002 * k]},
         "executor_cpu_s": 0.01 * k, "copy_out_cpu_s": 0.0, "executor_samples": 256 * k,
         "forming_cpu_s": 0.001 * k,
         "executor_runs": k}
        for k, t in enumerate([0, 10, 20])
    ]  # fmt: skip
    used = window(snapshots, 0, 20)
    found = figures(used)
    assert found["io_wait_us_per_message"] == pytest.approx(500.0)  # 6 ms less 2, 8 messages
    assert found["io_core_wait_us_per_message"] == pytest.approx(125.0)
    assert found["io_blocks_per_message"] == pytest.approx(0.5)
    assert found["io_preemptions_per_message"] == pytest.approx(0.25)
    assert found["io_run_delay_us_per_message"] == pytest.approx(200.0)
    assert found["messages_per_run"] == pytest.approx(4.0)
    assert found["forming_us_per_sample"] == pytest.approx(1e6 * 0.002 / 512)
    assert found["io_wakes_per_s"] == pytest.approx(60 / 20e-9)
    assert found["io_reap_ms_per_s"] == pytest.approx(0.2 / 20e-9)
    # An older daemon's snapshots without the switch counts: those figures are not made up.
    new = ("message_b", "message_p", "message_core", "io_run", "io_wakes", "reap", "forming")
    bare = [{k: v for k, v in s.items() if not k.startswith(new)}
            for s in snapshots]  # fmt: skip
    old = figures(window(bare, 0, 20))
    assert old["io_blocks_per_message"] is None and old["io_run_delay_us_per_message"] is None
    assert old["io_wakes_per_s"] is None and old["io_reap_ms_per_s"] is None
    assert old["forming_us_per_sample"] is None and old["io_core_wait_us_per_message"] is None
    assert old["io_wait_us_per_message"] == pytest.approx(500.0)
    row = {
        "label": "dalid (shared), 8 jobs",
        "daemon_threads": {name: spread([v]) for name, v in found.items() if v is not None},
        "background_cores": spread([2.0]),
        "foreign_cores": spread([0.05]),
    }
    table = threads_report.markdown([row, {"label": "DALI in-process", "daemon_threads": {}}])
    # No step figures in these snapshots: no table of steps.
    assert len(table) == 6 and table[2].startswith("| dalid (shared), 8 jobs |")
    assert (
        "| 500 / 125 |" in table[2]
        and "| 0.50 / 0.25 |" in table[2]
        and table[2].endswith("| 2.00 / 0.05 |")
    )
    assert threads_report.markdown([{"label": "DALI in-process", "daemon_threads": {}}]) == []


def test_a_snapshot_counts_the_io_threads_switches_and_its_time_without_a_core() -> None:
    totals = threads._Totals()
    totals.io_native_id = threading.get_native_id()
    totals.message_blocks, totals.message_preemptions = 3, 1
    before = threads._run_delay_s(totals.io_native_id)
    snapshot = totals.snapshot()
    after = threads._run_delay_s(totals.io_native_id)
    assert snapshot["message_blocks"] == 3 and snapshot["message_preemptions"] == 1
    assert snapshot["message_core_wait_s"] == 0.0
    assert threads._core_wait_ns(None) == 0
    assert before <= snapshot["io_run_delay_s"] <= after
    # The probe's own reads around each message are not the loop's.
    totals.io_cpu_done_s, totals.probe_cpu_ns = 1.0, 200_000_000
    assert totals.snapshot()["io_loop_cpu_s"] == pytest.approx(0.8)
    # Once the I/O thread's loop has ended, its last reading stands.
    totals.io_native_id, totals.io_run_delay_done_s = None, 0.5
    assert totals.snapshot()["io_run_delay_s"] == 0.5
    assert threads._run_delay_s(None) == 0.0


def test_the_io_threads_messages_by_step_and_its_outbox() -> None:
    """The I/O thread's CPU a message by step, over the messages that neither start nor end a
    job, what was between the steps, and its sends of the outbox outside messages, over a
    window; the report shows them in a table of their own."""
    steps = ("receive", "admit", "decode", "handle", "answer")
    snapshots = [
        {"t_ns": t, "io_loop_cpu_s": 0.004 * k, "messages": 5 * k, "message_wall_s": 0.003 * k,
         "message_cpu_s": 0.002 * k, "by_op": {"goodbye": [k, 0.0005 * k, 0.0005 * k]},
         "message_steps": {step: 0.0001 * (i + 1) * k for i, step in enumerate(steps)},
         "stepped_messages": 4 * k, "stepped_cpu_s": 0.0016 * k,
         "outbox_cpu_s": 0.0003 * k, "outbox_sent": 6 * k,
         "io_gc_collections": 3 * k, "io_gc_cpu_s": 0.0001 * k,
         "executor_cpu_s": 0.01 * k, "copy_out_cpu_s": 0.0, "executor_samples": 256 * k,
         "executor_runs": k}
        for k, t in enumerate([0, 10, 20])
    ]  # fmt: skip
    found = figures(window(snapshots, 0, 20))
    # 2 windows' worth: 8 stepped messages; receive 0.2 ms, ..., answer 1.0 ms; 3.2 ms in all.
    assert found["io_receive_us_per_message"] == pytest.approx(25.0)
    assert found["io_answer_us_per_message"] == pytest.approx(125.0)
    assert found["io_between_steps_us_per_message"] == pytest.approx(25.0)  # 3.2 less 3.0
    assert found["io_outbox_ms_per_s"] == pytest.approx(0.6 / 20e-9)
    assert found["io_outbox_sent_per_s"] == pytest.approx(12 / 20e-9)
    assert found["io_gc_ms_per_s"] == pytest.approx(0.2 / 20e-9)
    assert found["io_gc_per_s"] == pytest.approx(6 / 20e-9)
    old = figures(window([{k: v for k, v in s.items() if not k.startswith(("message_steps",
                  "stepped", "outbox", "io_gc"))} for s in snapshots], 0, 20))  # fmt: skip
    assert old["io_decode_us_per_message"] is None and old["io_outbox_ms_per_s"] is None
    assert old["io_between_steps_us_per_message"] is None and old["io_gc_ms_per_s"] is None
    row = {
        "label": "dalid (shared), 8 jobs",
        "daemon_threads": {name: spread([v]) for name, v in found.items() if v is not None},
    }
    table = threads_report.markdown([row])
    header = (
        "| dalid run | receive | admit | decode | handle | answer | between the steps | outbox "
        "sends, ms a second / messages a second | reap, ms a second | garbage collections, ms a "
        "second / collections a second |"
    )
    at = table.index(header)
    assert table[at + 2].startswith("| dalid (shared), 8 jobs | 25.0 | 50.0 | 75.0 | 100.0 |")
    assert threads_report.steps_markdown([{"label": "x", "daemon_threads": {}}]) == []
