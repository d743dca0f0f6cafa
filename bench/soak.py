"""A soak: N jobs through one daemon for M minutes, the daemon's memory sampled as they run.

``python -m bench.soak --jobs 6 --minutes 15`` (the target run; ``--minutes 4`` to look for a
cause). Each job is a trainer process that runs epochs of a shuffled 256-JPEG ImageFolder
(decode, random resized crop, normalize; batch 32) through ``dalid.DataLoader`` with two
DataLoader workers that are not persistent: each epoch forks new workers, which connect to the
daemon anew (new connections and identities every epoch), as a plain training script does.
Every index of every epoch is checked: the sample's label is its index, and an epoch must
bring each index once (the result counts the missing and the duplicated).

The daemon (``python -m bench.soak serve``: ``dalid serve`` with a heap probe) is read every
``--interval`` seconds: its ``RssAnon`` from ``/proc``, and from inside, the Python objects
gc tracks (their number, and the most numerous types); with ``--tracemalloc`` also the
Python heap tracemalloc counts and the lines whose allocations grew most since the jobs
started (tracemalloc slows the daemon: compare slopes with it on or off, not across).

The result (printed, and written as ``bench/results/soak/<time>-soak.json``) says the slope of
RssAnon over the second half of the jobs' time, MiB/min (least squares), and RssAnon after
every job has left against before any joined, each held to its target.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import ctypes.util
import functools
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .daemon import terminate
from .dataset import make_imagefolder
from .machine import describe

# Targets: flat over the second half of a 15-minute 6-job run, and back after the jobs leave.
SLOPE_TARGET_MIB_MIN = 2.0
RETURN_TARGET_MIB = 50.0
TARGET_JOBS, TARGET_MINUTES = 6, 15.0
HEAP_ENV = "DALID_SOAK_HEAP"  # where the daemon's heap probe appends its JSON lines
TRACEMALLOC_ENV = "DALID_SOAK_TRACEMALLOC"
INTERVAL_ENV = "DALID_SOAK_INTERVAL"
# After the last job has left: how long the daemon is given to drop what the jobs held (it
# trims its heap once a job ends) before the reading that is held to the target.
SETTLE_S = 20.0
MIB = 1024 * 1024
RESULTS = Path(__file__).resolve().parent / "results" / "soak"


# --- in the daemon: the heap probe ---------------------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _malloc_reading() -> dict[str, float]:
    """glibc's own account of its heap (``mallinfo2``), MiB: in use by malloc in its arenas
    (``uordblks``), free in them (``fordblks``), and in blocks mapped apart (``hblkhd``);
    empty elsewhere than glibc 2.33+."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError, TypeError):
        return {}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {
        "malloc_used_mib": info.uordblks / MIB,
        "malloc_free_mib": info.fordblks / MIB,
        "malloc_mapped_mib": info.hblkhd / MIB,
    }


def _heap_reading(baseline: tracemalloc.Snapshot | None) -> dict[str, Any]:
    objects = gc.get_objects()
    types = collections.Counter(type(o).__qualname__ for o in objects)
    reading: dict[str, Any] = {
        "t_ns": time.monotonic_ns(),
        "gc_objects": len(objects),
        "types": dict(types.most_common(25)),
        **_malloc_reading(),
    }
    del objects
    if tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot().filter_traces(
            (tracemalloc.Filter(False, tracemalloc.__file__),)
        )
        reading["traced_mib"] = tracemalloc.get_traced_memory()[0] / MIB
        if baseline is not None:
            grew = snapshot.compare_to(baseline, "lineno")[:15]
            reading["grew"] = [
                {
                    "where": str(stat.traceback),
                    "kib": stat.size_diff / 1024,
                    "count": stat.count_diff,
                }
                for stat in grew
            ]
    return reading


def _probe(path: Path, interval_s: float, stop: threading.Event) -> None:
    baseline: tracemalloc.Snapshot | None = None
    with path.open("a") as out:
        while not stop.wait(interval_s):
            ask = path.with_name(path.name + ".collect")
            collected = None
            if ask.exists():  # the orchestrator asks for a full collection once the jobs left
                collected = gc.collect()
                ask.unlink()
            reading = _heap_reading(baseline)
            if collected is not None:
                reading["collected"] = collected
            if baseline is None and tracemalloc.is_tracing():
                baseline = tracemalloc.take_snapshot()
            out.write(json.dumps(reading) + "\n")
            out.flush()


def serve(argv: Sequence[str]) -> int:
    """``dalid serve`` with the heap probe writing to ``$DALID_SOAK_HEAP``."""
    if os.environ.get(TRACEMALLOC_ENV, "0") not in ("", "0"):
        tracemalloc.start(4)
    path = Path(os.environ[HEAP_ENV])
    stop = threading.Event()
    probe = threading.Thread(
        target=_probe,
        args=(path, float(os.environ.get(INTERVAL_ENV, "10")), stop),
        name="bench-heap",
        daemon=True,
    )

    from dalid.server.intake.heap import limit_malloc_arenas as limit
    from dalid.server.operations import cli

    # As bench.threads does: the probe's thread starts once the arena limit is set, so that it
    # gets no malloc arena of its own.
    @functools.wraps(limit)
    def limit_then_probe(arenas: int) -> bool:
        limited = limit(arenas)
        probe.start()
        return limited

    vars(cli)["limit_malloc_arenas"] = limit_then_probe
    try:
        return cli.main(["serve", *argv])
    finally:
        stop.set()


# --- a job -------------------------------------------------------------------------------------


def job(argv: Sequence[str]) -> int:
    """One trainer (``job SOCKET ROOT SECONDS INDEX WORKERS BATCH``): epochs until ``SECONDS``
    have passed, each index checked; its counts as one JSON line on stdout."""
    socket, root = argv[0], argv[1]
    seconds, index, workers, batch = float(argv[2]), int(argv[3]), int(argv[4]), int(argv[5])
    import numpy as np
    from torch.utils.data import Dataset

    import dalid.client as dalid

    from .dataset import read_imagefolder
    from .pipelines import path_pipeline

    class Indexed(Dataset[Any]):
        def __init__(self, proxy: Any) -> None:
            self.proxy = proxy
            folder = read_imagefolder(root)
            self.paths = [np.frombuffer(str(p).encode(), dtype=np.int8) for p in folder.paths]

        def __len__(self) -> int:
            return len(self.paths)

        def __getitem__(self, i: int) -> Any:
            return self.proxy(self.paths[i]), i

    pipe = path_pipeline(batch, 2, False, index)
    counts = {"epochs": 0, "batches": 0, "samples": 0, "missing": 0, "duplicated": 0}
    deadline = time.monotonic() + seconds
    with dalid.connect("cpu", socket, autostart=False, name=f"soak {index}") as session:
        dataset = Indexed(session.proxy(pipe))
        expected = len(dataset) // batch * batch
        loader = dalid.DataLoader(
            session, dataset, batch_size=batch, num_workers=workers, shuffle=True,
            drop_last=True, persistent_workers=False,
        )  # fmt: skip
        while time.monotonic() < deadline:
            seen: collections.Counter[int] = collections.Counter()
            for images, labels in loader:
                if images.shape[0] != batch:
                    raise RuntimeError(f"a batch of {images.shape[0]} samples, not {batch}")
                float(images[:, 0, 0, 0].sum())  # the outputs read, not only mapped
                seen.update(int(label) for label in labels)
                counts["batches"] += 1
            counts["epochs"] += 1
            counts["samples"] += sum(seen.values())
            counts["duplicated"] += sum(seen.values()) - len(seen)
            counts["missing"] += expected - len(seen)
    print(json.dumps(counts), flush=True)
    return 0


# --- the orchestrator --------------------------------------------------------------------------


def rss_anon_mib(pid: int) -> float | None:
    """``RssAnon`` of a live process, MiB; None once it has exited."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return None


def slope_mib_per_min(points: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope of ``(seconds, MiB)`` points, in MiB per minute."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var * 60


def summarize(
    samples: Sequence[tuple[float, float]], before: float, after: float, jobs_s: float
) -> dict[str, Any]:
    """The soak's figures and targets from RssAnon samples taken while jobs ran (seconds
    since they started, MiB), and the readings before any joined and after all left."""
    second_half = [(t, v) for t, v in samples if jobs_s / 2 <= t <= jobs_s]
    slope = slope_mib_per_min(second_half)
    returned = after - before
    return {
        "rss_anon_before_mib": before,
        "rss_anon_after_mib": after,
        "rss_anon_peak_mib": max((v for _, v in samples), default=None),
        "slope_second_half_mib_per_min": slope,
        "targets": [
            {
                "name": f"RssAnon flat over the second half (at most {SLOPE_TARGET_MIB_MIN} "
                "MiB/min)",
                "value": slope,
                "met": None if slope is None else abs(slope) <= SLOPE_TARGET_MIB_MIN,
            },
            {
                "name": f"RssAnon back within {RETURN_TARGET_MIB:.0f} MiB of before the jobs",
                "value": returned,
                "met": returned <= RETURN_TARGET_MIB,
            },
        ],
    }


def _daemon_records(socket: Path) -> dict[str, int]:
    """How many jobs, pipelines and cohorts the daemon still has."""
    from .daemon import DaemonFailed, status_reading

    try:
        status = status_reading(socket)
    except (DaemonFailed, OSError):
        return {}
    return {name: len(status[name]) for name in ("jobs", "pipelines", "cohorts")}


def _daemon_jobs(socket: Path) -> int | None:
    from .daemon import DaemonFailed, status_reading

    try:
        return len(status_reading(socket)["jobs"])
    except (DaemonFailed, OSError):
        return None


@contextlib.contextmanager
def _daemon(directory: Path, heap: Path, interval_s: float, trace: bool) -> Iterator[Any]:
    from .daemon import _answers

    socket = directory / "d.sock"
    env = {**os.environ, HEAP_ENV: str(heap), INTERVAL_ENV: str(interval_s)}
    env[TRACEMALLOC_ENV] = "1" if trace else "0"
    command = [
        sys.executable, "-m", "bench.soak", "serve", "--no-supervisor", "--device", "cpu",
        "--socket", str(socket), "--log-level", "WARNING",
    ]  # fmt: skip
    log = (directory / "daemon.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=log, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (socket.exists() and _answers(socket)):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the daemon did not start: " + _tail(directory / "daemon.log"))
            time.sleep(0.1)
        yield process, socket
    finally:
        terminate(process)
        log.close()


def _tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-15:])
    return "(no log)"


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the soak; its result."""
    folder = make_imagefolder(num_images=args.images, num_classes=8, seed=0)
    directory = Path(tempfile.mkdtemp(prefix="dalids-", dir="/tmp"))
    heap = directory / "heap.jsonl"
    samples: list[tuple[float, float]] = []
    outputs: list[str] = []
    try:
        with _daemon(directory, heap, args.interval, args.tracemalloc) as (process, socket):
            time.sleep(2.0)
            before = rss_anon_mib(process.pid) or 0.0
            print(f"soak: daemon {process.pid}, RssAnon {before:.0f} MiB", file=sys.stderr)
            jobs_s = args.minutes * 60
            start = time.monotonic()
            trainers = [
                subprocess.Popen(
                    [sys.executable, "-m", "bench.soak", "job", str(socket), str(folder.root),
                     str(jobs_s), str(i), str(args.workers), str(args.batch_size)],
                    stdout=subprocess.PIPE, text=True,
                )
                for i in range(args.jobs)
            ]  # fmt: skip
            while any(t.poll() is None for t in trainers):
                value = rss_anon_mib(process.pid)
                elapsed = time.monotonic() - start
                if value is not None:
                    samples.append((elapsed, value))
                    print(f"soak: {elapsed:5.0f} s  RssAnon {value:7.1f} MiB{_last_heap(heap)}",
                          file=sys.stderr)  # fmt: skip
                deadline = time.monotonic() + args.interval
                while time.monotonic() < deadline and any(t.poll() is None for t in trainers):
                    time.sleep(0.5)
            outputs = [t.communicate()[0] for t in trainers]
            failed = [i for i, t in enumerate(trainers) if t.returncode != 0]
            left = time.monotonic()
            while _daemon_jobs(socket) and time.monotonic() - left < 60:
                time.sleep(1.0)
            time.sleep(SETTLE_S)
            after = rss_anon_mib(process.pid) or 0.0
            left_behind = _daemon_records(socket)
            print(f"soak: all jobs gone, RssAnon {after:.0f} MiB{_last_heap(heap)}; {left_behind}",
                  file=sys.stderr)  # fmt: skip
            # What a full collection would give back (not held to the target: a daemon that
            # needs one to shrink is what the target is there to catch).
            heap.with_name(heap.name + ".collect").touch()
            time.sleep(args.interval * 1.5)
            collected = rss_anon_mib(process.pid) or 0.0
            print(f"soak: after a full collection, RssAnon {collected:.0f} MiB{_last_heap(heap)}",
                  file=sys.stderr)  # fmt: skip
        counts = [json.loads(out.strip().splitlines()[-1]) for out in outputs if out.strip()]
        result = summarize(samples, before, after, jobs_s)
        result.update(
            jobs=args.jobs,
            minutes=args.minutes,
            failed_jobs=failed,
            epochs=sum(c["epochs"] for c in counts),
            samples=sum(c["samples"] for c in counts),
            missing=sum(c["missing"] for c in counts),
            duplicated=sum(c["duplicated"] for c in counts),
            rss_anon_after_collection_mib=collected,
            left_behind=left_behind,
            rss_anon=samples,
            heap=_kept_readings(_read_lines(heap)),
            settings={**vars(args), "output": str(args.output)},
            machine=describe(),
        )
        return result
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _last_heap(path: Path) -> str:
    """The heap probe's last reading, as a few words for the progress line."""
    lines = _read_lines(path)
    if not lines:
        return ""
    last = lines[-1]
    words = f"  gc objects {last['gc_objects']}"
    if "malloc_used_mib" in last:
        words += (
            f", malloc used {last['malloc_used_mib']:.0f} free {last['malloc_free_mib']:.0f} "
            f"mapped {last['malloc_mapped_mib']:.0f} MiB"
        )
    if "traced_mib" in last:
        words += f", traced {last['traced_mib']:.1f} MiB"
    return words


def _kept_readings(readings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The probe's readings as the result keeps them: the most numerous types of the first and
    the last only (the figures of every one)."""
    return [
        r if index in (0, len(readings) - 1) else {k: v for k, v in r.items() if k != "types"}
        for index, r in enumerate(readings)
    ]


def _read_lines(path: Path) -> list[dict[str, Any]]:
    with contextlib.suppress(OSError):
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return []


def report(result: dict[str, Any]) -> str:
    """The result as a few lines of text: figures, then each target met or not."""
    lines = [
        f"soak: {result['jobs']} jobs x {result['minutes']:g} min, {result['epochs']} epochs, "
        f"{result['samples']} samples, {result['missing']} missing, "
        f"{result['duplicated']} duplicated, failed jobs: {result['failed_jobs'] or 'none'}",
        f"RssAnon before {result['rss_anon_before_mib']:.0f} MiB, peak "
        f"{result['rss_anon_peak_mib'] or 0:.0f}, after {result['rss_anon_after_mib']:.0f}",
    ]
    heap = result.get("heap") or []
    if len(heap) >= 2:
        lines.append(
            f"gc objects {heap[0]['gc_objects']} -> {heap[-1]['gc_objects']}"
            + (
                f", traced {heap[0]['traced_mib']:.1f} -> {heap[-1]['traced_mib']:.1f} MiB"
                if "traced_mib" in heap[-1]
                else ""
            )
        )
    full = result["jobs"] >= TARGET_JOBS and result["minutes"] >= TARGET_MINUTES
    for target in result["targets"]:
        value = "n/a" if target["value"] is None else f"{target['value']:+.1f}"
        met = {True: "met", False: "NOT met", None: "not measured"}[target["met"]]
        scale = "" if full else f" (a {result['jobs']}-job, {result['minutes']:g}-min run)"
        lines.append(f"  {target['name']}: {value} -> {met}{scale}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    if argv[:1] == ["job"]:
        return job(argv[1:7])
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--jobs", type=int, default=TARGET_JOBS)
    parser.add_argument("--minutes", type=float, default=TARGET_MINUTES)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--tracemalloc", action="store_true", help="trace the daemon's heap")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = soak(args)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / f"{stamp}-soak.json").write_text(json.dumps(result, default=str) + "\n")
    print(report(result))
    failed = result["failed_jobs"] or result["missing"] or result["duplicated"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
