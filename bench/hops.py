"""Where one round trip's time goes, hop by hop: ``python -m bench.hops``.

The transport probe (:mod:`bench.transport`) times a tiny batch from the proxy call to its
tensor. This breaks that time down. It runs tiny batches one at a time through the real client
path against a daemon subprocess (``--files``: samples that are file paths, read in DALI, which
adds the daemon's checks of paths), twice:

- untraced, to read what each thread of both processes spends per round trip: CPU time
  (``/proc/<pid>/task/<tid>/stat``) and context switches (``.../status``), and the round trip's
  p50 and p99;
- traced, with time stamps (``time.monotonic_ns``, one clock for every process) taken on entry
  to and exit from the functions each hop passes through, in the client and in the daemon
  (``python -m bench.hops serve ...`` installs them in a daemon, then runs ``dalid serve``).
  The stamps of each round trip are matched by time, and each hop's median over the round
  trips is shown, with the median time from the proxy call to the hop's end.

Tracing wraps functions in place: it adds about a microsecond per stamp, some 40 per round
trip, and knows the names of the functions it wraps, so it follows the code it measures.

``--steps`` runs a third daemon (``python -m bench.hops steps ...``) whose executor threads
count their own CPU time (``time.thread_time_ns``) in each step of a run: forming it
(``RunPlanner.next_run``, and in it the batch's checks, ``prepare``, and the looks at the
jobs, ``_pick``), DALI's calls, the run's account, the slots given back, the delivery (and in
it the output copy and the result's answer) and DALI's calls' note to the flight recorder
(``_holds_runs``). Each step's median a call and its calls a run are shown: the median
leaves out the warm-up's first calls and the rare slow one; a probe adds about a microsecond.

Why one module of some 560 lines: the stamps, the step counts and the round trips over which
they are read change together; a probe is of no use without the run that reads it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .daemon import terminate

TRACE_ENV = "DALID_BENCH_TRACE"
STEPS_ENV = "DALID_BENCH_STEPS"
_TICK = os.sysconf("SC_CLK_TCK")

Events = list[tuple[int, str]]
EVENTS: Events = []

# (hop, the event it starts at, the event it ends at); events are "<where>:<what>" with ">"
# for a function's entry and "<" for its exit.
HOPS = [
    (
        "worker: proxy calls and collate, until the submission is sent",
        "step>",
        "c.send:submit_batch>",
    ),
    (
        "worker: read the last batch's batch_accepted, before sending",
        "c.settle>",
        "c.settle<",
    ),
    ("worker: encode and send submit_batch", "c.send:submit_batch>", "c.send:submit_batch<"),
    ("ZeroMQ: worker -> the daemon's I/O thread", "c.send:submit_batch>", "d.decode>"),
    ("daemon I/O: decode submit_batch", "d.decode>", "d.decode<:submit_batch"),
    (
        "daemon I/O: handle it (checks, admission, queue)",
        "d.handle:submit_batch>",
        "d.handle:submit_batch<",
    ),
    (
        "daemon I/O: encode and send batch_accepted",
        "d.send:batch_accepted>",
        "d.send:batch_accepted<",
    ),
    ("ZeroMQ: batch_accepted -> the worker", "d.send:batch_accepted>", "c.recv:batch_accepted"),
    ("executor: wakes and forms the run", "d.queue<", "x.run"),
    ("executor: feed DALI and start the run", "x.schedule>", "x.schedule<"),
    ("DALI: the run, until its outputs are out", "x.collect>", "x.collect<"),
    ("executor: account, slots, copy-out, batch_ready", "x.collect<", "d.push"),
    ("executor: encode and send batch_ready", "d.push", "d.send_now:batch_ready<"),
    ("ZeroMQ: batch_ready -> the trainer", "d.send_now:batch_ready>", "c.recv:batch_ready"),
    ("trainer: map and wrap the outputs as tensors", "c.tensors>", "c.tensors<"),
    ("trainer: the rest, until the round trip ends", "c.tensors<", "step<"),
    (
        "trainer: release_regions sent (a notification)",
        "c.send:release_regions>",
        "c.send:release_regions<",
    ),
    (
        "daemon I/O: release_regions handled",
        "d.decode<:release_regions",
        "d.handle:release_regions<",
    ),
]


# --- tracing ------------------------------------------------------------------------------------


def _stamp(name: str) -> None:
    EVENTS.append((time.monotonic_ns(), name))


def _wrap(owner: Any, attr: str, name: str, label: Callable[..., str] | None = None) -> None:
    """Stamps entry to and exit from ``owner.attr``; ``label`` adds what it was called with."""
    function = getattr(owner, attr)

    @functools.wraps(function)
    def traced(*args: Any, **kwargs: Any) -> Any:
        stamp = name if label is None else f"{name}:{label(*args, **kwargs)}"
        EVENTS.append((time.monotonic_ns(), stamp + ">"))
        try:
            return function(*args, **kwargs)
        finally:
            EVENTS.append((time.monotonic_ns(), stamp + "<"))

    setattr(owner, attr, traced)


def _op(*args: Any, **_: Any) -> str:
    return next((arg.OP for arg in args if hasattr(arg, "OP")), "?")


def trace_daemon() -> None:
    """Stamps in the daemon process: its I/O thread and its executors."""
    from dalid.protocol import Message, transport
    from dalid.server.handling import core
    from dalid.server.intake import daemon, reception, shared_socket
    from dalid.server.pipelines import runner
    from dalid.server.runs import delivery, run_planner

    decode = reception.decode  # type: ignore[attr-defined]  # the reception's own name

    def traced_decode(frames: Any) -> Any:
        _stamp("d.decode>")
        envelope = decode(frames)
        _stamp(f"d.decode<:{envelope.message.OP}")
        return envelope

    reception.decode = traced_decode  # type: ignore[attr-defined]
    _wrap(core.DaemonCore, "handle", "d.handle", lambda self, peer, message, rid: message.OP)
    _wrap(transport, "send_to", "d.send", _op)
    _wrap(run_planner.RunPlanner, "submit", "d.queue")
    push = daemon.Daemon.push

    def traced_push(
        self: daemon.Daemon, identity: bytes, message: Message, request_id: int | None = None
    ) -> None:
        _stamp("d.push")
        push(self, identity, message, request_id)

    daemon.Daemon.push = traced_push  # type: ignore[method-assign]
    _wrap(shared_socket.SharedSocket, "_send_now", "d.send_now", _op)
    next_run = run_planner.RunPlanner.next_run

    def traced_next_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        run = next_run(self, *args, **kwargs)
        if run is not None:
            _stamp("x.run")
        return run

    run_planner.RunPlanner.next_run = traced_next_run  # type: ignore[method-assign]
    _wrap(runner.PipelineRunner, "schedule", "x.schedule")
    _wrap(runner.PipelineRunner, "collect", "x.collect")
    _wrap(delivery.Delivery, "deliver", "x.deliver")


def trace_client() -> None:
    """Stamps in this process: the worker's and the trainer's side."""
    from dalid.client import delivery
    from dalid.client.link import connection
    from dalid.client.worker import submitter

    _wrap(connection.Connection, "_send", "c.send", lambda self, message, rid: message.OP)
    _wrap(submitter.Submitter, "settle", "c.settle")
    recv = connection.Connection._recv

    def traced_recv(self: Any, sock: Any) -> Any:
        envelope = recv(self, sock)
        _stamp(f"c.recv:{envelope.message.OP}")
        return envelope

    connection.Connection._recv = traced_recv  # type: ignore[method-assign]
    _wrap(delivery.Delivery, "_tensors", "c.tensors")


def serve(argv: Sequence[str]) -> int:
    """``dalid serve`` with the daemon's stamps, written to $DALID_BENCH_TRACE at exit."""
    import atexit

    trace_daemon()
    path = Path(os.environ[TRACE_ENV])
    atexit.register(lambda: path.write_text(json.dumps(EVENTS)))
    from dalid.server.operations.cli import main

    return main(list(argv))


# (owner module, class or None, function, the step's name) for ``--steps``; a step inside
# another is named after it ("deliver: write_batch").
STEPS = [
    ("dalid.server.runs.run_planner", "RunPlanner", "next_run", "next_run (forming the run)"),
    ("dalid.server.runs.run_planner", "RunPlanner", "prepare", "next_run: prepare"),
    ("dalid.server.runs.run_planner", "RunPlanner", "_pick", "next_run, give_slots: _pick"),
    ("dalid.server.runs.slots", "Slots", "take", "next_run: Slots.take"),
    ("dalid.server.pipelines.runner", "PipelineRunner", "schedule", "schedule (DALI)"),
    ("dalid.server.pipelines.runner", None, "feedable", "schedule: feedable"),
    ("dalid.server.pipelines.runner", "PipelineRunner", "collect", "collect (DALI)"),
    (
        "dalid.server.runs.dali_instances",
        "DaliInstances",
        "holds_runs",
        "schedule, collect: holds_runs",
    ),
    ("dalid.server.runs.executor", "PipelineExecutor", "account", "account"),
    ("dalid.server.runs.run_planner", "RunPlanner", "give_slots", "give_slots"),
    ("dalid.server.runs.executor", "PipelineExecutor", "look", "look"),
    ("dalid.server.runs.delivery", "Delivery", "deliver", "deliver"),
    (
        "dalid.server.outputs.job_outputs",
        "JobOutputs",
        "write_batch",
        "deliver: write_batch (copy)",
    ),
    (
        "dalid.server.handling.batch_requests",
        "BatchRequests",
        "_batch_answered",
        "deliver: the answer (batch_ready)",
    ),
]
STEP_COUNTS: dict[str, list[int]] = {}


def count_steps() -> None:
    """Counts, in the daemon's executor threads, each step's CPU time a call."""
    import importlib

    for module_name, class_name, name, step in STEPS:
        module = importlib.import_module(module_name)
        owner = getattr(module, class_name) if class_name else module
        function = getattr(owner, name)
        calls = STEP_COUNTS.setdefault(step, [])

        def counted(
            *args: Any, _function: Any = function, _calls: list[int] = calls, **kwargs: Any
        ) -> Any:
            if not threading.current_thread().name.startswith("dalid-pipeline"):
                return _function(*args, **kwargs)
            start = time.thread_time_ns()
            try:
                return _function(*args, **kwargs)
            finally:
                _calls.append(time.thread_time_ns() - start)

        setattr(owner, name, functools.wraps(function)(counted))


def serve_steps(argv: Sequence[str]) -> int:
    """``dalid serve`` with the executors' steps counted, written to $DALID_BENCH_STEPS."""
    import atexit

    count_steps()
    path = Path(os.environ[STEPS_ENV])
    atexit.register(lambda: path.write_text(json.dumps(STEP_COUNTS)))
    from dalid.server.operations.cli import main

    return main(list(argv[1:]))


def steps(counts: dict[str, list[int]]) -> list[dict[str, Any]]:
    """Each step's median CPU µs a call and calls a run (a run: a call of ``collect``)."""
    runs = len(counts.get("collect (DALI)", [])) or 1
    return [
        {
            "step": step,
            "us_a_call": statistics.median(calls) / 1e3 if calls else None,
            "calls_a_run": len(calls) / runs,
        }
        for step, calls in counts.items()
    ]


# --- per-thread figures -------------------------------------------------------------------------


def _threads(pid: int) -> dict[str, tuple[float, int, int]]:
    """CPU seconds, voluntary and involuntary context switches of each thread, summed by name.

    Python threads have no name of their own: the main one is "main", the others "python"."""
    found: dict[str, tuple[float, int, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            status = (task / "status").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / _TICK
        counts = dict(line.split(":\t") for line in status.splitlines() if ":\t" in line)
        name = "main" if task.name == str(pid) else name
        old = found.get(name, (0.0, 0, 0))
        found[name] = (
            old[0] + cpu,
            old[1] + int(counts["voluntary_ctxt_switches"]),
            old[2] + int(counts["nonvoluntary_ctxt_switches"]),
        )
    return found


def _per_round_trip(
    before: dict[str, tuple[float, int, int]], after: dict[str, tuple[float, int, int]], n: int
) -> dict[str, dict[str, float]]:
    per = {}
    for name, (cpu, voluntary, involuntary) in after.items():
        cpu0, voluntary0, involuntary0 = before.get(name, (0.0, 0, 0))
        per[name] = {
            "cpu_us": 1e6 * (cpu - cpu0) / n,
            "switches": (voluntary - voluntary0 + involuntary - involuntary0) / n,
        }
    return {name: f for name, f in per.items() if f["cpu_us"] > 0 or f["switches"] >= 0.05}


# --- the round trips ----------------------------------------------------------------------------


def _daemon(
    socket: Path, traced: Path | None, counted: Path | None = None
) -> subprocess.Popen[bytes]:
    entry = ["-m", "bench.hops", "serve"] if traced else ["-m", "dalid.server", "serve"]
    env = {**os.environ, **({TRACE_ENV: str(traced)} if traced else {})}
    if counted:
        entry = ["-m", "bench.hops", "steps", "serve"]
        env[STEPS_ENV] = str(counted)
    command = [sys.executable, *entry, "--no-supervisor", "--device", "cpu", "--socket",
               str(socket), "--log-level", "WARNING"]  # fmt: skip
    process = subprocess.Popen(command, env=env)
    deadline = time.monotonic() + 60
    while not socket.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the dalid daemon did not start")
        time.sleep(0.05)
    return process


def _round_trips(
    socket: Path, batch: int, n: int, daemon_pid: int, files: Path | None = None
) -> tuple[list[tuple[int, int]], dict[str, Any]]:
    """``n`` round trips (after a warm-up); their (start, end) stamps and the threads' use.
    With ``files`` (a directory of :func:`_tiny_files`), each sample is a file's path."""
    import numpy as np
    from torch.utils.data import default_collate

    import dalid.client as dalid

    from .pipelines import tiny_file_pipeline, tiny_pipeline

    if files is None:
        samples = [np.arange(8, dtype=np.uint8)] * batch
        pipeline = tiny_pipeline(batch)
    else:
        paths = sorted(str(path) for path in files.rglob("*.bin"))
        samples = [np.frombuffer(path.encode(), np.int8) for path in paths]
        pipeline = tiny_file_pipeline(batch)
    with dalid.connect(device="cpu", socket=socket, autostart=False, name="hops") as session:
        proxy = session.proxy(pipeline)

        def step() -> None:
            refs = [proxy(sample) for sample in samples]
            output = session.produce_data(default_collate(refs))
            int(output[0, 0])
            del output

        for _ in range(max(50, n // 10)):
            step()
        EVENTS.clear()
        daemon0, client0 = _threads(daemon_pid), _threads(os.getpid())
        steps = []
        for _ in range(n):
            start = time.monotonic_ns()
            _stamp("step>")
            step()
            _stamp("step<")
            steps.append((start, time.monotonic_ns()))
        daemon1, client1 = _threads(daemon_pid), _threads(os.getpid())
    us = sorted((end - start) / 1e3 for start, end in steps)
    figures = {
        "p50_us": us[len(us) // 2],
        "p99_us": us[min(len(us) - 1, int(len(us) * 0.99))],
        "daemon": _per_round_trip(daemon0, daemon1, n),
        "client": _per_round_trip(client0, client1, n),
    }
    return steps, figures


def _by_round_trip(events: Events, steps: list[tuple[int, int]]) -> Iterator[dict[str, int]]:
    """Per round trip, the first time (ns from its start) each event happened in it."""
    events = sorted(events)
    index = 0
    for start, end in steps:
        while index < len(events) and events[index][0] < start:
            index += 1
        first: dict[str, int] = {}
        while index < len(events) and events[index][0] <= end:
            stamp, name = events[index]
            first.setdefault(name, stamp - start)
            index += 1
        yield first


def hops(events: Events, steps: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Each hop's median duration and median end (µs from the proxy call), over the round
    trips where both its events were seen in order."""
    trips = list(_by_round_trip(events, steps))
    rows = []
    for label, begin, end in HOPS:
        spans = [(t[end] - t[begin], t[end]) for t in trips if begin in t and end in t]
        spans = [(d, e) for d, e in spans if d >= 0]
        rows.append(
            {
                "hop": label,
                "n": len(spans),
                "us": statistics.median(d for d, _ in spans) / 1e3 if spans else None,
                "ends_at_us": statistics.median(e for _, e in spans) / 1e3 if spans else None,
            }
        )
    return rows


FILE_DIRECTORIES = 4


def _tiny_files(root: Path, count: int) -> Path:
    """``count`` files of 8 bytes in :data:`FILE_DIRECTORIES` directories under ``root``; their
    paths are of unequal lengths, as a dataset's are."""
    files = root / "files"
    for index in range(count):
        directory = files / f"class{index % FILE_DIRECTORIES}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{'x' * (index % 7)}{index}.bin").write_bytes(bytes(range(8)))
    return files


def measure(batch: int, n: int, files: bool = False, count: bool = False) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="dalidh-", dir="/tmp"))
    try:
        found = _tiny_files(directory, batch) if files else None
        result = _measure(directory, batch, n, found)
        if count:
            result["steps"] = _count(directory, batch, n, found)
        return result
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _count(directory: Path, batch: int, n: int, files: Path | None) -> list[dict[str, Any]]:
    counts_file = directory / "steps.json"
    daemon = _daemon(directory / "steps.sock", None, counts_file)
    try:
        _round_trips(directory / "steps.sock", batch, n, daemon.pid, files)
    finally:
        terminate(daemon)
    return steps(json.loads(counts_file.read_text()))


def _measure(directory: Path, batch: int, n: int, files: Path | None) -> dict[str, Any]:
    plain = _daemon(directory / "plain.sock", None)
    try:
        _, untraced = _round_trips(directory / "plain.sock", batch, n, plain.pid, files)
    finally:
        terminate(plain)
    from dalid.client.link import connection  # noqa: F401  (imported before tracing it)

    trace_client()
    trace_file = directory / "trace.json"
    traced = _daemon(directory / "traced.sock", trace_file)
    try:
        steps, _ = _round_trips(directory / "traced.sock", batch, n, traced.pid, files)
    finally:
        terminate(traced)
    events = EVENTS + [(t, name) for t, name in json.loads(trace_file.read_text())]
    return {
        "batch": batch,
        "files": files is not None,
        "round_trips": n,
        "untraced": untraced,
        "hops": hops(events, steps),
    }


def markdown(result: dict[str, Any]) -> str:
    untraced = result["untraced"]
    lines = [
        f"Batch of {result['batch']} tiny sample(s)"
        f"{' (paths of files of 8 bytes)' if result.get('files') else ''}, "
        f"{result['round_trips']} round trips; "
        f"untraced p50 {untraced['p50_us']:,.0f} µs, p99 {untraced['p99_us']:,.0f} µs.",
        "",
        "| hop | median µs | ends at µs |",
        "|---|--:|--:|",
    ]
    for row in result["hops"]:
        us = "n/a" if row["us"] is None else f"{row['us']:,.0f}"
        at = "n/a" if row["ends_at_us"] is None else f"{row['ends_at_us']:,.0f}"
        lines.append(f"| {row['hop']} | {us} | {at} |")
    lines += ["", "| process: thread | CPU µs per round trip | context switches |", "|---|--:|--:|"]
    for who in ("client", "daemon"):
        threads = untraced[who]
        for name, f in sorted(threads.items(), key=lambda item: -item[1]["cpu_us"]):
            lines.append(f"| {who}: {name} | {f['cpu_us']:,.0f} | {f['switches']:.1f} |")
        total = sum(f["cpu_us"] for f in threads.values())
        switches = sum(f["switches"] for f in threads.values())
        lines.append(f"| **{who}, all threads** | **{total:,.0f}** | **{switches:.1f}** |")
    if result.get("steps"):
        lines += ["", "| executor step | CPU µs a call (median) | calls a run |", "|---|--:|--:|"]
        for row in result["steps"]:
            us = "n/a" if row["us_a_call"] is None else f"{row['us_a_call']:,.1f}"
            lines.append(f"| {row['step']} | {us} | {row['calls_a_run']:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["serve"]:
        return serve(argv)
    if argv[:1] == ["steps"]:
        return serve_steps(argv)
    parser = argparse.ArgumentParser(prog="python -m bench.hops", description=__doc__)
    parser.add_argument("--batch", type=int, default=1, help="samples per batch (default 1)")
    parser.add_argument("--iterations", type=int, default=2000, help="round trips (2000)")
    parser.add_argument(
        "--files",
        action="store_true",
        help="samples are paths of files of 8 bytes, read in DALI (the daemon's path checks)",
    )
    parser.add_argument(
        "--steps",
        action="store_true",
        help="also count the executor's CPU time in each step of a run (a third daemon)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    result = measure(args.batch, args.iterations, args.files, args.steps)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
