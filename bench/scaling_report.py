"""The scaling section of a report: throughput, fairness, memory and the daemon's pipelines by
job count, and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .contenders import CONTENDERS
from .scaling import SCALED
from .summary import BASELINE
from .table import NONE, fmt, gpu_names, spread_text
from .weights import QUEUE_INTERVAL_S


def scaling_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The summary rows of the scaling runs that measured something, by job count."""
    counts = report["settings"].get("scaling_jobs") or []
    rows = [
        row
        for row in report["summary"]["rows"]
        if row["kind"] in SCALED and row["jobs"] in counts and row["samples_per_s"]["n"]
    ]
    return sorted(rows, key=lambda row: (row["jobs"], SCALED.index(row["kind"])))


def _memory(row: dict[str, Any], name: str, peak: str | None = None) -> str:
    """``median (peak)`` of one memory figure, medians over repeats."""
    memory = row["memory"]
    value = memory.get(name, {})
    if not value.get("n"):
        return NONE
    text = fmt(value["median"])
    highest = memory.get(peak or "", {})
    return f"{text} ({fmt(highest['median'])})" if highest.get("n") else text


def _fill(row: dict[str, Any], name: str = "mean_fill") -> str:
    """A share of the daemon's pipeline runs (bench.fill), in %; blank without a daemon."""
    value = row.get("pipelines", {}).get(name)
    if value is None:
        return ""
    return spread_text(value, 0, 100) + "%" if value["n"] else NONE


def markdown(report: dict[str, Any]) -> list[str]:
    """Three tables: throughput and fairness by job count, the memory of each setting, and
    the daemon's pipelines."""
    rows = scaling_rows(report)
    if not rows:
        return []
    ratios = report["summary"]["ratios"]
    dali, shared, private = (CONTENDERS[kind].label for kind in ("dali", "dalid", "dalid-private"))
    lines = [
        f"Scaling: N training jobs through one dalid daemon, sharing one pipeline in it "
        f"({shared}) or each with a pipeline of its own in it ({private}), or each with its "
        f"own in-process pipeline ({dali}, and where the profile runs it "
        f"{CONTENDERS['dali-proxy'].label}); every job with its own trainer process and "
        "DataLoader workers, all started together.",
        "",
        "| jobs | contender | samples/s, all jobs | per job | vs DALI in-process "
        "| Jain's fairness | mean run fill | other load, cores |",
        "|--:|---|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        base = BASELINE if row["jobs"] == 1 else f"{BASELINE}-x{row['jobs']}"
        ratio = ratios.get(row["id"], {}).get(base)
        versus = spread_text(ratio, 0, 100) + "%" if ratio and ratio["n"] else NONE
        union = "*" if "union window" in row["rate_windows"] else ""
        lines.append(
            f"| {row['jobs']} | {CONTENDERS[row['kind']].label} | "
            f"{spread_text(row['samples_per_s'])}{union} | "
            f"{spread_text(row['job_share_samples_per_s'])}{union} | {versus} | "
            f"{spread_text(row['fairness'], 3)} | {_fill(row)} | "
            f"{spread_text(row['foreign_cores'], 2)} |"
        )
    gpu = any(row["memory"].get("gpu_mb", {}).get("n") for row in rows)
    lines += [
        "",
        "Per job: each job's samples/s while every job ran (the common window), median "
        "[min-max] over jobs and repeats. Jain's fairness index (sum x)² / (n · sum x²) over "
        "those per-job rates: 1 when the jobs share evenly, 1/n when one job gets everything. "
        "Mean run fill: the samples the daemon's pipelines ran over what their runs could "
        "hold (see the last table)."
        + (
            " *: in some repeat the jobs overlapped too little for a common window; there, all "
            "jobs are measured over the union of their timed windows, each job over its own."
            if any("union window" in row["rate_windows"] for row in rows)
            else ""
        ),
        "",
        "| jobs | contender | trainers PSS MiB (peak) | trainers RSS sum MiB "
        "| daemon RSS MiB (peak) | daemon PSS MiB | daemon /dev/shm MiB (peak) "
        "| all processes PSS MiB (peak) |"
        + (
            " GPU MiB (peak) | GPU MiB, all processes (peak) | GPU MiB, daemon | GPU busy % |"
            if gpu
            else ""
        ),
        "|--:|---|--:|--:|--:|--:|--:|--:|" + ("--:|--:|--:|--:|" if gpu else ""),
    ]
    for row in rows:
        daemon = CONTENDERS[row["kind"]].needs_daemon
        cells = [
            _memory(row, "trainers_pss_mb", "trainers_pss_peak_mb"),
            _memory(row, "trainers_rss_mb"),
            _memory(row, "daemon_rss_mb", "daemon_peak_rss_mb") if daemon else "",
            _memory(row, "daemon_pss_mb") if daemon else "",
            _memory(row, "daemon_shm_mb", "daemon_shm_peak_mb") if daemon else "",
            _memory(row, "all_pss_mb", "all_pss_peak_mb"),
        ]
        if gpu:
            cells += [
                _memory(row, "gpu_mb", "gpu_peak_mb"),
                _memory(row, "all_gpu_mb", "all_gpu_peak_mb"),
                _memory(row, "daemon_gpu_mb") if daemon else "",
                _memory(row, "gpu_busy_pct"),
            ]
        lines.append(
            f"| {row['jobs']} | {CONTENDERS[row['kind']].label} | " + " | ".join(cells) + " |"
        )
    return [
        *lines,
        *_added_per_job(rows),
        "",
        "Memory sampled from the start signal on, every second (less often when a sample "
        "would cost over 5% of a core); each figure is its median over the samples in the "
        "timed window (or the sample nearest to it), (peak) its highest sample, both medians "
        "over repeats. Trainers: every "
        "trainer process and its DataLoader workers. PSS (proportional set size) divides each "
        "shared page among the processes that map it, so it adds up across processes; a sum of "
        "RSS counts pages workers share with their trainer once per process. The daemon's peak "
        "RSS is its high-water mark (VmHWM). /dev/shm: pages its output slabs hold, which the "
        "daemon's and the trainers' PSS include too."
        + (
            " GPU: memory in use over the reading before the run (nvidia-smi); all processes: "
            "what nvidia-smi charges each of the run's processes (--query-compute-apps), the "
            "trainers, their workers and the daemon added up; daemon: its own share. GPU "
            "busy: nvidia-smi's utilization.gpu (the share of time a kernel ran), median over "
            "the timed window's samples."
            if gpu
            else ""
        ),
        "",
        *_pipelines(rows),
    ]


def added_per_job(rows: list[dict[str, Any]], name: str) -> dict[tuple[str, int], float]:
    """What each job past the first added to the memory figure ``name`` (MiB), by contender
    and job count: ``(at N jobs - at 1 job) / (N - 1)``, from the medians over repeats."""
    one = {
        row["kind"]: row["memory"][name]["median"]
        for row in rows
        if row["jobs"] == 1 and row["memory"].get(name, {}).get("n")
    }
    added = {}
    for row in rows:
        value = row["memory"].get(name, {})
        if row["jobs"] > 1 and value.get("n") and row["kind"] in one:
            added[row["kind"], row["jobs"]] = (value["median"] - one[row["kind"]]) / (
                row["jobs"] - 1
            )
    return added


def _added_per_job(rows: list[dict[str, Any]]) -> list[str]:
    """The memory table's last rows: what a job added to all processes' PSS, and to the
    daemon's peak RSS."""
    pss = added_per_job(rows, "all_pss_mb")
    daemon = added_per_job(rows, "daemon_peak_rss_mb")
    if not pss:
        return []
    lines = [
        "",
        "| jobs | contender | all processes PSS MiB, each job past the first "
        "| daemon peak RSS MiB, each job past the first |",
        "|--:|---|--:|--:|",
    ]
    for (kind, jobs), value in pss.items():
        extra = daemon.get((kind, jobs))
        lines.append(
            f"| {jobs} | {CONTENDERS[kind].label} | {fmt(value)} | "
            f"{'' if extra is None else fmt(extra)} |"
        )
    return [
        *lines,
        "",
        "Each job past the first: (the figure with N jobs - with 1 job) / (N - 1), from the "
        "medians above; what one more training job costs in memory on this machine.",
    ]


def _pipelines(rows: list[dict[str, Any]]) -> list[str]:
    """The daemon's pipelines in each dalid setting, as its status showed them."""
    mine = [row for row in rows if row.get("pipelines")]
    if not mine:
        return []
    lines = [
        "| jobs | contender | pipelines in the daemon | jobs per pipeline | DALI threads "
        "| DALI instances | run size, samples | runs | mean run fill | mixed runs |",
        "|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in mine:
        figures = row["pipelines"]
        count, shared = figures["pipelines"], figures["shared"]
        if not count["n"]:
            pipelines = NONE
        else:
            pipelines = f"{fmt(count['median'])} ({fmt(shared['median'])} shared)"
        lines.append(
            f"| {row['jobs']} | {CONTENDERS[row['kind']].label} | {pipelines} | "
            f"{spread_text(figures['jobs_per_pipeline'])} | {spread_text(figures['threads'])} | "
            f"{spread_text(figures['instances']) if 'instances' in figures else NONE} | "
            f"{spread_text(figures['run_size'])} | {spread_text(figures['runs'])} | "
            f"{_fill(row)} | {_fill(row, 'mixed_share')} |"
        )
    return [
        *lines,
        "",
        "The daemon's pipelines, from its status (`dalid status --json`) as each job's timed "
        "window ended, medians over repeats: how many (and how many of them shared by several "
        "jobs), the most jobs one served, their DALI threads together, the most samples one run "
        "holds, the runs of all of them since they were built (warm-up included), the samples "
        "run over what those runs could hold, and the share of runs that mixed batches of two "
        "jobs or more.",
        "",
    ]


def _signed(value: dict[str, float]) -> str:
    """A spread of relative errors as signed percentages: ``+2.1% [-0.4 to +4.0%]``."""
    if not value.get("n"):
        return NONE
    median = f"{value['median'] * 100:+.1f}%"
    if value["n"] == 1:
        return median
    return f"{median} [{value['min'] * 100:+.1f} to {value['max'] * 100:+.1f}%]"


def _per_job(
    weighted: dict[str, Any], name: str, digits: int = 0, scale: float = 1.0, suffix: str = ""
) -> str:
    """One figure of every job of the weighted run, each after its weight: ``1: 170 / 3: 510``."""
    return " / ".join(
        f"{weight:g}: {spread_text(value, digits, scale)}{suffix if value['n'] else ''}"
        for weight, value in zip(weighted["weights"], weighted[name], strict=True)
    )


def weighted_markdown(report: dict[str, Any]) -> list[str]:
    """The weighted run (bench.weights): each job's samples/s over the common window, the heavy
    job's over the light job's and its error against the weights, and the jobs' queues."""
    rows = [row for row in report["summary"]["rows"] if row.get("weighted")]
    if not rows:
        return []
    lines = [
        "Weights: two jobs through one dalid daemon, sharing one pipeline in it, of weights "
        + " and ".join(f"{w:g}" for w in rows[0]["weighted"]["weights"])
        + "; both started together, an epoch of the heavier going over the images as many "
        "times more and its DataLoader workers keeping as many times the batches in flight, "
        "so that both keep the daemon busy to the end.",
        "",
        "| contender | samples/s, all jobs | samples/s per job, by weight | heavy / light "
        "| off the weights' ratio | batches queued per job (median) | readings with a batch "
        "queued, per job | other load, cores |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        weighted = row["weighted"]
        lines.append(
            f"| {row['label']} | {spread_text(row['samples_per_s'])} | "
            f"{_per_job(weighted, 'rates')} | {spread_text(weighted['ratio'], 2)}x | "
            f"{_signed(weighted['error'])} | {_per_job(weighted, 'queued', 1)} | "
            f"{_per_job(weighted, 'backlogged', 0, 100, '%')} | "
            f"{spread_text(row['foreign_cores'], 2)} |"
        )
    return [
        *lines,
        "",
        "Each job's samples/s over the window where both were past their warm-up and neither "
        "had finished, medians [min-max] over repeats; the heavy job's over the light job's, "
        "and how far that is from the ratio of the weights. Queues: the job's batches waiting "
        "for the pipeline in the daemon's status, read every "
        f"{QUEUE_INTERVAL_S:g} s in that window; a job with none queued was waiting on its own "
        "trainer and workers, not on the daemon, and its share says nothing of the weights.",
        "",
    ]


def plot(report: dict[str, Any], path: Path) -> bool:
    """Throughput, per-job throughput, fairness and memory against the job count; False (and
    nothing written) when the report has fewer than two job counts."""
    rows = scaling_rows(report)
    counts = sorted({row["jobs"] for row in rows})
    if len(counts) < 2:
        return False
    fig = Figure(figsize=(13, 8.5))
    FigureCanvasAgg(fig)
    machine = report["machine"]
    fig.suptitle(
        f"dalid scaling {report['created_utc']}: jobs through one daemon or in-process; "
        f"{machine['cpu_model']}, {machine['usable_cpus']} CPUs, {gpu_names(machine)}"
    )
    axes = fig.subplots(2, 2)
    panels = (
        (axes[0][0], "samples_per_s", "samples/s, all jobs (median, min-max)"),
        (axes[0][1], "job_share_samples_per_s", "samples/s per job (median, min-max)"),
        (axes[1][0], "fairness", "Jain's fairness index over jobs (1 = even)"),
    )
    axes[1][0].set_ylim(top=1.05)
    memory = axes[1][1]
    for index, kind in enumerate(SCALED):
        mine = [row for row in rows if row["kind"] == kind]
        x = [row["jobs"] for row in mine]
        label, color = CONTENDERS[kind].label, f"C{index}"
        for ax, name, title in panels:
            medians = [row[name]["median"] for row in mine]
            below = [m - row[name]["min"] for m, row in zip(medians, mine, strict=True)]
            above = [row[name]["max"] - m for m, row in zip(medians, mine, strict=True)]
            ax.errorbar(
                x, medians, yerr=[below, above], marker="o", capsize=4, color=color, label=label
            )
            ax.set_title(title)
        pss = [row["memory"]["all_pss_mb"].get("median") for row in mine]
        memory.plot(x, pss, marker="o", color=color, label=f"{label}: all processes, PSS")
        if CONTENDERS[kind].needs_daemon:
            rss = [row["memory"]["daemon_rss_mb"].get("median") for row in mine]
            memory.plot(
                x, rss, marker="s", linestyle="--", color=color, label=f"{label}: daemon RSS"
            )
    memory.set_title("memory in the timed window (MiB)")
    for ax in (axes[0][0], axes[0][1], axes[1][0], memory):
        ax.set_ylim(bottom=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.set_xlabel("concurrent jobs")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True
