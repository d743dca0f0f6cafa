"""Runs one contender (or the transport probes) as trainer subprocesses, with a daemon if needed.

Concurrent trainers of one run set up first, then start together: each signals readiness on a
pipe of its own, and the orchestrator releases them all with one line on their stdin.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .background import BackgroundLoad
from .busy import BusySampler
from .config import Settings
from .contenders import CONTENDERS
from .daemon import DaemonFailed, QueueWatch, running_daemon
from .machine import LoadMeter
from .memory import MemorySampler, gpu_used_mib
from .weights import QUEUE_INTERVAL_S

REPO = Path(__file__).resolve().parent.parent
SETUP_TIMEOUT_S = 180.0
RUN_TIMEOUT_S = 900.0


@dataclass
class Outcome:
    """One run of one contender: a result per trainer, or the error that stopped it."""

    kind: str
    jobs: int
    repeat: int
    wall_s: float = 0.0
    foreign_cores: float = 0.0  # CPU other processes on the machine used meanwhile
    background_cores: float = 0.0  # CPU the bench's own background load used (--background-load)
    results: list[dict[str, Any]] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)  # see MemorySampler.to_dict
    queues: list[dict[str, Any]] = field(default_factory=list)  # see QueueWatch
    gpu_baseline_mb: float | None = None  # GPU memory in use before the run started
    # Snapshots of what the daemon's own threads used (bench.threads), dalid runs only.
    daemon_threads: list[dict[str, Any]] = field(default_factory=list)
    # The machine's busy ticks from the start signal on (bench.busy): [monotonic ns, ticks].
    busy: list[tuple[int, int]] = field(default_factory=list)
    # The kernel's own threads' ticks meanwhile, about once a second (bench.busy.KernelTicks).
    kernel_busy: list[tuple[int, int]] = field(default_factory=list)
    error: str | None = None


@dataclass
class _Trainer:
    job: int
    process: subprocess.Popen[bytes]
    ready_fd: int
    result: Path
    log: Path

    def error(self) -> str:
        try:
            data = json.loads(self.result.read_text())
            return str(data.get("traceback") or data.get("error"))
        except (OSError, ValueError):
            log = self.log.read_text(errors="replace").splitlines()[-15:]
            return f"trainer {self.job} exited with {self.process.returncode}:\n" + "\n".join(log)


def needs_daemon(kind: str) -> bool:
    return kind == "transport" or CONTENDERS[kind].needs_daemon


def daemon_options(kind: str) -> tuple[str, ...]:
    """Options of ``dalid serve`` for ``kind`` (the transport probes: the defaults)."""
    return () if kind == "transport" else CONTENDERS[kind].daemon_args


def _launch(kind: str, settings: Settings, workdir: Path) -> _Trainer:
    stem = workdir / f"{kind}-j{settings.job}-{time.monotonic_ns()}"
    result, log = stem.with_suffix(".json"), stem.with_suffix(".log")
    read_fd, write_fd = os.pipe()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    command = [
        sys.executable, "-m", "bench.trainer", kind, settings.to_json(), str(result), str(write_fd)
    ]  # fmt: skip
    try:
        with log.open("wb") as out:
            process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=out, stderr=out, pass_fds=(write_fd,),
                cwd=REPO, env=env,
            )  # fmt: skip
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return _Trainer(settings.job, process, read_fd, result, log)


def _wait_ready(trainers: list[_Trainer], timeout: float) -> None:
    """Until every trainer has signalled; a trainer that exits first fails the run."""
    deadline = time.monotonic() + timeout
    pending = {t.ready_fd: t for t in trainers}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"trainers {[t.job for t in pending.values()]} not ready in time")
        readable, _, _ = select.select(list(pending), [], [], left)
        for fd in readable:
            trainer = pending.pop(fd)
            if not os.read(fd, 1):  # end of file: it exited without signalling
                trainer.process.wait()
                raise RuntimeError(trainer.error())


def _stop(trainer: _Trainer) -> None:
    if trainer.process.poll() is None:
        trainer.process.send_signal(signal.SIGTERM)
        try:
            trainer.process.wait(10)
        except subprocess.TimeoutExpired:
            trainer.process.kill()
            trainer.process.wait()
    if trainer.process.stdin:
        with contextlib.suppress(OSError):
            trainer.process.stdin.close()
    with contextlib.suppress(OSError):
        os.close(trainer.ready_fd)


def _run_trainers(
    kind: str, settings: Settings, jobs: int, workdir: Path, outcome: Outcome
) -> None:
    """Runs the trainers into ``outcome``: their results, and for a contender the memory its
    processes used from the start signal on (not for the transport probes: latency)."""
    trainers: list[_Trainer] = []
    try:
        for job in range(jobs):
            trainers.append(_launch(kind, settings.with_(job=job), workdir))
        _wait_ready(trainers, SETUP_TIMEOUT_S)
        sampler = MemorySampler(
            [t.process.pid for t in trainers], settings.daemon_pid, outcome.gpu_baseline_mb
        )
        watch = (
            QueueWatch(Path(settings.socket), QUEUE_INTERVAL_S)
            if kind != "transport" and CONTENDERS[kind].watch_queues
            else None
        )
        busy = BusySampler()
        with (
            busy.running() if kind != "transport" else contextlib.nullcontext(),
            sampler.running() if kind != "transport" else contextlib.nullcontext(),
            watch.running() if watch else contextlib.nullcontext(),
        ):
            for trainer in trainers:
                assert trainer.process.stdin is not None
                trainer.process.stdin.write(b"go\n")
                trainer.process.stdin.flush()
            deadline = time.monotonic() + RUN_TIMEOUT_S
            for trainer in trainers:
                trainer.process.wait(max(1.0, deadline - time.monotonic()))
        outcome.busy, outcome.kernel_busy = busy.samples, busy.kernel
        if sampler.samples:
            outcome.memory = sampler.to_dict()
        if watch:
            outcome.queues = watch.readings
        results = []
        for trainer in trainers:
            if trainer.process.returncode != 0:
                raise RuntimeError(trainer.error())
            results.append(json.loads(trainer.result.read_text()))
        outcome.results = results
    finally:
        for trainer in trainers:
            _stop(trainer)


def run_once(kind: str, jobs: int, repeat: int, settings: Settings, workdir: Path) -> Outcome:
    """Runs ``kind`` as ``jobs`` concurrent trainers; errors are kept in the outcome."""
    outcome = Outcome(kind, jobs, repeat)
    if kind != "transport":
        settings = CONTENDERS[kind].configure(settings)
    started = time.monotonic()
    load = LoadMeter.start()
    outcome.gpu_baseline_mb = gpu_used_mib() if settings.gpu else None
    background = BackgroundLoad(settings.background_load)
    try:
        with background.running():
            if needs_daemon(kind):
                with running_daemon(settings.device, workdir, daemon_options(kind)) as daemon:
                    settings = settings.with_(socket=str(daemon.socket), daemon_pid=daemon.pid)
                    _run_trainers(kind, settings, jobs, workdir, outcome)
                outcome.daemon_threads = daemon.threads
            else:
                _run_trainers(kind, settings, jobs, workdir, outcome)
    except DaemonFailed as error:
        outcome.error = str(error)
    except Exception as error:  # one failed run must not end a long benchmark
        outcome.error = f"{type(error).__name__}: {error}"
    outcome.wall_s = time.monotonic() - started
    outcome.foreign_cores = load.foreign_cores()
    outcome.background_cores = background.cores
    return outcome
