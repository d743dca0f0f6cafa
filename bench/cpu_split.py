"""``python -m bench.cpu_split RESULTS.json``: where each run's CPU went, by process and thread.

RESULTS.json is a run's raw result (``raw/<time>.json`` beside its summary) or its summary,
whose raw result is then read from ``raw/`` beside it: a summary keeps no per-run readings.

Reads the ``split`` of the probes that every trainer takes at the start and the end of its
timed window (:class:`bench.measure.Probe`) and prints, per run and job, each process's and
each thread group's user and system CPU and minor page faults per timed sample. Ticks are 10
ms, so a group's figure is good to about ``10 ms / timed samples``: only groups above
``--floor`` µs a sample are shown. A daemon shared by several jobs is counted whole in each
job's rows; read multi-job runs by the process totals of the summary instead.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .measure import ProcStat
from .report import RAW


@dataclass(frozen=True)
class Row:
    """One part's use over a timed window, per timed sample."""

    run: str  # kind, jobs and repeat
    job: int
    part: str  # "trainer", "workers", "daemon", "trainer/<thread group>", ...
    user_us: float
    system_us: float
    minflt: float

    @property
    def cpu_us(self) -> float:
        return self.user_us + self.system_us


def rows_of(run: dict[str, Any]) -> list[Row]:
    """Per-sample rows of every job of one run of a results file; none for older files."""
    label = f"{run['kind']} x{run['jobs']} #{run['repeat']}"
    rows: list[Row] = []
    for result in run["results"]:
        loop = result["loop"]
        start, end = loop["start"].get("split", {}), loop["end"].get("split", {})
        samples = (len(loop["stamps_ns"]) - loop["warmup_batches"]) * loop["batch_size"]
        for part in sorted(end):
            # A thread group that started inside the window counts from zero.
            used = ProcStat(**end[part]) - ProcStat(**start.get(part, {}))
            rows.append(
                Row(
                    run=label,
                    job=loop["job"],
                    part=part,
                    user_us=used.user_s / samples * 1e6,
                    system_us=used.system_s / samples * 1e6,
                    minflt=used.minflt / samples,
                )
            )
    return rows


def table(rows: Sequence[Row], floor_us: float) -> str:
    """A markdown table of the rows: processes always, thread groups above ``floor_us``."""
    lines = [
        "| run | job | part | user µs/sample | system µs/sample | CPU µs/sample | minflt/sample |",
        "|---|--:|---|--:|--:|--:|--:|",
    ]
    for row in rows:
        if "/" in row.part and row.cpu_us < floor_us:
            continue
        lines.append(
            f"| {row.run} | {row.job} | {row.part} | {row.user_us:.1f} | {row.system_us:.1f} "
            f"| {row.cpu_us:.1f} | {row.minflt:.2f} |"
        )
    return "\n".join(lines)


def load_runs(path: Path) -> list[dict[str, Any]]:
    """The runs of a raw result: ``path``'s own, or those of the raw result of the summary at
    ``path``. Raises SystemExit, saying where it looked, when there is none."""
    data = json.loads(path.read_text())
    if "runs" in data:
        return list(data["runs"])
    raw = path.parent / RAW / path.name
    if raw.exists():
        return list(json.loads(raw.read_text())["runs"])
    raise SystemExit(
        f"{path} is a run's summary, which keeps no per-run CPU readings, and its raw result "
        f"{raw} is not on this machine (raw results are not committed): run the bench here, "
        "or give the raw result of the run that wrote this summary"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_split", description=__doc__)
    parser.add_argument("results", type=Path, help="a results file of python -m bench")
    parser.add_argument("--floor", type=float, default=20.0, help="µs a sample (default 20)")
    args = parser.parse_args(argv)
    runs = load_runs(args.results)
    rows = [row for run in runs if run.get("results") for row in rows_of(run)]
    print(table(rows, args.floor))


if __name__ == "__main__":
    main()
