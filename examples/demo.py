"""The dalid demo: one daemon, two training jobs sharing it at once.

    ./dev demo [--jobs 2] [--images 160] [--epochs 2]

Generates a small ImageFolder of JPEGs (cut from scikit-learn's sample photographs), starts
`dalid serve` for CPU pipelines, runs the training jobs as separate processes, relays their
progress lines and prints a summary. Everything it starts, it stops.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.dataset import make_imagefolder
from dalid.protocol import endpoint

ROOT = Path(__file__).resolve().parents[1]


def start_daemon(socket: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "dalid.server", "serve", "--socket", str(socket)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while not socket.exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the daemon did not start; its log:\n{log.read_text()}")
        time.sleep(0.1)
    return daemon


def relay(job: subprocess.Popen[str], summaries: list[dict[str, Any]]) -> None:
    assert job.stdout is not None
    for line in job.stdout:
        if line.startswith("SUMMARY "):
            summaries.append(json.loads(line.removeprefix("SUMMARY ")))
        else:
            print(line, end="", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    print(f"dalid demo: {args.jobs} training jobs sharing one daemon (CPU pipelines)")
    dataset = make_imagefolder(num_images=args.images, num_classes=args.classes, seed=0)
    print(
        f"dataset: {len(dataset.paths)} JPEGs in {args.classes} classes, "
        f"{dataset.mean_bytes / 1024:.0f} KB on average, at {dataset.root}"
    )
    workdir = Path(tempfile.mkdtemp(prefix="dalid-demo-"))
    socket = workdir / "cpu.sock"
    daemon = start_daemon(socket, workdir / "daemon.log")
    print(f"daemon: pid {daemon.pid} on {endpoint(socket)}")
    summaries: list[dict[str, Any]] = []
    started = time.perf_counter()
    try:
        jobs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "examples.train_job",
                    "--data",
                    str(dataset.root),
                    "--socket",
                    str(socket),
                    "--name",
                    f"job-{chr(ord('a') + index)}",
                    "--epochs",
                    str(args.epochs),
                    "--seed",
                    str(index),
                ],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for index in range(args.jobs)
        ]
        relays = [threading.Thread(target=relay, args=(job, summaries)) for job in jobs]
        for thread in relays:
            thread.start()
        codes = [job.wait() for job in jobs]
        for thread in relays:
            thread.join()
    finally:
        daemon.send_signal(signal.SIGINT if os.name != "posix" else signal.SIGTERM)
        daemon_code = daemon.wait(30)
    elapsed = time.perf_counter() - started

    print()
    print(
        f"{'job':8} {'images':>7} {'seconds':>8} {'img/s':>7} {'waiting':>8} {'loss':>7}"
        f" {'RSS MiB':>8}"
    )
    for summary in sorted(summaries, key=lambda s: s["name"]):
        print(
            f"{summary['name']:8} {summary['images']:7d} {summary['seconds']:8.1f} "
            f"{summary['images_per_s']:7.1f} {summary['data_wait_fraction']:8.0%} "
            f"{summary['final_loss']:7.3f} {summary['max_rss_mib']:8.0f}"
        )
    print(
        "waiting: the share of a job's time its training loop waited for its next batch "
        "(0%: the data path kept up)"
    )
    total = sum(s["images"] for s in summaries)
    longest = max((s["seconds"] for s in summaries), default=0.0) or 1.0
    print(
        f"all jobs: {total} images, {total / longest:.1f} img/s together through one daemon "
        f"({elapsed:.1f} s with start-up); daemon exited with {daemon_code}"
    )
    failed = [code for code in codes if code != 0]
    if failed or daemon_code != 0 or len(summaries) != args.jobs:
        print(f"demo FAILED (job exit codes {codes}, daemon {daemon_code}); daemon log:")
        print((workdir / "daemon.log").read_text())
        return 1
    for leftover in workdir.iterdir():
        leftover.unlink()
    workdir.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
