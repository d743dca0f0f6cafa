"""The report's table of the daemon's own threads (:mod:`bench.threads`), one row a dalid run.

The targets table judges two of these figures; this one shows what they are made of, side by
side across the job counts and loads of one report (``--jobs``, ``--background-load``), so that
what grows with the number of jobs can be told from what grows with a saturated machine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .table import spread_text

# (header, figure, digits): each a median [min-max] over the repeats.
COLUMNS = (
    ("own threads, µs a sample", "daemon_own_us_per_sample", 1),
    ("I/O thread, µs a sample", "io_us_per_sample", 1),
    ("of it messages", "io_messages_us_per_sample", 1),
    ("I/O chores, ms a second", "io_chores_ms_per_s", 2),
    ("I/O wakes a second / its reap, ms a second", "io_wakes_per_s", 0),
    ("", "io_reap_ms_per_s", 2),
    ("executors less copies, µs a sample", "executor_us_per_sample", 1),
    ("of it DALI's calls / forming runs", "dali_calls_us_per_sample", 1),
    ("", "forming_us_per_sample", 1),
    ("messages a run", "messages_per_run", 2),
    ("I/O CPU a message, µs", "io_cpu_us_per_message", 0),
    ("I/O wall / CPU a message", "io_wall_over_cpu", 2),
    ("I/O waited a message / of it without a core, µs", "io_wait_us_per_message", 0),
    ("", "io_core_wait_us_per_message", 0),
    ("blocks / preemptions a message", "io_blocks_per_message", 2),
    ("", "io_preemptions_per_message", 2),
    ("I/O runnable without a core, µs a message", "io_run_delay_us_per_message", 0),
)

# The I/O thread's CPU a message by step, and its loop's sends and reap outside messages.
STEP_COLUMNS = (
    ("receive", "io_receive_us_per_message", 1),
    ("admit", "io_admit_us_per_message", 1),
    ("decode", "io_decode_us_per_message", 1),
    ("handle", "io_handle_us_per_message", 1),
    ("answer", "io_answer_us_per_message", 1),
    ("between the steps", "io_between_steps_us_per_message", 1),
    ("outbox sends, ms a second / messages a second", "io_outbox_ms_per_s", 2),
    ("", "io_outbox_sent_per_s", 0),
    ("reap, ms a second", "io_reap_ms_per_s", 2),
    ("garbage collections, ms a second / collections a second", "io_gc_ms_per_s", 2),
    ("", "io_gc_per_s", 1),
)


def _table(
    rows: list[dict[str, Any]],
    columns: tuple[tuple[str, str, int], ...],
    last: tuple[str, Callable[[dict[str, Any]], str]] | None = None,
) -> list[str]:
    """A markdown table of ``columns`` of the rows' daemon threads' figures, one row a run kind;
    ``last``: the header of one more column, and the cell it gets from a row."""
    headers = [header for header, _, _ in columns if header]
    if last is not None:
        headers.append(last[0])
    lines = [
        "| dalid run | " + " | ".join(headers) + " |",
        "|---|" + "--:|" * len(headers),
    ]
    for row in rows:
        figures = row["daemon_threads"]
        cells: list[str] = []
        for header, name, digits in columns:
            text = spread_text(figures.get(name), digits)
            if header:
                cells.append(text)
            else:  # a second figure in the previous column
                cells[-1] += f" / {text}"
        if last is not None:
            cells.append(last[1](row))
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return lines


def _loads(row: dict[str, Any]) -> str:
    return (
        f"{spread_text(row.get('background_cores'), 2)} / "
        f"{spread_text(row.get('foreign_cores'), 2)}"
    )


def steps_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The I/O thread's CPU a message by step (µs) and its loop's sends, reap and garbage
    collections, for the rows that have them; [] if none."""
    measured = [
        row
        for row in rows
        if any(
            (row.get("daemon_threads") or {}).get(name, {}).get("n")
            for name in ("io_receive_us_per_message", "io_outbox_ms_per_s")
        )
    ]
    if not measured:
        return []
    return [
        *_table(measured, STEP_COLUMNS),
        "",
        "The I/O thread's CPU a message by step, µs, over the messages that neither start nor "
        "end a job: its frames received, the intake's look at its connection, its decoding "
        "(the message's checks included), its handler, its answer encoded and sent, and the "
        "loop's code between them (with the probes' own clocks). Outside its messages: its "
        "sends of what waited in its outbox, and its once-a-second reap of peers' processes. "
        "Its garbage collections, inside its messages or not.",
        "",
    ]


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The table, for the rows that have the daemon's threads' figures; [] if none has."""
    measured = [
        row
        for row in rows
        if (row.get("daemon_threads") or {}).get("daemon_own_us_per_sample", {}).get("n")
    ]
    if not measured:
        return []
    return [
        *_table(measured, COLUMNS, ("background load / other load, cores", _loads)),
        "",
        "The daemon's own threads over the jobs' timed window (`bench.threads`), per sample the "
        "executors ran: the I/O thread (its messages, and the rest of its loop in ms a second) "
        "and the executors less their output copies (of it, their calls into DALI). A message: "
        "the I/O thread's CPU and wall time from its receive to its answer; what it waited, "
        "wall less CPU; the times it blocked inside one (the GIL or a lock) and was preempted; "
        "its time runnable without a core over the whole window (its wakes from poll "
        "included). Background load: the bench's own spinning processes (`--background-load`).",
        "",
        *steps_markdown(measured),
    ]
