"""A description of the machine and software a result was measured on, and of its load."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy
import torch
import zmq

_TICK = os.sysconf("SC_CLK_TCK")
# Other processes using more CPU than this during a run disturb its measurement.
BUSY_CORES = 0.2
REPO = Path(__file__).resolve().parent.parent


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return None


def _cgroup_limits() -> dict[str, str]:
    """The container's CPU and memory limits (cgroup v2), where there are any."""
    limits = {}
    for name in ("cpu.max", "memory.max"):
        value = _read(f"/sys/fs/cgroup/{name}").strip()
        if value and not value.startswith("max"):
            limits[name] = value
    return limits


def _gpus() -> list[dict[str, str]]:
    if not shutil.which("nvidia-smi"):
        return []
    query = "name,driver_version,memory.total,pci.bus_id"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    keys = query.split(",")
    return [
        dict(zip(keys, (field.strip() for field in line.split(",")), strict=False))
        for line in out.stdout.splitlines()
        if line.strip()
    ]


def gpu_present() -> bool:
    """Whether a CUDA GPU is usable: nvidia-smi lists one, or torch sees one."""
    return bool(_gpus()) or torch.cuda.is_available()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _dali() -> str | None:
    """The installed DALI's version, whichever CUDA build it is."""
    for distribution in ("nvidia-dali-cuda120", "nvidia-dali-cuda130", "nvidia-dali-cuda110"):
        version = _version(distribution)
        if version:
            return f"{version} ({distribution})"
    return None


def _git() -> dict[str, Any]:
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
        return out.stdout.strip()

    # Changes to the benchmark itself do not change what it measures.
    changes = git("status", "--porcelain", "--", ".", ":!bench")
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(changes)}


def describe() -> dict[str, Any]:
    """CPU, memory, GPUs, OS and package versions, as JSON-ready data."""
    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "memory_gib": _memory_gib(),
        "cgroup_limits": _cgroup_limits(),
        "gpus": _gpus(),
        "os": platform.platform(),
        "packages": {
            "python": sys.version.split()[0],
            "dali": _dali(),
            "torch": torch.__version__,
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
            "msgpack": ".".join(str(part) for part in msgpack.version),
            "numpy": numpy.__version__,
            "pillow": _version("pillow"),
            "dalid": _version("dalid"),
        },
        "git": _git(),
    }


def _system_busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores, /proc/stat)."""
    fields = _read("/proc/stat").splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK


def _own_cpu_s() -> float:
    """CPU seconds of this process and every child it has waited for (and theirs)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


@dataclass
class LoadMeter:
    """How busy the machine was with processes that are not the benchmark's own.

    Other work on the machine slows every contender; a result measured beside it says so.
    Exact only once all of the benchmark's children have exited and been waited for.
    """

    wall: float
    busy: float
    own: float

    @classmethod
    def start(cls) -> LoadMeter:
        return cls(time.monotonic(), _system_busy_s(), _own_cpu_s())

    def foreign_cores(self) -> float:
        """Average cores used by other processes since ``start``."""
        wall = time.monotonic() - self.wall
        foreign = (_system_busy_s() - self.busy) - (_own_cpu_s() - self.own)
        return max(0.0, foreign / wall) if wall > 0 else 0.0


def wait_until_idle(timeout_s: float, cores: float = BUSY_CORES, window_s: float = 2.0) -> float:
    """Waits up to ``timeout_s`` for the machine to use fewer than ``cores`` CPU cores (over
    ``window_s``); returns the last reading. Call it when none of the bench's processes run."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy, start = _system_busy_s(), time.monotonic()
        time.sleep(window_s)
        used = (_system_busy_s() - busy) / (time.monotonic() - start)
        if used < cores or time.monotonic() >= deadline:
            return used
