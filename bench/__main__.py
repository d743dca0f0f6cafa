"""``python -m bench``: run every contender on the same data, then write and print the results."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .config import PROFILES, Settings
from .contenders import CHECKPOINT_KINDS, CONTENDERS, GPU_KINDS, SMALL_KINDS
from .dataset import SUBSAMPLING, JpegStyle, make_imagefolder
from .machine import BUSY_CORES, describe, gpu_present, wait_until_idle
from .progress import Progress
from .report import RESULTS_DIR, markdown, write
from .runner import Outcome, run_once
from .scaling import COHORT_KINDS, COHORT_RUNS, SCALED, SCALING, add_scaling_runs, parse_job_counts
from .summary import row_label, run_metrics, summarize
from .weights import JOB_WEIGHTS, WEIGHTS

KINDS = [*CONTENDERS, "transport", SCALING, COHORT_RUNS]
REDO_DISTURBED = 2  # with --wait-idle, times a run that other processes disturbed is redone


def _job_counts(text: str) -> tuple[int, ...]:
    try:
        return parse_job_counts(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Compare dalid with DALI in-process, DALI's proxy and a torch+PIL loader.",
    )
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="cpu",
        help="the named configuration to start from: cpu (the default: batch 32, 2 workers, "
        "every contender) or gpu (the ImageNet-style training pipeline at batch 256 with 8 "
        "workers, DALI's QA decoder configuration, staged GPU outputs, scaling runs of dalid "
        "against DALI in-process) or small (16,384 small JPEGs resized to 32x32 at batch 256: "
        "DALI in-process, fed by workers, DALI's proxy and dalid, 1 and 4 jobs); see README.md",
    )
    parser.add_argument("--quick", action="store_true", help="a small smoke run (about a minute)")
    parser.add_argument("--images", type=int, help="images in the dataset (default 512)")
    parser.add_argument("--repeats", type=int, help="runs of every contender (default 3)")
    parser.add_argument("--jobs", type=int, help="trainers in the multi-job runs (default 2)")
    parser.add_argument(
        "--scaling-jobs",
        type=_job_counts,
        help="job counts of the scaling runs, comma-separated (default 1,2,4,8; quick: 1,2,4)",
    )
    parser.add_argument("--epochs", type=int, help="epochs per run, the first warms up (default 5)")
    parser.add_argument("--batch-size", type=int, help="samples per batch (default 32)")
    parser.add_argument("--workers", type=int, help="DataLoader workers (default 2)")
    parser.add_argument("--threads", type=int, help="DALI threads per pipeline (default 2)")
    parser.add_argument("--classes", type=int, help="class folders in the dataset (default 8)")
    parser.add_argument(
        "--jpeg-subsampling",
        choices=sorted(SUBSAMPLING),
        help="chroma subsampling of the dataset's JPEGs (default 444; ImageNet's are mostly 420)",
    )
    parser.add_argument(
        "--jpeg-quality",
        metavar="LOW-HIGH",
        help="JPEG quality range of the dataset (default 92-100; ImageNet's are about 75-95)",
    )
    parser.add_argument(
        "--hw-decoder-load",
        type=float,
        metavar="SHARE",
        help="on a GPU, the share of images the mixed decoder gives the hardware JPEG decoder, "
        "in-process and through dalid alike (default: DALI's)",
    )
    parser.add_argument("--seed", type=int, help="dataset and pipeline seed (default 0)")
    parser.add_argument("--transport-iterations", type=int, help="round trips per probe (2000)")
    parser.add_argument(
        "--only",
        help=f"comma-separated subset of {','.join(KINDS)} (default: all)",
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each run, wait up to this long for other processes to go quiet, and redo "
        "(twice at most) a run they disturbed anyway (default 0: neither)",
    )
    parser.add_argument(
        "--background-load",
        type=int,
        metavar="N",
        help="N processes that each spin on a core through every run: the machine saturated "
        "by a load that is not dalid's, to tell it from more jobs (default 0)",
    )
    parser.add_argument("--cpu", action="store_true", help="CPU pipelines even if a GPU is present")
    parser.add_argument(
        "--output",
        type=Path,
        default=RESULTS_DIR,
        help="results folder (default bench/results): the run's summary JSON there, its raw "
        "result and plots in its raw/ folder",
    )
    parser.add_argument(
        "--no-latest",
        action="store_true",
        help="do not update the folder's LATEST.md, latest.png and latest-scaling.png (quick "
        "runs never do)",
    )
    return parser.parse_args(argv)


_OVERRIDABLE = (
    "images", "repeats", "jobs", "scaling_jobs", "epochs", "batch_size", "workers", "threads",
    "classes", "seed", "transport_iterations", "jpeg_subsampling", "jpeg_quality",
    "hw_decoder_load", "background_load",
)  # fmt: skip


def make_settings(args: argparse.Namespace) -> Settings:
    """The profile's settings (or its quick mode's), with the options given on the command
    line."""
    full, quick = PROFILES[args.profile]
    settings = quick if args.quick else full
    given = {name: getattr(args, name) for name in _OVERRIDABLE}
    overrides = {name: value for name, value in given.items() if value is not None}
    settings = settings.with_(**overrides, gpu=not args.cpu and gpu_present())
    try:
        JpegStyle.parse(settings.jpeg_subsampling, settings.jpeg_quality)
    except ValueError as error:
        raise SystemExit(f"--jpeg-subsampling/--jpeg-quality: {error}") from None
    if settings.images < settings.batch_size:
        raise SystemExit("--images must hold at least one batch")
    if settings.background_load < 0:
        raise SystemExit("--background-load must be 0 or more")
    if settings.epochs <= settings.warmup_epochs:
        raise SystemExit(f"--epochs must be more than the {settings.warmup_epochs} warm-up epoch")
    return settings


def default_kinds(settings: Settings) -> list[str]:
    """What a run without ``--only`` runs: on the small profile, its four contenders; on the
    GPU profile, neither torch + PIL nor the
    private pipelines (a short stay on a GPU has no time for them); on the CPU profile, the
    GPU profile's contenders in quick mode only (their code runs; their figures mean nothing
    on a CPU)."""
    if settings.profile == "small":
        return list(SMALL_KINDS)
    # The cohort runs (N jobs reading the same data), the checkpoint rows and DALI fed by
    # workers (the small profile's) only when asked: --only cohort, --only
    # dalid-deterministic,dalid-checkpoint, --only dali-fed.
    asked_only = (
        COHORT_RUNS, "dalid-cohort", "dalid-cohort-trailing", *CHECKPOINT_KINDS, "dali-fed",
    )  # fmt: skip
    kinds = [kind for kind in KINDS if kind not in asked_only]
    if settings.profile == "gpu":
        return [kind for kind in kinds if kind not in ("torch-pil", "dalid-private")]
    if settings.quick:
        return kinds
    return [kind for kind in kinds if kind not in GPU_KINDS]


def plan(settings: Settings, only: str | None) -> tuple[list[tuple[str, int]], Settings]:
    """(contender, jobs) pairs, one run each per repeat: multi-job runs when jobs > 1, and the
    scaling runs; and the settings, without scaling job counts when they are not run."""
    kinds = (
        default_kinds(settings) if not only else [k.strip() for k in only.split(",") if k.strip()]
    )
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"unknown contenders {sorted(unknown)}; choose from {KINDS}")
    scaled = [kind for kind in SCALED if kind in settings.scaled]
    # The weighted run is its jobs together; any other contender runs one job, then --jobs.
    runs = [
        (kind, len(JOB_WEIGHTS) if kind == WEIGHTS else 1)
        for kind in kinds
        if kind not in (SCALING, COHORT_RUNS)
    ]
    if settings.jobs > 1:
        runs += [(kind, settings.jobs) for kind in scaled if kind in kinds]
    if COHORT_RUNS in kinds:
        # N jobs with the same pipeline, data and sampler seed: in-process, through dalid, and
        # through dalid as one cohort, at each job count.
        runs = add_scaling_runs(runs, settings.scaling_jobs, COHORT_KINDS)
    if SCALING not in kinds and COHORT_RUNS not in kinds:
        return runs, settings.with_(scaling_jobs=())
    if SCALING not in kinds:
        return runs, settings
    return add_scaling_runs(runs, settings.scaling_jobs, scaled), settings


def _step_name(kind: str, jobs: int, repeat: int, repeats: int) -> str:
    name = "transport probes" if kind == "transport" else row_label(kind, jobs)
    return f"{name} (repeat {repeat + 1}/{repeats})"


def _step_result(outcome: Outcome) -> str:
    if outcome.error:
        return "FAILED: " + outcome.error.strip().splitlines()[-1][:120]
    if outcome.kind == "transport":
        return f"done in {outcome.wall_s:.0f} s"
    return f"{run_metrics(outcome)['samples_per_s']:.0f} samples/s ({outcome.wall_s:.0f} s)"


def _run_all(
    runs: list[tuple[str, int]],
    settings: Settings,
    wait_idle: float,
    workdir: Path,
    progress: Progress,
) -> tuple[list[Outcome], list[Outcome]]:
    """Every run of every repeat; returns the outcomes kept and those redone as disturbed."""
    outcomes: list[Outcome] = []
    discarded: list[Outcome] = []
    for repeat in range(settings.repeats):
        # Rotated each repeat, so that no contender always runs first or after the same one.
        shift = repeat % len(runs)
        for kind, jobs in runs[shift:] + runs[:shift]:
            step = _step_name(kind, jobs, repeat, settings.repeats)
            attempts = 1 + (REDO_DISTURBED if wait_idle > 0 else 0)
            for attempt in range(attempts):
                if wait_idle > 0:
                    progress.start(f"{step}: waiting for other processes to go quiet")
                    wait_until_idle(wait_idle)
                progress.start(step)
                outcome = run_once(kind, jobs, repeat, settings, workdir)
                if outcome.foreign_cores <= BUSY_CORES or attempt == attempts - 1:
                    break
                progress.note(f"{step}: other processes used {outcome.foreign_cores:.2f} cores")
                discarded.append(outcome)
            outcomes.append(outcome)
            progress.finish(f"{step}: {_step_result(outcome)}")
    return outcomes, discarded


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    settings = make_settings(args)
    runs, settings = plan(settings, args.only)
    started = time.monotonic()
    created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    progress = Progress(1 + len(runs) * settings.repeats)

    progress.start(f"dataset of {settings.images} images")
    style = JpegStyle.parse(settings.jpeg_subsampling, settings.jpeg_quality)
    dataset = make_imagefolder(
        None, settings.images, settings.classes, settings.seed, style, widths=settings.image_widths
    )
    settings = settings.with_(dataset_root=str(dataset.root))
    machine = describe()
    progress.finish(f"dataset ready: {dataset.root.name}, {dataset.mean_bytes / 1e3:.0f} KB/image")

    workdir = Path(tempfile.mkdtemp(prefix="dalid-bench-"))
    try:
        outcomes, discarded = _run_all(runs, settings, args.wait_idle, workdir, progress)
    except BaseException:
        progress.note(f"stopped; trainer and daemon logs are in {workdir}")
        raise
    # Over the runs only: the time spent waiting for the machine to go quiet does not count.
    foreign = sum(o.foreign_cores * o.wall_s for o in outcomes) / sum(o.wall_s for o in outcomes)

    report: dict[str, Any] = {
        "schema": 1,
        "created_utc": created,
        "command": "python -m bench" + "".join(f" {arg}" for arg in argv),
        "elapsed_s": time.monotonic() - started,
        "settings": settings.describe(),
        "machine": machine,
        "dataset": {
            "root": dataset.root.name,
            "images": len(dataset.paths),
            "classes": settings.classes,
            "jpeg": {"subsampling": style.subsampling, "quality": list(style.quality)},
            "mean_kb": dataset.mean_bytes / 1e3,
        },
        "foreign_cores": foreign,
        "redone_runs": len(discarded),
        "summary": summarize(
            outcomes, gpu=settings.gpu, batch_size=settings.batch_size, profile=settings.profile
        ),
    }
    # LATEST.md is the CPU and GPU profiles' latest full run; the small profile's runs are
    # named by their profile beside it (report.write).
    update_latest = not settings.quick and not args.no_latest and settings.profile != "small"
    written = write(report, outcomes, discarded, args.output, update_latest)
    print(markdown(report))
    failed = [o for o in outcomes if o.error]
    if failed:
        progress.note(f"{len(failed)} run(s) failed; trainer and daemon logs are in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    progress.note("wrote " + ", ".join(str(p) for p in written))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
