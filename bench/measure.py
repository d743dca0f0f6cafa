"""The timed training loop every contender runs, and the per-process CPU and memory probes.

Time stamps come from ``time.monotonic_ns`` (CLOCK_MONOTONIC, one clock for every process on
the machine), so the stamps of concurrent trainers can be compared with each other. CPU times
come from ``getrusage`` for the trainer itself and from ``/proc/<pid>/stat`` for its worker
processes and the daemon, which keep running while they are read.
"""

from __future__ import annotations

import itertools
import os
import resource
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK")
_PROC = Path("/proc")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process, all threads (0 if it is gone)."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return 0.0
    # Fields after the command name, which may hold spaces and ends at the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


@dataclass(frozen=True)
class ProcStat:
    """One process's (or thread's) user and system CPU seconds and page faults so far."""

    user_s: float = 0.0
    system_s: float = 0.0
    minflt: int = 0
    majflt: int = 0

    def __add__(self, other: ProcStat) -> ProcStat:
        return ProcStat(
            self.user_s + other.user_s,
            self.system_s + other.system_s,
            self.minflt + other.minflt,
            self.majflt + other.majflt,
        )

    def __sub__(self, other: ProcStat) -> ProcStat:
        return ProcStat(
            self.user_s - other.user_s,
            self.system_s - other.system_s,
            self.minflt - other.minflt,
            self.majflt - other.majflt,
        )


def _parse_stat(text: str) -> tuple[str, ProcStat]:
    """The command name and the counters of one ``/proc/.../stat`` line (see proc(5))."""
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return name, ProcStat(
        user_s=int(fields[11]) / _TICK,
        system_s=int(fields[12]) / _TICK,
        minflt=int(fields[7]),
        majflt=int(fields[9]),
    )


def process_stat(pid: int) -> ProcStat:
    """All threads' CPU and page faults of a live process (zeros if it is gone)."""
    try:
        return _parse_stat((_PROC / str(pid) / "stat").read_text())[1]
    except OSError:
        return ProcStat()


def thread_group(name: str) -> str:
    """A thread's name without its trailing number, so a pool's threads count as one group."""
    return name.rstrip("0123456789_-: ") or name


def threads_stat(pid: int) -> dict[str, ProcStat]:
    """A live process's threads' CPU and page faults, summed by :func:`thread_group`.

    A thread that ended before the read is missing here though its time stays in
    :func:`process_stat`: the groups are read at both ends of a window and compared.
    """
    groups: dict[str, ProcStat] = {}
    try:
        tasks = list((_PROC / str(pid) / "task").iterdir())
    except OSError:
        return groups
    for task in tasks:
        try:
            name, stat = _parse_stat((task / "stat").read_text())
        except OSError:
            continue
        group = thread_group(name)
        groups[group] = groups.get(group, ProcStat()) + stat
    return groups


def peak_rss_mb(pid: int) -> float:
    """The high-water mark of a live process's resident memory (VmHWM), in MiB."""
    try:
        for line in (_PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (DataLoader workers and their children)."""
    found: list[int] = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        try:
            tasks = list((_PROC / str(parent) / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found.extend(children)
            stack.extend(children)
    return found


@dataclass(frozen=True)
class Probe:
    """CPU seconds used so far by the trainer, its workers and the daemon, at one instant.

    ``split`` breaks each process's clock down, for telling where a contender's CPU goes:
    by process (``trainer``, ``workers``, ``daemon``) and by thread group within the trainer
    and the daemon (``trainer/<name>``, ``daemon/<name>``: an in-process DALI's threads
    live in the trainer, dalid's in the daemon), each as :class:`ProcStat` fields.
    """

    t_ns: int
    trainer_cpu_s: float
    workers_cpu_s: float
    daemon_cpu_s: float
    split: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def take(cls, daemon_pid: int) -> Probe:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        workers = ProcStat()
        for pid in descendants(os.getpid()):
            workers += process_stat(pid)
        parts = {"trainer": process_stat(os.getpid()), "workers": workers}
        parts.update({f"trainer/{k}": v for k, v in threads_stat(os.getpid()).items()})
        if daemon_pid:
            parts["daemon"] = process_stat(daemon_pid)
            parts.update({f"daemon/{k}": v for k, v in threads_stat(daemon_pid).items()})
        return cls(
            t_ns=time.monotonic_ns(),
            trainer_cpu_s=usage.ru_utime + usage.ru_stime,
            workers_cpu_s=workers.user_s + workers.system_s,
            daemon_cpu_s=parts["daemon"].user_s + parts["daemon"].system_s if daemon_pid else 0.0,
            split={k: asdict(v) for k, v in parts.items()},
        )


@dataclass
class LoopResult:
    """What one trainer saw: batch arrival stamps and resource use in the timed window."""

    contender: str
    job: int
    batch_size: int
    warmup_batches: int
    stamps_ns: list[int]  # arrival of every batch, warm-up included
    start: Probe  # at the arrival of the last warm-up batch
    end: Probe  # at the arrival of the last batch
    first_batch_s: float  # from the start signal to the first batch
    trainer_peak_rss_mb: float
    workers_peak_rss_mb: float  # sum over workers: counts pages they share more than once
    daemon_peak_rss_mb: float
    checksum: float  # keeps the loop's touch of each batch from being optimized away
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def timed_samples(self) -> int:
        return (len(self.stamps_ns) - self.warmup_batches) * self.batch_size

    @property
    def samples_per_s(self) -> float:
        return self.timed_samples / ((self.end.t_ns - self.start.t_ns) / 1e9)

    @property
    def intervals_ms(self) -> list[float]:
        """Time between successive batches in the timed window (the first follows warm-up)."""
        timed = self.stamps_ns[self.warmup_batches - 1 :]
        return [(b - a) / 1e6 for a, b in itertools.pairwise(timed)]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["samples_per_s"] = self.samples_per_s
        data["timed_samples"] = self.timed_samples
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoopResult:
        data = {k: v for k, v in data.items() if k not in ("samples_per_s", "timed_samples")}
        data["start"] = Probe(**data["start"])
        data["end"] = Probe(**data["end"])
        return cls(**data)


Batch = Any
EpochFactory = Callable[[], Iterable[Batch]]


def touch(batch: Batch) -> float:
    """Reads one element of the images and of the labels, as a training step would."""
    images, labels = batch
    return float(images.reshape(-1)[0].item()) + float(labels.reshape(-1)[0].item())


def timed_loop(
    contender: str, epochs: EpochFactory, settings: Any, go_ns: int | None = None
) -> LoopResult:
    """Iterates ``settings.epochs`` epochs of ``epochs()`` and times every batch.

    The first ``settings.warmup_epochs`` epochs warm up (workers start, pipelines fill) and
    are left out of throughput and CPU figures; latency intervals start at the last warm-up
    batch. ``go_ns`` is when the trainer was told to start.
    """
    go_ns = time.monotonic_ns() if go_ns is None else go_ns
    warmup_batches = settings.warmup_epochs * settings.batches_per_epoch
    total = settings.epochs * settings.batches_per_epoch
    if warmup_batches < 1 or total <= warmup_batches:
        raise ValueError("need at least one warm-up batch and one timed batch")
    stamps: list[int] = []
    checksum = 0.0
    start: Probe | None = None
    for _ in range(settings.epochs):
        # Every contender drops the last partial batch, so each epoch has the same batches.
        for batch in epochs():
            checksum += touch(batch)
            del batch  # a dalid output goes back to the daemon once no tensor views it
            stamps.append(time.monotonic_ns())
            if len(stamps) == warmup_batches:
                start = Probe.take(settings.daemon_pid)
    end = Probe.take(settings.daemon_pid)
    if start is None or len(stamps) != total:
        raise RuntimeError(f"{contender}: got {len(stamps)} batches, expected {total}")
    # The workers are still alive here, so their high-water marks can still be read.
    workers = descendants(os.getpid())
    return LoopResult(
        contender=contender,
        job=settings.job,
        batch_size=settings.batch_size,
        warmup_batches=warmup_batches,
        stamps_ns=stamps,
        start=start,
        end=end,
        first_batch_s=(stamps[0] - go_ns) / 1e9,
        trainer_peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        workers_peak_rss_mb=sum(peak_rss_mb(pid) for pid in workers),
        daemon_peak_rss_mb=peak_rss_mb(settings.daemon_pid) if settings.daemon_pid else 0.0,
        checksum=checksum,
    )
