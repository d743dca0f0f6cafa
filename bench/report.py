"""Writing a run's results: its summary (the JSON that is committed), its raw result and plots
(kept locally, in ``raw/``), and LATEST.md with latest.png for the last full run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from . import cohort_report, scaling_report, threads_report
from .config import CROP
from .machine import BUSY_CORES
from .runner import Outcome
from .summary import BASELINE
from .table import NONE, fmt, gpu_names, spread_text
from .targets import ECHO_P50_TARGET, ECHO_P99_TARGET, met_text
from .weights import WEIGHTS

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RAW = "raw"  # the folder of raw results and per-run plots, beside the summaries; git ignores it
RAW_KEYS = ("runs", "disturbed_runs_redone")  # what a summary leaves out of the raw result
DISTURBED = " **Other work competed for the CPU: these numbers are disturbed.**"


def _machine_line(machine: dict[str, Any]) -> str:
    packages = machine["packages"]
    git = machine.get("git", {})
    commit = (git.get("commit") or "?")[:10] + (" with local changes" if git.get("dirty") else "")
    return (
        f"{machine['cpu_model']}, {machine['usable_cpus']} usable CPUs, "
        f"{machine['memory_gib']} GiB memory, {gpu_names(machine)}; Python {packages['python']}, "
        f"DALI {packages['dali']}, torch {packages['torch']}, pyzmq {packages['pyzmq']} "
        f"(libzmq {packages['libzmq']}), msgpack {packages['msgpack']}, "
        f"numpy {packages['numpy']}; dalid at {commit}"
    )


def _setup(report: dict[str, Any]) -> list[str]:
    settings, dataset = report["settings"], report["dataset"]
    quick = " (quick mode: a smoke test, not a measurement)" if settings["quick"] else ""
    return [
        f"Measured {report['created_utc']} with `{report['command']}` in "
        f"{report['elapsed_s'] / 60:.1f} min{quick}.",
        "",
        f"- Machine: {_machine_line(report['machine'])}.",
        f"- Data: {dataset['images']} JPEGs in {dataset['classes']} classes, "
        f"{dataset['mean_kb']:.0f} KB on average{_jpeg_text(dataset)}, read from the page "
        "cache. Batch "
        f"{settings['batch_size']}, {settings['epochs']} epochs per run of which "
        f"{settings['warmup_epochs']} warm-up, {settings['workers']} DataLoader workers, "
        f"{settings['threads']} DALI threads per pipeline, {settings['repeats']} repeats, "
        f"pipelines on the {'GPU' if settings['gpu'] else 'CPU'}" + _pipeline_text(settings) + ".",
        f"- Other processes on the machine used {report['foreign_cores']:.2f} CPU cores on "
        "average while this ran (0: the benchmark had the machine to itself)."
        + (DISTURBED if report["foreign_cores"] > BUSY_CORES else "")
        + (
            f" The bench's own background load, {settings['background_load']} spinning "
            "processes, ran through every run (not counted in this figure)."
            if settings.get("background_load")
            else ""
        )
        + (
            f" {report['redone_runs']} run(s) that other processes disturbed were redone."
            if report.get("redone_runs")
            else ""
        ),
        "",
    ]


def _pipeline_text(settings: dict[str, Any]) -> str:
    """The profile's augmentation and QA configuration, where they are not the CPU profile's."""
    text = ""
    if settings.get("pipeline") == "train":
        text += (
            ", the ImageNet-style training pipeline (decoder with random crop, resize, flip, "
            "normalize to float16 NCHW)"
        )
    if settings.get("crop", CROP) != CROP:
        text += f", images cropped and resized to {settings['crop']}x{settings['crop']}"
    if settings.get("profile", "cpu") == "gpu" or (
        settings.get("profile", "cpu") == "cpu" and settings.get("quick")
    ):
        text += (
            f"; QA configuration: batch {settings.get('qa_batch_size')}, "
            f"{settings.get('qa_threads')} threads, hw_decoder_load "
            f"{settings.get('qa_hw_decoder_load')}"
        )
    return text


def _jpeg_text(dataset: dict[str, Any]) -> str:
    jpeg = dataset.get("jpeg")
    if not jpeg:
        return ""
    chroma = ":".join(jpeg["subsampling"])
    return f", {chroma} chroma at quality {jpeg['quality'][0]}-{jpeg['quality'][1]}"


# How a target's figure shows, by its unit: digits, scale and suffix.
_UNITS = {"ratio": (1, 100.0, "%"), "times": (2, 1.0, "x"), "index": (3, 1.0, ""),
          "us": (0, 1.0, " µs"), "us.1": (1, 1.0, " µs"), "rate": (0, 1.0, " samples/s"),
          "count": (0, 1.0, "")}  # fmt: skip


def targets_table(summary: dict[str, Any]) -> list[str]:
    if not summary["targets"]:
        return []
    lines = ["| target | goal | measured: median [min-max] | met |", "|---|---|---|---|"]
    for target in summary["targets"]:
        digits, scale, suffix = _UNITS[target["unit"]]
        measured = target["measured"]
        shown = spread_text(measured, digits, scale) + suffix if measured else NONE
        lines.append(
            f"| {target['name']} | {target['goal'].replace('us', 'µs')} | {shown} | "
            f"{met_text(target['met'], target.get('why'))} |"
        )
    return [*lines, ""]


def _main_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Contenders with one job and with ``--jobs``; the other job counts are scaling runs, and
    the weighted run has a table of its own."""
    counts = (1, report["settings"]["jobs"])
    return [
        row for row in report["summary"]["rows"] if row["jobs"] in counts and row["kind"] != WEIGHTS
    ]


def _contenders(summary: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = [
        "| contender | samples/s | per job | vs DALI in-process | batch interval p50 / p99 ms "
        "| trainer CPU ms/sample | all CPU ms/sample | trainer peak RSS MiB "
        "| all peak RSS MiB | busy cores: machine / account / kernel | other load, cores |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        if not row["samples_per_s"]["n"]:
            error = "; ".join(row["errors"]).replace("\n", " ")[:200]
            lines.append(f"| {row['label']} | failed: {error} |||||||||||")
            continue
        base = BASELINE if row["jobs"] == 1 else f"{BASELINE}-x{row['jobs']}"
        ratio = summary["ratios"].get(row["id"], {}).get(base)
        versus = spread_text(ratio, 0, 100) + "%" if ratio and ratio["n"] else NONE
        interval = row["interval_ms"]
        per_job = spread_text(row["per_job_samples_per_s"]) if row["jobs"] > 1 else ""
        cpu = row["cpu_ms_per_sample"]
        busy = row.get("busy_cores") or {}
        lines.append(
            f"| {row['label']} | {spread_text(row['samples_per_s'])} | {per_job} | {versus} | "
            f"{fmt(interval.get('p50'), 1)} / {fmt(interval.get('p99'), 1)} | "
            f"{fmt(cpu['trainer']['median'], 2)} | {fmt(cpu['total']['median'], 2)} | "
            f"{fmt(row['trainer_peak_rss_mb']['median'])} | "
            f"{fmt(row['total_peak_rss_mb']['median'])} | "
            f"{spread_text(busy.get('common'), 2)} / {spread_text(busy.get('account'), 2)} / "
            f"{spread_text(busy.get('kernel_threads'), 2)} | "
            f"{spread_text(row['foreign_cores'], 2)} |"
        )
    return [
        *lines,
        "",
        "Samples/s reaching the training loop; for several jobs, all jobs together (and each "
        'job). "vs DALI in-process" divides by DALI in-process with as many jobs, run in the '
        "same repeat. Medians over repeats, [min-max] across them. Busy cores: the whole "
        "machine's (/proc/stat) over the jobs' common window, what the per-process "
        "account implies (all CPU a sample x samples/s), and the kernel's own threads' "
        "(reclaim, memory monitors), which no process of the bench owns. Other load: CPU "
        "cores used by processes that are not the benchmark's during each run. See "
        "bench/README.md for each metric.",
        "",
    ]


def _handles(rows: list[dict[str, Any]]) -> list[str]:
    """Slabs and batch events each dalid contender's trainers opened per epoch (bench.handles),
    from its first repeat that counted them."""
    counted = [row for row in rows if row.get("handles_per_run")]
    if not counted:
        return []
    lines = [
        "| contender | slab handles opened, each epoch | slabs of the pools | pool MiB per job, "
        "peak | batch events opened, each epoch | output path |",
        "|---|---|--:|--:|---|---|",
    ]
    for row in counted:
        run = row["handles_per_run"][0]
        slabs = NONE if run["slabs"] is None else str(run["slabs"])
        peak = run.get("peak_slab_bytes_per_job")
        pool = NONE if peak is None else f"{peak / (1 << 20):,.0f}"
        lines.append(
            f"| {row['label']} | {', '.join(map(str, run['opens_per_epoch']))} | {slabs} | "
            f"{pool} | "
            f"{', '.join(map(str, run['events_per_epoch']))} | "
            f"{', '.join(run['output_paths']) or NONE} |"
        )
    return [
        *lines,
        "",
        "Each slab of a job's output pool is mapped once by its trainer (a GPU slab: one "
        "cudaIpcOpenMemHandle), each of the daemon's batch events opened once: after the "
        "pools have filled, an epoch opens none. Counted by every trainer at the end of each "
        "epoch, summed over the run's jobs; slabs: the jobs' pools as their timed windows "
        "ended (`dalid status`); pool MiB per job: the most bytes of slabs a job's pools held "
        "at once, the mean over the run's jobs.",
        "",
    ]


def _ratio_matrix(summary: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    ids = [row["id"] for row in rows if row["samples_per_s"]["n"]]
    if len(ids) < 2:
        return []
    names = {row["id"]: row["label"] for row in summary["rows"]}
    lines = [
        "Throughput of each row over each column (median of per-repeat ratios):",
        "",
        "| row / column | " + " | ".join(names[i] for i in ids) + " |",
        "|---|" + "--:|" * len(ids),
    ]
    for a in ids:
        cells = [fmt(summary["ratios"][a][b]["median"] * 100) + "%" for b in ids]
        lines.append(f"| {names[a]} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _transport(summary: dict[str, Any]) -> list[str]:
    transport = summary["transport"]
    lines = []
    probes = transport.get("probes", {})
    if probes:
        lines += ["| transport probe (empty pipeline) | p50 µs | p99 µs |", "|---|--:|--:|"]
        for probe in probes.values():
            p50, p99 = spread_text(probe["p50_us"]), spread_text(probe["p99_us"])
            lines.append(f"| {probe['description']} | {p50} | {p99} |")
        lines.append("")
    for error in transport.get("errors", []):
        lines += [f"Transport probes failed: {error[:300]}", ""]
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The results as markdown: setup, targets, contenders, ratios, transport."""
    summary = report["summary"]
    sections = [
        _setup(report),
        targets_table(summary),
        _contenders(summary, _main_rows(report)),
        _handles(_main_rows(report)),
        threads_report.markdown(summary["rows"]),
        _ratio_matrix(summary, _main_rows(report)),
        scaling_report.markdown(report),
        scaling_report.weighted_markdown(report),
        cohort_report.markdown(report),
        _transport(summary),
    ]
    return "\n".join(line for section in sections for line in section).rstrip() + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Four panels: throughput, batch intervals, CPU per sample, transport round trips."""
    rows = [row for row in _main_rows(report) if row["samples_per_s"]["n"]]
    labels = [row["label"].replace(", ", "\n") for row in rows]
    x = list(range(len(rows)))
    width = 0.4
    fig = Figure(figsize=(13, 8.5))
    FigureCanvasAgg(fig)
    machine = report["machine"]
    fig.suptitle(
        f"dalid benchmark {report['created_utc']}: {machine['cpu_model']}, "
        f"{machine['usable_cpus']} CPUs, {gpu_names(machine)}"
    )
    axes = fig.subplots(2, 2)

    ax = axes[0][0]
    medians = [row["samples_per_s"]["median"] for row in rows]
    below = [m - row["samples_per_s"]["min"] for m, row in zip(medians, rows, strict=True)]
    above = [row["samples_per_s"]["max"] - m for m, row in zip(medians, rows, strict=True)]
    ax.bar(x, medians, yerr=[below, above], capsize=4)
    ax.set_title("samples/s into the training loop (median, min-max)")

    ax = axes[0][1]
    ax.bar([i - width / 2 for i in x], [r["interval_ms"]["p50"] for r in rows], width, label="p50")
    ax.bar([i + width / 2 for i in x], [r["interval_ms"]["p99"] for r in rows], width, label="p99")
    ax.set_title("time between batches in the loop (ms)")
    ax.legend()

    ax = axes[1][0]
    bottom = [0.0] * len(rows)
    for part in ("trainer", "workers", "daemon"):
        values = [row["cpu_ms_per_sample"][part]["median"] for row in rows]
        ax.bar(x, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_title("CPU time per sample (ms), by process")
    ax.legend()

    for ax in (axes[0][0], axes[0][1], axes[1][0]):
        ax.set_xticks(x, labels, fontsize=8)

    ax = axes[1][1]
    probes = report["summary"]["transport"].get("probes", {})
    names = list(probes)
    px = list(range(len(names)))
    for offset, key in ((-width / 2, "p50_us"), (width / 2, "p99_us")):
        values = [probes[name][key]["median"] for name in names]
        ax.bar([i + offset for i in px], values, width, label=key[:3])
    if "zmq_echo" in probes:
        # The round-trip targets: a tiny batch within 2x (p50) and 3x (p99) of the echo.
        echo = probes["zmq_echo"]
        for quantile, goal, style in (("p50_us", ECHO_P50_TARGET, "--"),
                                      ("p99_us", ECHO_P99_TARGET, ":")):  # fmt: skip
            ax.axhline(goal * echo[quantile]["median"], color="grey", linestyle=style, linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(px, [name.replace("_", "\n", 1) for name in names], fontsize=8)
    ax.set_title("empty-pipeline round trip (µs, log; 2x/3x the echo dashed/dotted)")
    ax.legend()

    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _raw_run(outcome: Outcome) -> dict[str, Any]:
    """A run for the raw JSON file; transport samples are summarized, not kept one by one."""
    data = asdict(outcome)
    data["results"] = [
        {"transport": "see summary.transport.runs"} if "transport" in result else result
        for result in outcome.results
    ]
    return data


def compact(data: dict[str, Any]) -> dict[str, Any]:
    """A run's summary as committed: the raw result without its runs (each job's batch stamps,
    memory and CPU readings), which only :mod:`bench.cpu_split` reads."""
    return {key: value for key, value in data.items() if key not in RAW_KEYS}


def compact_text(data: dict[str, Any]) -> str:
    """``compact(data)`` as JSON on one line: the summaries of a few dozen runs stay a few MB."""
    return json.dumps(compact(data), separators=(",", ":")) + "\n"


def write(
    report: dict[str, Any],
    outcomes: Sequence[Outcome],
    discarded: Sequence[Outcome],
    directory: Path,
    update_latest: bool,
) -> list[Path]:
    """Writes the run's summary, ``<time>.json`` (:func:`compact`), and in ``raw/`` (which git
    ignores) its raw result and plots, ``<time>.json``, ``<time>.png`` and
    ``<time>-scaling.png``; with ``update_latest`` also LATEST.md, latest.png and
    latest-scaling.png. Returns the paths written."""
    raw = directory / RAW
    raw.mkdir(parents=True, exist_ok=True)
    stamp = report["created_utc"].replace(":", "").replace("-", "")
    profile = report["settings"].get("profile", "cpu")
    # The CPU profile's runs keep their plain names; another profile's name its profile.
    prefix = stamp if profile == "cpu" else f"{stamp}-{profile}"
    prefix = f"{prefix}-quick" if report["settings"]["quick"] else prefix
    summary_path, raw_path = directory / f"{prefix}.json", raw / f"{prefix}.json"
    png_path = raw / f"{prefix}.png"
    runs = [_raw_run(outcome) for outcome in outcomes]
    redone = [_raw_run(outcome) for outcome in discarded]
    data = {**report, "runs": runs, "disturbed_runs_redone": redone}
    raw_path.write_text(json.dumps(data, indent=1) + "\n")
    summary_path.write_text(compact_text(data))
    plot(report, png_path)
    written = [summary_path, raw_path, png_path]
    scaling_png = raw / f"{prefix}-scaling.png"
    scaled = scaling_report.plot(report, scaling_png)
    if scaled:
        written.append(scaling_png)
    if update_latest:
        latest, latest_scaling = directory / "LATEST.md", directory / "latest-scaling.png"
        images = ["latest.png", *(["latest-scaling.png"] if scaled else [])]
        latest.write_text(latest_markdown(report, images, summary_path.name))
        (directory / "latest.png").write_bytes(png_path.read_bytes())
        written += [latest, directory / "latest.png"]
        if scaled:
            latest_scaling.write_bytes(scaling_png.read_bytes())
            written.append(latest_scaling)
        else:  # an older run's scaling plot would not match the table
            latest_scaling.unlink(missing_ok=True)
    return written


def latest_markdown(report: dict[str, Any], images: Sequence[str], summary: str) -> str:
    """LATEST.md: the run's tables, its plots and where its summary and raw result are."""
    return (
        f"# dalid benchmark: latest results\n\n{markdown(report)}\n"
        + "".join(f"![latest results]({image})\n\n" for image in images)
        + f"Summary: [{summary}]({summary}); the raw result (every run's batch stamps, memory "
        f"and CPU readings) stays on the machine that ran it, in `{RAW}/{summary}`.\n"
    )
