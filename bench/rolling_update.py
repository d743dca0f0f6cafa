"""The stall a job sees across a rolling update of its daemon.

    python -m bench.rolling_update                 # 1 and 8 jobs, 3 updates each
    python -m bench.rolling_update --jobs 1,8 --updates 3 --workers 2

Each job is a trainer with ``reconnect=True`` and a DataLoader of ``--workers`` workers on a
tiny CPU pipeline, taking a batch every ``--step-seconds``; it prints the time of every batch.
Once every job is running, an update is what systemd and Kubernetes do: SIGTERM to ``dalid
serve``, and once it has exited, a new ``dalid serve`` on the same socket. For each job the
stall is the time from the SIGTERM to its next batch; the new daemon's start-up is the time
from its launch to its first answer to a ping. The target (docs/deployment.md, Upgrades): a
stall at most 5 s beyond the start-up. Prints a table, and with ``--json`` the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

TARGET_BEYOND_STARTUP_S = 5.0
BATCH = 8


@dataclass(frozen=True)
class Row:
    jobs: int
    updates: int
    startup_s: float  # median new daemon's start-up
    stall_median_s: float  # SIGTERM -> a job's next batch, over jobs and updates
    stall_max_s: float
    beyond_startup_median_s: float  # the stall less the start-up of that update's daemon
    beyond_startup_max_s: float


# --- the job ------------------------------------------------------------------------------------


def job(socket: str, workers: int, step_seconds: float) -> int:
    """A trainer that runs until killed, printing ``batch <time>`` for each batch."""
    import numpy as np
    import torch

    import dalid.client as dalid

    from .pipelines import tiny_pipeline

    class Samples(torch.utils.data.Dataset[object]):
        def __init__(self, proxy: dalid.Proxy) -> None:
            self.proxy = proxy

        def __len__(self) -> int:
            return 64 * BATCH

        def __getitem__(self, index: int) -> object:
            return self.proxy(np.full((16,), index, dtype=np.int32))

    with dalid.connect(socket=socket, autostart=False, reconnect=True, name="rolling") as session:
        loader = dalid.DataLoader(
            session,
            Samples(session.proxy(tiny_pipeline(BATCH))),
            batch_size=BATCH,
            num_workers=workers,
        )
        while True:
            for _ in loader:
                print(f"batch {time.time():.4f}", flush=True)
                time.sleep(step_seconds)


# --- the driver ---------------------------------------------------------------------------------


def _serve(socket: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "dalid.server", "serve", "--socket", str(socket)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _answers(socket: Path) -> bool:
    """Whether a daemon answers a ping on ``socket`` (in this process: a `dalid ping` process
    would take longer to start than the daemon takes to answer)."""
    import zmq

    from dalid.protocol import Ping, Pong, endpoint, transport

    context = zmq.Context()
    sock = transport.make_socket(context, zmq.DEALER, endpoint(socket), bind=False)
    try:
        transport.send(sock, Ping(), 1)
        return bool(sock.poll(500)) and isinstance(transport.recv(sock).message, Pong)
    except (zmq.ZMQError, OSError):
        return False
    finally:
        sock.close(linger=0)
        context.term()


def _wait_answering(socket: Path, timeout: float = 120.0) -> float:
    """Waits until a daemon answers on ``socket``; the time it first did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if socket.exists() and _answers(socket):
            return time.time()
        time.sleep(0.01)
    raise RuntimeError(f"no daemon answered on {socket} within {timeout:.0f} s")


class Job:
    """A job process, its batches' times read by a thread of its own."""

    def __init__(self, socket: Path, workers: int, step_seconds: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.rolling_update", "--job", "--socket", str(socket),
             "--workers", str(workers), "--step-seconds", str(step_seconds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        self.batches: queue.Queue[float] = queue.Queue()
        self.said: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("batch "):
                self.batches.put(float(line.split()[1]))
            else:
                self.said.append(line)

    def next_batch_after(self, moment: float, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError("a job made no batch in time:\n" + "".join(self.said[-20:]))
            try:
                at = self.batches.get(timeout=left)
            except queue.Empty:
                continue
            if at > moment:
                return at

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join(5)


def measure(jobs: int, updates: int, workers: int, step_seconds: float) -> Row:
    directory = Path(tempfile.mkdtemp(prefix="dlr-", dir="/tmp"))
    socket = directory / "d.sock"
    log = directory / "d.log"
    daemon = _serve(socket, log)
    running: list[Job] = []
    stalls: list[float] = []
    beyond: list[float] = []
    startups: list[float] = []
    try:
        _wait_answering(socket)
        running = [Job(socket, workers, step_seconds) for _ in range(jobs)]
        for each in running:  # every job under way
            each.next_batch_after(0.0, timeout=300)
        for _ in range(updates):
            time.sleep(1.0)
            stopped_at = time.time()
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
            launched = time.time()
            daemon = _serve(socket, log)
            up = _wait_answering(socket)
            startup = up - launched
            startups.append(startup)
            for each in running:
                at = each.next_batch_after(stopped_at, timeout=120)
                stalls.append(at - stopped_at)
                beyond.append(at - stopped_at - (up - stopped_at))
    finally:
        for each in running:
            each.stop()
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
        shutil.rmtree(directory, ignore_errors=True)
    return Row(
        jobs=jobs,
        updates=updates,
        startup_s=round(statistics.median(startups), 2),
        stall_median_s=round(statistics.median(stalls), 2),
        stall_max_s=round(max(stalls), 2),
        beyond_startup_median_s=round(statistics.median(beyond), 2),
        beyond_startup_max_s=round(max(beyond), 2),
    )


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| jobs | updates | new daemon's start-up (s) | stall, median / max (s) | beyond the "
        "start-up, median / max (s) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.jobs} | {row.updates} | {row.startup_s:.1f} | {row.stall_median_s:.1f} / "
            f"{row.stall_max_s:.1f} | {row.beyond_startup_median_s:.1f} / "
            f"{row.beyond_startup_max_s:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rolling_update", description=__doc__)
    parser.add_argument("--jobs", default="1,8", help="job counts, comma-separated (1,8)")
    parser.add_argument("--updates", type=int, default=3, help="updates per job count (3)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers a job (2)")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="a training step (0.05)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        return job(args.socket, args.workers, args.step_seconds)
    rows = []
    for count in (int(n) for n in args.jobs.split(",")):
        print(f"{count} job(s), {args.updates} update(s)...", file=sys.stderr, flush=True)
        rows.append(measure(count, args.updates, args.workers, args.step_seconds))
    print(f"machine: {os.cpu_count()} cores; target: a stall at most "
          f"{TARGET_BEYOND_STARTUP_S:g} s beyond the new daemon's start-up")  # fmt: skip
    print(table(rows))
    if args.json:
        print(json.dumps([asdict(row) for row in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
