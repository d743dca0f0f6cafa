"""The bench's CPU split: each process's and thread group's clocks and page faults, per sample."""

from __future__ import annotations

import os
import time
from dataclasses import asdict

import pytest

from bench.cpu_split import rows_of, table
from bench.measure import LoopResult, Probe, ProcStat, process_stat, thread_group, threads_stat


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("python", "python"),
        ("pt_data_worker3", "pt_data_worker"),
        ("dalid-exec-12", "dalid-exec"),
        ("worker:7", "worker"),
        ("1234", "1234"),  # a name that is only a number stays whole
    ],
)
def test_thread_group_drops_a_pools_number(name: str, group: str) -> None:
    assert thread_group(name) == group


def test_process_stat_sees_this_process_burn_cpu_and_fault_in_new_pages() -> None:
    before = process_stat(os.getpid())
    # Faulting in 32 MiB of fresh anonymous memory takes thousands of minor faults, in the
    # kernel's time; a busy loop of user time follows.
    block = bytearray(32 << 20)
    for offset in range(0, len(block), 4096):
        block[offset] = 1
    deadline = time.thread_time() + 0.1
    while time.thread_time() < deadline:
        pass
    used = process_stat(os.getpid()) - before
    assert used.minflt >= (32 << 20) // 4096 // 2
    assert used.user_s + used.system_s >= 0.05
    assert used.majflt >= 0


def test_threads_stat_adds_up_to_at_most_the_process() -> None:
    # Threads that ended are in the process's clock but no longer listed.
    whole = process_stat(os.getpid())
    groups = threads_stat(os.getpid())
    assert groups
    listed = sum(groups.values(), ProcStat())
    assert listed.user_s + listed.system_s <= whole.user_s + whole.system_s + 0.02
    assert listed.minflt <= whole.minflt


def test_a_gone_process_reads_as_nothing() -> None:
    assert process_stat(2**22 + 1) == ProcStat()
    assert threads_stat(2**22 + 1) == {}


def _split(**parts: ProcStat) -> dict[str, dict[str, float]]:
    return {name.replace("__", "/"): asdict(stat) for name, stat in parts.items()}


def test_rows_are_the_windows_use_per_timed_sample() -> None:
    start = Probe(
        t_ns=0, trainer_cpu_s=0.0, workers_cpu_s=0.0, daemon_cpu_s=0.0,
        split=_split(trainer=ProcStat(1.0, 0.5, 100, 0), daemon=ProcStat(2.0, 1.0, 10, 0)),
    )  # fmt: skip
    end = Probe(
        t_ns=1, trainer_cpu_s=0.0, workers_cpu_s=0.0, daemon_cpu_s=0.0,
        split=_split(
            trainer=ProcStat(1.2, 0.6, 500, 0),
            daemon=ProcStat(2.4, 1.0, 10, 0),
            daemon__exec=ProcStat(0.01, 0.0, 8, 0),  # a thread group that started in the window
        ),
    )  # fmt: skip
    # 1 warm-up batch and 4 timed batches of 25: 100 timed samples.
    loop = LoopResult(
        contender="dalid", job=0, batch_size=25, warmup_batches=1, stamps_ns=[1, 2, 3, 4, 5],
        start=start, end=end, first_batch_s=0.0, trainer_peak_rss_mb=0.0,
        workers_peak_rss_mb=0.0, daemon_peak_rss_mb=0.0, checksum=0.0,
    )  # fmt: skip
    # Through the results file's JSON, as python -m bench.cpu_split reads it.
    run = {"kind": "dalid", "jobs": 1, "repeat": 0, "results": [{"loop": loop.to_dict()}]}
    rows = {row.part: row for row in rows_of(run)}
    assert set(rows) == {"trainer", "daemon", "daemon/exec"}
    assert rows["trainer"].user_us == pytest.approx(2000.0)
    assert rows["trainer"].system_us == pytest.approx(1000.0)
    assert rows["trainer"].minflt == pytest.approx(4.0)
    assert rows["daemon"].cpu_us == pytest.approx(4000.0)
    assert rows["daemon/exec"].cpu_us == pytest.approx(100.0)
    assert rows["daemon/exec"].minflt == pytest.approx(0.08)
    shown = table(list(rows.values()), floor_us=500.0)
    assert "| daemon |" in shown
    assert "daemon/exec" not in shown  # a thread group under the floor is left out


def test_a_results_file_without_splits_gives_no_rows() -> None:
    probe = {"t_ns": 0, "trainer_cpu_s": 0.0, "workers_cpu_s": 0.0, "daemon_cpu_s": 0.0}
    loop = {
        "job": 0, "batch_size": 2, "warmup_batches": 1, "stamps_ns": [1, 2],
        "start": probe, "end": probe,
    }  # fmt: skip
    run = {"kind": "dali", "jobs": 1, "repeat": 0, "results": [{"loop": loop}]}
    assert rows_of(run) == []
