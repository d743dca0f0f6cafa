"""Memory of a run's processes, sampled by the orchestrator while the trainers run.

Resident sizes (RSS) count a page once per process that maps it: DataLoader workers share
most of their pages with the trainer they forked from, and a dalid trainer maps the daemon's
shared-memory slabs, so a sum of RSS overstates. The sampler therefore also reads PSS
(proportional set size, ``/proc/<pid>/smaps_rollup``), which divides each shared page among
the processes that map it, so that PSS adds up across processes. Beside them: the daemon's
high-water mark (``VmHWM``), the bytes its ``/dev/shm`` segments hold, and, with
a GPU, the GPU memory in use (``nvidia-smi``, over the reading before the run) and each process's
share of it (``nvidia-smi --query-compute-apps``): the trainers with their workers, and the
daemon.

Where the PSS is: each sample also adds it up by role (the daemon; trainers; DataLoader
workers, a trainer's children; other, their descendants) and by kind of page, as
``smaps_rollup`` splits it: anonymous (heaps, the private pages a worker copied from its
trainer), file-backed (mapped libraries and files) and shared memory (``/dev/shm`` slabs).

Why one module of some 420 lines: a sample is read once from ``/proc`` and its totals, roles
and kinds of page come from that one reading; split apart, two readers would disagree on
which processes a sample counted.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dalid.protocol import slabs

from .measure import descendants

_PROC = Path("/proc")
INTERVAL_S = 1.0
# Reading PSS walks a process's page tables, about 1 ms of CPU per 100 MiB resident: with many
# jobs the sampler waits longer between samples, so that it takes at most this much of a core.
MAX_CPU_SHARE = 0.05
MIB = 1024 * 1024


def _kib_fields(path: Path, names: Sequence[str]) -> dict[str, float]:
    """``Name:  123 kB`` lines of a /proc file, in MiB; empty when the file cannot be read."""
    found: dict[str, float] = {}
    try:
        text = path.read_text()
    except OSError:  # the process has exited, or smaps_rollup is missing (Linux < 4.14)
        return found
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in names:
            found[name] = int(rest.split()[0]) / 1024
    return found


def process_memory(pid: int) -> tuple[float, float | None, float]:
    """RSS, PSS (None where the kernel does not say) and VmHWM of a live process, in MiB."""
    reading = process_reading(pid)
    return reading.rss, reading.pss, reading.hwm


# The roles of a run's processes, as the breakdown names them.
DAEMON, TRAINER, WORKER, OTHER = "daemon", "trainer", "worker", "other"
ROLES = (DAEMON, TRAINER, WORKER, OTHER)
# smaps_rollup's split of PSS by kind of page (Linux 5.4 on): anonymous, file-backed, shared
# memory (shmem and tmpfs, /dev/shm among them).
_KINDS = {"Pss_Anon": "anon", "Pss_File": "file", "Pss_Shmem": "shmem"}
# Each role's figures in a sample: how many processes, their PSS, and its split.
ROLE_FIGURES = ("processes", "pss_mb", *(f"{kind}_mb" for kind in _KINDS.values()))


@dataclass(frozen=True)
class ProcessReading:
    """One process's memory, in MiB; PSS and its split None where the kernel does not say."""

    rss: float
    pss: float | None
    hwm: float
    kinds: dict[str, float]  # anon, file, shmem: what smaps_rollup says of them


def process_reading(pid: int) -> ProcessReading:
    """RSS, VmHWM, PSS and PSS by kind of page of a live process (RSS 0: no such process)."""
    status = _kib_fields(_PROC / str(pid) / "status", ("VmRSS", "VmHWM"))
    rollup = _kib_fields(_PROC / str(pid) / "smaps_rollup", ("Pss", *_KINDS))
    kinds = {kind: rollup[name] for name, kind in _KINDS.items() if name in rollup}
    return ProcessReading(
        status.get("VmRSS", 0.0), rollup.get("Pss"), status.get("VmHWM", 0.0), kinds
    )


def parent_pid(pid: int) -> int | None:
    """The parent of a live process (``/proc/PID/stat``), None when it has exited."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name, in parentheses, may hold spaces and parentheses: fields follow the last.
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def role_of(pid: int, trainer_pids: Sequence[int], daemon_pid: int) -> str:
    """A run's process by role: the daemon, a trainer, a DataLoader worker (a trainer's
    child), or other (a worker's own children, and anything else)."""
    if pid == daemon_pid:
        return DAEMON
    if pid in trainer_pids:
        return TRAINER
    return WORKER if parent_pid(pid) in trainer_pids else OTHER


def by_role(readings: dict[int, tuple[str, ProcessReading]]) -> dict[str, dict[str, float]]:
    """The PSS of live processes (``pid: (role, reading)``) summed by role and kind of page,
    every role present (zeros where none ran); a process without PSS is left out."""
    totals = {role: dict.fromkeys(ROLE_FIGURES, 0.0) for role in ROLES}
    for role, reading in readings.values():
        if reading.pss is None:
            continue
        figures = totals[role]
        figures["processes"] += 1
        figures["pss_mb"] += reading.pss
        for kind, value in reading.kinds.items():
            figures[f"{kind}_mb"] += value
    return totals


# glibc maps each heap of an arena other than the main one as 64 MiB (HEAP_MAX_SIZE on 64-bit)
# aligned to its size, read-write as far as it has grown and inaccessible beyond.
_ARENA_HEAP = 64 * MIB


def malloc_arenas(pid: int) -> int | None:
    """How many heaps of glibc malloc arenas besides the main one a live process maps (one per
    arena until an arena outgrows 64 MiB), told from ``/proc/PID/maps`` by their shape; None
    when the process has exited."""
    try:
        lines = (_PROC / str(pid) / "maps").read_text().splitlines()
    except OSError:
        return None
    regions = []
    for line in lines:
        fields = line.split()
        low, _, high = fields[0].partition("-")
        # An anonymous mapping has no path, and inode 0.
        regions.append((int(low, 16), int(high, 16), fields[1], len(fields) == 5))
    heaps = 0
    for index, (start, end, mode, anonymous) in enumerate(regions):
        if not anonymous or mode != "rw-p" or start % _ARENA_HEAP:
            continue
        if end - start == _ARENA_HEAP:
            heaps += 1
            continue
        after = regions[index + 1] if index + 1 < len(regions) else None
        if (
            after
            and after[3]
            and after[2] == "---p"
            and (after[0], after[1])
            == (
                end,
                start + _ARENA_HEAP,
            )
        ):
            heaps += 1
    return heaps


def shm_mib(daemon_pid: int) -> float:
    """Memory held by the daemon's shared-memory segments (allocated pages, not their sizes)."""
    total = 0
    for path, record in slabs.user_segments():
        if record.pid != daemon_pid:
            continue
        with contextlib.suppress(OSError):  # a segment unlinked meanwhile
            total += path.stat().st_blocks * 512
    return total / MIB


def gpu_used_mib() -> float | None:
    """GPU memory in use on every GPU together (``nvidia-smi``), or None without one."""
    reading = gpu_reading()
    return None if reading is None else reading[0]


def gpu_reading() -> tuple[float, float | None] | None:
    """GPU memory in use on every GPU together, MiB, and how busy they were, % (the mean over
    GPUs of ``utilization.gpu``: the share of the last sample period, 1/6 s to 1 s, in which
    a kernel ran); None without ``nvidia-smi`` or when it fails."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used,utilization.gpu",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_gpu_reading(out.stdout)


def parse_gpu_reading(text: str) -> tuple[float, float | None] | None:
    """``MiB, %`` lines of ``nvidia-smi --query-gpu=memory.used,utilization.gpu`` (csv, no
    header, no units), one per GPU; a utilisation it cannot read ([N/A]) leaves it None."""
    if not text.strip():
        return None
    used, busy = 0.0, []
    for line in text.strip().splitlines():
        memory, _, utilization = (part.strip() for part in line.partition(","))
        try:
            used += float(memory)
        except ValueError:
            return None
        with contextlib.suppress(ValueError):  # [N/A]: this GPU cannot say
            busy.append(float(utilization))
    return used, (sum(busy) / len(busy) if busy else None)


def gpu_process_mib() -> dict[int, float] | None:
    """GPU memory each process uses (``nvidia-smi --query-compute-apps``), by pid; None without
    nvidia-smi or when it fails."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_compute_apps(out.stdout)


def parse_compute_apps(text: str) -> dict[int, float]:
    """``pid, MiB`` lines of ``nvidia-smi --query-compute-apps=pid,used_memory`` (csv, no
    header, no units), summed per pid (a process on several GPUs); "[N/A]" lines are left out."""
    found: dict[int, float] = {}
    for line in text.splitlines():
        pid, _, used = (part.strip() for part in line.partition(","))
        try:
            found[int(pid)] = found.get(int(pid), 0.0) + float(used)
        except ValueError:
            continue
    return found


def _gpu_shares(
    processes: dict[int, float] | None, trainer_pids: Sequence[int], daemon_pid: int
) -> tuple[float | None, float | None, float | None]:
    """GPU MiB of the trainers with their workers, of the daemon, and of both; None where
    nvidia-smi names none of them (no GPU, or another pid namespace than ours)."""
    if not processes or not any(pid in processes for pid in (*trainer_pids, daemon_pid)):
        return None, None, None
    trainers = sum(processes.get(pid, 0.0) for pid in trainer_pids)
    daemon = processes.get(daemon_pid, 0.0) if daemon_pid else None
    return trainers, daemon, trainers + (daemon or 0.0)


@dataclass(frozen=True)
class MemorySample:
    """One reading of every process of a run, in MiB; None where it cannot be read."""

    t_ns: int
    processes: int  # trainers and their workers
    trainers_rss_mb: float  # trainers and their workers: a sum of RSS, which overstates
    trainers_pss_mb: float | None
    daemon_rss_mb: float | None
    daemon_pss_mb: float | None
    daemon_hwm_mb: float | None
    daemon_shm_mb: float | None
    gpu_mb: float | None  # over the reading before the run started
    all_pss_mb: float | None  # trainers, workers and daemon: PSS adds up across processes
    # Per process (nvidia-smi --query-compute-apps): the trainers and their workers, the daemon.
    trainers_gpu_mb: float | None = None
    daemon_gpu_mb: float | None = None
    all_gpu_mb: float | None = None
    # How busy the GPUs were (nvidia-smi's utilization.gpu, %): what a daemon that keeps its
    # GPU busy shows.
    gpu_busy_pct: float | None = None
    # PSS by role and kind of page (see by_role): where all_pss_mb is.
    roles: dict[str, dict[str, float]] | None = None
    # The daemon's malloc arenas besides the main one (malloc_arenas): 0 under its default
    # limit of one (dalid serve --malloc-arenas).
    daemon_arenas: int | None = None

    @classmethod
    def take(
        cls, trainer_pids: Sequence[int], daemon_pid: int, gpu_baseline: float | None
    ) -> MemorySample:
        pids = [p for trainer in trainer_pids for p in (trainer, *descendants(trainer))]
        readings = {pid: process_reading(pid) for pid in pids}
        live = [reading for reading in readings.values() if reading.rss > 0]
        # A process that exits between the two reads has an RSS and no PSS: leave it out.
        pss = [reading.pss for reading in live if reading.pss is not None]
        trainers_pss = sum(pss) if pss or not live else None
        daemon = process_reading(daemon_pid) if daemon_pid else None
        daemon_pss = daemon.pss if daemon else 0.0
        roled = {
            pid: (role_of(pid, trainer_pids, daemon_pid), reading)
            for pid, reading in readings.items()
            if reading.rss > 0
        }
        if daemon is not None and daemon.rss > 0:
            roled[daemon_pid] = (DAEMON, daemon)
        missing = trainers_pss is None or daemon_pss is None
        reading = gpu_reading() if gpu_baseline is not None else None
        gpu, busy = reading if reading is not None else (None, None)
        processes = gpu_process_mib() if gpu_baseline is not None else None
        trainers_gpu, daemon_gpu, all_gpu = _gpu_shares(processes, pids, daemon_pid)
        return cls(
            t_ns=time.monotonic_ns(),
            processes=len(live),
            trainers_rss_mb=sum(reading.rss for reading in live),
            trainers_pss_mb=trainers_pss,
            daemon_rss_mb=daemon.rss if daemon else None,
            daemon_pss_mb=daemon.pss if daemon else None,
            daemon_hwm_mb=daemon.hwm if daemon else None,
            daemon_shm_mb=shm_mib(daemon_pid) if daemon_pid else None,
            gpu_mb=None if gpu is None or gpu_baseline is None else gpu - gpu_baseline,
            all_pss_mb=None if missing else (trainers_pss or 0.0) + (daemon_pss or 0.0),
            trainers_gpu_mb=trainers_gpu,
            daemon_gpu_mb=daemon_gpu,
            all_gpu_mb=all_gpu,
            gpu_busy_pct=busy,
            roles=by_role(roled),
            daemon_arenas=malloc_arenas(daemon_pid) if daemon_pid else None,
        )


class MemorySampler:
    """Samples a run's processes on a thread from start to stop: every ``interval_s``, or
    less often when a sample costs more than ``MAX_CPU_SHARE`` of that in CPU time."""

    def __init__(
        self,
        trainer_pids: Sequence[int],
        daemon_pid: int,
        gpu_baseline: float | None,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self.trainer_pids = list(trainer_pids)
        self.daemon_pid = daemon_pid
        self.gpu_baseline = gpu_baseline
        self.interval_s = interval_s
        self.samples: list[MemorySample] = []
        self.cpu_s = 0.0  # what sampling cost, on the orchestrator's CPU
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-memory", daemon=True)

    def _run(self) -> None:
        while True:
            started = time.thread_time()
            self.samples.append(
                MemorySample.take(self.trainer_pids, self.daemon_pid, self.gpu_baseline)
            )
            cost = time.thread_time() - started
            self.cpu_s += cost
            if self._stop.wait(max(self.interval_s, cost / MAX_CPU_SHARE)):
                return

    @contextlib.contextmanager
    def running(self) -> Iterator[MemorySampler]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()

    def to_dict(self) -> dict[str, Any]:
        return {
            "interval_s": self.interval_s,
            "sampler_cpu_s": self.cpu_s,
            "samples": [asdict(sample) for sample in self.samples],
        }


# --- from samples to figures -------------------------------------------------------------------

FIELDS = (
    "trainers_rss_mb", "trainers_pss_mb", "daemon_rss_mb", "daemon_pss_mb", "daemon_shm_mb",
    "gpu_mb", "all_pss_mb", "trainers_gpu_mb", "daemon_gpu_mb", "all_gpu_mb",
)  # fmt: skip
# The figures memory_metrics returns: each field's median in the window and its peak, and
# how busy the GPU was in the window (median).
# Where the PSS is: ``role_<role>_<figure>``, each the median in the window.
ROLE_METRICS = tuple(f"role_{role}_{figure}" for role in ROLES for figure in ROLE_FIGURES)
METRICS = (
    *FIELDS, *(name.replace("_mb", "_peak_mb") for name in FIELDS), "daemon_peak_rss_mb",
    "gpu_busy_pct", *ROLE_METRICS,
)  # fmt: skip


def memory_metrics(memory: dict[str, Any], start_ns: int, end_ns: int) -> dict[str, Any]:
    """Per field, the median over the samples in ``[start_ns, end_ns]`` (the timed window; the
    sample nearest to its middle when none falls in it) and the peak over all samples; None
    where unread. The daemon's peak RSS is its own high-water mark, set-up included."""
    samples = list(memory.get("samples", []))
    inside = [s for s in samples if start_ns <= s["t_ns"] <= end_ns]
    if not inside and samples:
        # A short window between two samples: before it pools are still filling, after it
        # jobs have ended and released theirs.
        middle = (start_ns + end_ns) / 2
        inside = [min(samples, key=lambda s: abs(s["t_ns"] - middle))]
    metrics: dict[str, Any] = {"samples": len(samples), "window_samples": len(inside)}
    for name in FIELDS:
        # .get: samples of runs recorded before a field existed lack it.
        steady = [s[name] for s in inside if s.get(name) is not None]
        every = [s[name] for s in samples if s.get(name) is not None]
        metrics[name] = statistics.median(steady) if steady else None
        metrics[name.replace("_mb", "_peak_mb")] = max(every) if every else None
    busy = [s["gpu_busy_pct"] for s in inside if s.get("gpu_busy_pct") is not None]
    metrics["gpu_busy_pct"] = statistics.median(busy) if busy else None
    hwm = [s["daemon_hwm_mb"] for s in samples if s["daemon_hwm_mb"] is not None]
    metrics["daemon_peak_rss_mb"] = max(hwm) if hwm else None
    roles = [s["roles"] for s in inside if s.get("roles")]
    for role in ROLES:
        for figure in ROLE_FIGURES:
            values = [r[role][figure] for r in roles if role in r]
            metrics[f"role_{role}_{figure}"] = statistics.median(values) if values else None
    return metrics
