"""The GPU experiments' summary: one table over the bench results of the ``experiments`` part of
bench/gpu/run_on_device.sh, each experiment a bench run of its own (its folder: the results
JSON, and ``daemon-env.txt``, the ``DALID_*`` settings its daemons ran with).

    python -m bench.experiments FOLDER    (prints the table as Markdown)

Ratios are against DALI in-process with as many jobs: the experiment's own run where it ran
one (a setting of both, such as the hardware decoder's share), else the ``base`` experiment's.
Every experiment ran on the same machine within minutes, one repeat each: where things stand,
not precise ratios. The GPU memory of each job past the first is the bench's own target's formula
(:func:`bench.targets.added_gpu_ratio`), with the base's in-process job as the reference.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BASE = "base"
# The contenders' labels as the bench's tables have them (bench.contenders, without its imports).
LABELS = {"dali": "DALI in-process", "dali-proxy": "DALI proxy", "dalid": "dalid (shared)"}


@dataclass(frozen=True)
class Row:
    """One contender of one experiment, with the figures the summary shows (None: not read)."""

    experiment: str
    daemon: str  # the daemon's settings beyond the defaults, as run
    kind: str  # "dali", "dali-proxy" or "dalid"
    jobs: int
    samples_per_s: float | None
    gpu_busy_pct: float | None
    all_gpu_mb: float | None
    trainers_gpu_mb: float | None
    daemon_gpu_mb: float | None
    daemon_peak_rss_mb: float | None
    threads: float | None
    instances: float | None
    run_size: float | None
    mean_fill: float | None


def _median(figures: Mapping[str, Any], name: str) -> float | None:
    value = figures.get(name, {}).get("median")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return float(value)


def read_experiment(folder: Path) -> list[Row]:
    """The rows of the one results JSON in ``folder`` (none if the run wrote none)."""
    results = sorted(folder.glob("*.json"))
    if not results:
        return []
    data = json.loads(results[-1].read_text())
    env_file = folder / "daemon-env.txt"
    daemon = env_file.read_text().strip() if env_file.exists() else ""
    hw = data.get("settings", {}).get("hw_decoder_load")
    if hw is not None:
        daemon = f"{daemon} hw_decoder_load={hw}".strip()
    rows = []
    for row in data["summary"]["rows"]:
        memory, pipelines = row.get("memory", {}), row.get("pipelines", {})
        rows.append(
            Row(
                experiment=folder.name,
                daemon=daemon or "defaults",
                kind=row["kind"],
                jobs=int(row["jobs"]),
                samples_per_s=_median(row, "samples_per_s"),
                gpu_busy_pct=_median(memory, "gpu_busy_pct"),
                all_gpu_mb=_median(memory, "all_gpu_mb"),
                trainers_gpu_mb=_median(memory, "trainers_gpu_mb"),
                daemon_gpu_mb=_median(memory, "daemon_gpu_mb"),
                daemon_peak_rss_mb=_median(memory, "daemon_peak_rss_mb"),
                threads=_median(pipelines, "threads"),
                instances=_median(pipelines, "instances"),
                run_size=_median(pipelines, "run_size"),
                mean_fill=_median(pipelines, "mean_fill"),
            )
        )
    return rows


def added_gpu_ratio(rows: Sequence[Row], reference: Row | None) -> tuple[int, float] | None:
    """(jobs, ratio) of an experiment's dalid rows: what each dalid job past the first adds to
    all processes' GPU memory, beyond its trainer's CUDA context, over what ``reference`` (one
    in-process job) adds beyond that context; None without both job counts or the reference."""
    dalid = {row.jobs: row for row in rows if row.kind == "dalid"}
    many = max(dalid, default=1)
    if reference is None or reference.all_gpu_mb is None or many < 2 or 1 not in dalid:
        return None
    one, total = dalid[1], dalid[many].all_gpu_mb
    if total is None or one.all_gpu_mb is None or one.trainers_gpu_mb is None:
        return None
    beyond_context = reference.all_gpu_mb - one.trainers_gpu_mb
    if beyond_context <= 0:
        return None
    added = (total - one.all_gpu_mb) / (many - 1) - one.trainers_gpu_mb
    return many, added / beyond_context


def _figure(value: float | None, digits: int = 0, scale: float = 1.0) -> str:
    return "" if value is None else f"{value * scale:,.{digits}f}"


def summary(rows_by_experiment: Mapping[str, Sequence[Row]]) -> str:
    """The Markdown table of every experiment's rows, and each one's GPU memory per extra job."""
    base = rows_by_experiment.get(BASE, [])
    inprocess = {row.jobs: row for row in base if row.kind == "dali"}
    lines = [
        "| experiment | daemon | contender | jobs | samples/s | vs in-process "
        "| GPU busy % | GPU MiB, all processes | GPU MiB, daemon | daemon peak RSS MiB "
        "| DALI threads | instances | run size | mean run fill |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name, rows in rows_by_experiment.items():
        own = {row.jobs: row for row in rows if row.kind == "dali"}
        for row in sorted(rows, key=lambda row: (row.jobs, row.kind)):
            reference = own.get(row.jobs, inprocess.get(row.jobs))
            ratio = None
            if reference and reference.samples_per_s and row.samples_per_s is not None:
                ratio = row.samples_per_s / reference.samples_per_s
            lines.append(
                f"| {name} | {row.daemon if row.kind == 'dalid' else ''} "
                f"| {LABELS.get(row.kind, row.kind)} "
                f"| {row.jobs} | {_figure(row.samples_per_s)} | {_figure(ratio, 2)} "
                f"| {_figure(row.gpu_busy_pct)} | {_figure(row.all_gpu_mb)} "
                f"| {_figure(row.daemon_gpu_mb)} | {_figure(row.daemon_peak_rss_mb)} "
                f"| {_figure(row.threads)} | {_figure(row.instances)} | {_figure(row.run_size)} "
                f"| {_figure(row.mean_fill, 0, 100)}{'%' if row.mean_fill is not None else ''} |"
            )
    lines += [
        "",
        "GPU memory each dalid job past the first adds beyond its trainer's CUDA context, over "
        "what one in-process job (base) adds beyond it (target <= 0.5):",
        "",
    ]
    ratios = {
        name: added_gpu_ratio(rows, inprocess.get(1)) for name, rows in rows_by_experiment.items()
    }
    lines += [
        f"- {name}: {found[1]:.2f} ({found[0]} jobs and 1)"
        for name, found in ratios.items()
        if found is not None
    ] or ["- none: no experiment read GPU memory at both job counts"]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    folder = Path(argv[0])
    experiments = sorted(path for path in folder.iterdir() if path.is_dir())
    # The base first: the others are read against it.
    experiments.sort(key=lambda path: path.name != BASE)
    rows = {path.name: read_experiment(path) for path in experiments}
    print(summary({name: found for name, found in rows.items() if found}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
