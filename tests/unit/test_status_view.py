"""`dalid status` as a table: whatever the terminal's width, lines fit and headers stay whole."""

from __future__ import annotations

import dataclasses
import io

import pytest
from rich.console import Console

from dalid.protocol import JobStatus, PipelineStatus, StatusReport
from dalid.server.operations.status_view import COLUMNS, job_row, pipeline_lines, table

JOB = JobStatus(
    job_id=12, name="resnet50-imagenet-run-7", pid=4123456, weight=2, workers=8, pipelines=1,
    batches_done=1000, samples_done=64000, batches_failed=0, batches_per_second=12.5,
    samples_per_second=800, queued=3, running=2, waiting=4, deferred=0, max_inflight_batches=16,
    slot_wait_seconds=12.5, passed_over=3, run_seconds=1234.5, trainer_wait_seconds=3.2,
    regions_held=12, bytes_held=3 << 30, slabs=16, memory_bytes=1 << 30, connected_seconds=100,
)  # fmt: skip
SHARED = PipelineStatus(
    pipeline=1, name="imagenet_train", shared=True, jobs=(12, 13), run_size=1024, threads=16,
    runs=5320, samples=4800000, mean_fill=0.88, mixed_runs=5100,
)  # fmt: skip
OWN = PipelineStatus(
    pipeline=2, name="mosaic", shared=False, jobs=(13,), run_size=256, threads=4, runs=10,
    samples=2560, mean_fill=1.0, mixed_runs=0,
    private_reason="operator PermuteBatch is not known to work sample by sample",
)  # fmt: skip
REPORT = StatusReport(
    daemon_pid=4123000, device="gpu0", device_uuid="", dali_version="2.4.0", protocol_version=4,
    uptime_seconds=3700, max_jobs=64, concurrency=16, memory_limit=64 << 30,
    memory_reserved=8 << 30, jobs=(JOB, dataclasses.replace(JOB, job_id=13, name="eval")),
    pipelines=(SHARED, OWN),
)  # fmt: skip
WHERE = "ipc:///run/user/1000/dalid/gpu0.sock"


def _render(width: int) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(table(REPORT, WHERE, width))
    return console.export_text().splitlines()


@pytest.mark.parametrize("width", [80, 100, 120])
def test_narrow_terminals_get_whole_headers_and_lines_that_fit(width: int) -> None:
    lines = _render(width)
    assert all(len(line) <= width for line in lines), "\n".join(lines)
    header = next(line for line in lines if line.startswith("job "))
    shown = [column.header for column in COLUMNS if f" {column.header}" in f" {header}"]
    # The essentials stay, each header whole; the rest is named below the table.
    for essential in ("job", "name", "pid", "samples/s", "queue", "data wait", "held", "memory"):
        assert essential in shown, header
    assert "…" not in header
    rows = [line for line in lines if line.lstrip().startswith(("12 ", "13 "))]
    assert len(rows) == 2 and all(" 4123456 " in row for row in rows)
    hidden = [column.header for column in COLUMNS if column.header not in shown]
    if hidden:
        assert any(line.startswith("not shown:") for line in lines)


def test_a_wide_terminal_shows_every_column_and_whole_names() -> None:
    lines = _render(200)
    header = next(line for line in lines if line.startswith("job "))
    for column in COLUMNS:
        assert column.header in header
    assert any("resnet50-imagenet-run-7" in line for line in lines)
    assert not any(line.startswith("not shown") for line in lines)


def test_pipelines_show_which_jobs_share_them_and_how_full_their_runs_are() -> None:
    lines = _render(200)
    shared = next(line for line in lines if line.startswith("DALI pipeline 1 "))
    assert (
        "shared by jobs 12,13: 5100 of 5320 runs mixed their batches; runs of up to 1024 "
        "samples, 88% full on average"
    ) in shared
    own = next(line for line in lines if line.startswith("DALI pipeline 2 "))
    assert "job 13 alone, not shared: " in own and "PermuteBatch" in own
    narrow = _render(80)
    assert all(len(line) <= 80 for line in narrow)
    assert any("88% full" in line for line in narrow)


def test_a_pipeline_line_says_on_how_many_instances_and_why() -> None:
    reason = (
        "2 DALI instances: going from 1 to 2 raised 8,100 to 11,900 samples/s; CPU 1.9 of 2 "
        "cores busy"
    )
    report = dataclasses.replace(
        REPORT,
        pipelines=(dataclasses.replace(SHARED, instances=2, instances_reason=reason), OWN),
    )
    shared, own = pipeline_lines(report, width=400)
    assert shared.endswith(f"88% full on average; {reason}")
    assert "instance" not in own


def test_private_copies_say_how_many_stayed_on_the_device() -> None:
    # A trainer that keeps its GPU outputs gets private copies; those left on the device cost
    # no host copy, and the table tells the two apart.
    kept = dataclasses.replace(JOB, job_id=14, batches_copied=9, batches_copied_on_device=7)
    host = dataclasses.replace(JOB, job_id=15, batches_copied=3)
    report = dataclasses.replace(REPORT, jobs=(kept, host))
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(table(report, WHERE, 200))
    lines = console.export_text().splitlines()
    row = {line.split()[0]: line for line in lines if line.lstrip().startswith(("14 ", "15 "))}
    assert " 9 (7 dev) " in row["14"]
    assert " 3 " in row["15"] and "dev" not in row["15"]


def _workers_cell(job: JobStatus) -> str:
    """The workers column of ``job``'s row."""
    return job_row(job)[[column.header for column in COLUMNS].index("workers")]


def test_workers_started_show_from_the_first_snapshot_and_those_joined_where_they_differ() -> None:
    # A new job's loader started 2 workers, which connect at their first sample: the table
    # says 2, and how many have connected so far, not "0".
    starting = dataclasses.replace(JOB, job_id=14, workers=0, workers_started=2)
    assert _workers_cell(starting) == "2 (0 joined)"
    assert _workers_cell(dataclasses.replace(starting, workers=1)) == "2 (1 joined)"
    # All connected: the figure alone, as for a trainer that does not say (an older client).
    assert _workers_cell(dataclasses.replace(starting, workers=2)) == "2"
    assert _workers_cell(dataclasses.replace(starting, workers=3, workers_started=None)) == "3"
    # Workers of a loader that is not dalid's connect uncounted: more joined than started.
    assert _workers_cell(dataclasses.replace(starting, workers=3)) == "2 (3 joined)"
    # An epoch's workers stopped, the next epoch's not yet started.
    assert _workers_cell(dataclasses.replace(starting, workers_started=0)) == "0"
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(table(dataclasses.replace(REPORT, jobs=(starting,)), WHERE, 200))
    (row,) = [line for line in console.export_text().splitlines() if line.startswith(" 14 ")]
    assert "  2 (0 joined)  " in row


def test_a_pipeline_one_job_uses_says_so_and_shows_no_run_fill() -> None:
    # Alone, a job's runs are its own batches: "jobs 1 share it, 25% full" read as a fault.
    alone = dataclasses.replace(SHARED, jobs=(12,), mean_fill=0.25, mixed_runs=0)
    (line,) = pipeline_lines(dataclasses.replace(REPORT, pipelines=(alone,)), width=400)
    assert line == (
        "DALI pipeline 1 imagenet_train: job 12 alone for now (a job that registers it too "
        "shares it)"
    )
    assert "full" not in line and "share it;" not in line


def test_a_pipeline_no_job_uses_says_so() -> None:
    idle = dataclasses.replace(SHARED, jobs=())
    (line,) = pipeline_lines(dataclasses.replace(REPORT, pipelines=(idle,)), width=400)
    assert line == "DALI pipeline 1 imagenet_train: no job uses it now"


def test_a_job_without_a_name_shows_its_pid_once() -> None:
    unnamed = dataclasses.replace(JOB, job_id=14, name="pid 4123456")
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(table(dataclasses.replace(REPORT, jobs=(unnamed,)), WHERE, 200))
    (row,) = [line for line in console.export_text().splitlines() if line.startswith(" 14 ")]
    assert row.split()[:3] == ["14", "-", "4123456"]
    assert row.count("4123456") == 1


def test_the_instance_controllers_reasons_read_as_words() -> None:
    from dalid.server.runs.instances import Change, InstanceController, Load

    controller = InstanceController(max_instances=2, period_s=1.0, settle_s=0.0)
    assert controller.reason == "1 DALI instance: measuring whether another would help"
    busy = Load(samples=0, waiting=True, cpu_busy=1.0, cores=2)
    change = None
    for tick in range(40):
        load = dataclasses.replace(busy, samples=tick * 100)
        change = controller.observe(tick * 0.1, 1, load)
        if change is not None:
            break
    assert change is Change.ADD
    assert controller.reason.startswith("trying 2 DALI instances: batches waited at ")
    assert "->" not in controller.reason


def test_status_help_is_a_short_table_of_columns() -> None:
    from dalid.server.operations.status_view import legend

    lines = legend().splitlines()
    assert lines[0] == "Columns:"
    rows = lines[1 : 1 + len(COLUMNS)]
    for column, row in zip(COLUMNS, rows, strict=True):
        assert row.startswith(f"  {column.header}:")
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
