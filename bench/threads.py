"""The daemon's own threads, measured from inside: ``python -m bench.threads serve ...``.

The bench starts every daemon of a dalid run through this module (:mod:`bench.daemon`): it
wraps, in the daemon process, the functions its own threads run, then runs ``dalid serve``. At
exit it writes to ``$DALID_BENCH_THREADS`` what those threads used:

- the I/O thread (``Daemon._loop``): its CPU time over the loop, and for every message it took
  (``SharedSocket.receive`` then ``Daemon._receive``: receive, decode, handle, answer) the wall
  time and the thread's CPU time, summed. Wall over CPU per message is what the thread waited
  for meanwhile: above 1 by the time it waited for the GIL while other threads held it (the
  convoy of a thread that gives up the GIL around each frame it receives);
- the pipelines' executor threads (``PipelineExecutor._loop``, one per pipeline): their CPU
  time from the pipeline's build to their end, and the samples they ran; and of that, the CPU
  time spent copying outputs into the jobs' memory (``JobOutputs.write_batch`` and
  ``private_copies``), which grows with the outputs' bytes, not with the Python per batch (on
  a CPU daemon it is a memcpy of every output byte; on a GPU one, a device copy queued).

DALI's own worker threads are what the process used beyond these. Thread CPU comes from
``time.thread_time`` in the thread itself, so nothing outside the daemon has to tell its
threads apart (Python threads have no names of their own in ``/proc``).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

THREADS_ENV = "DALID_BENCH_THREADS"


class _Totals:
    """What the probes add up; each figure is written by one thread at a time or under the lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.io_loop_cpu_s = 0.0
        self.io_loop_wall_s = 0.0
        self.messages = 0
        self.message_wall_ns = 0
        self.message_cpu_ns = 0
        self.executor_cpu_s = 0.0
        self.copy_out_cpu_s = 0.0
        self.executor_samples = 0
        self.executors = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "io_loop_cpu_s": self.io_loop_cpu_s,
            "io_loop_wall_s": self.io_loop_wall_s,
            "messages": self.messages,
            "message_wall_s": self.message_wall_ns / 1e9,
            "message_cpu_s": self.message_cpu_ns / 1e9,
            "executor_cpu_s": self.executor_cpu_s,
            "copy_out_cpu_s": self.copy_out_cpu_s,
            "executor_samples": self.executor_samples,
            "executors": self.executors,
            "process_cpu_s": sum(os.times()[:2]),
        }


TOTALS = _Totals()


def install() -> None:
    """Wraps the daemon's thread functions in place (before the daemon starts)."""
    from dalid.server.daemon import Daemon
    from dalid.server.executor import PipelineExecutor
    from dalid.server.outputs import JobOutputs
    from dalid.server.shared_socket import SharedSocket

    loop = Daemon._loop

    @functools.wraps(loop)
    def io_loop(self: Any) -> None:
        wall, cpu = time.monotonic(), time.thread_time()
        try:
            loop(self)
        finally:
            TOTALS.io_loop_cpu_s += time.thread_time() - cpu
            TOTALS.io_loop_wall_s += time.monotonic() - wall

    receive = SharedSocket.receive
    handle = Daemon._receive
    # The receive of a message starts its span; the handling that follows ends it.
    started: list[int] = [0, 0]

    @functools.wraps(receive)
    def timed_receive(self: Any) -> Any:
        started[0], started[1] = time.perf_counter_ns(), time.thread_time_ns()
        return receive(self)

    @functools.wraps(handle)
    def timed_handle(self: Any, frames: Any) -> None:
        try:
            handle(self, frames)
        finally:
            TOTALS.messages += 1
            TOTALS.message_wall_ns += time.perf_counter_ns() - started[0]
            TOTALS.message_cpu_ns += time.thread_time_ns() - started[1]

    run_loop = PipelineExecutor._loop

    @functools.wraps(run_loop)
    def executor_loop(self: Any, runner: Any) -> None:
        cpu = time.thread_time()
        try:
            run_loop(self, runner)
        finally:
            used = time.thread_time() - cpu
            with TOTALS.lock:
                TOTALS.executor_cpu_s += used
                TOTALS.executor_samples += self.samples_run
                TOTALS.executors += 1

    def copying(method: Any) -> Any:
        @functools.wraps(method)
        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            cpu = time.thread_time()
            try:
                return method(self, *args, **kwargs)
            finally:
                used = time.thread_time() - cpu
                with TOTALS.lock:
                    TOTALS.copy_out_cpu_s += used

        return timed

    JobOutputs.write_batch = copying(JobOutputs.write_batch)  # type: ignore[method-assign]
    JobOutputs.private_copies = copying(JobOutputs.private_copies)  # type: ignore[method-assign]
    Daemon._loop = io_loop  # type: ignore[method-assign]
    SharedSocket.receive = timed_receive  # type: ignore[method-assign]
    Daemon._receive = timed_handle  # type: ignore[method-assign]
    PipelineExecutor._loop = executor_loop  # type: ignore[method-assign]


def serve(argv: Sequence[str]) -> int:
    """``dalid serve`` with the probes, the totals written to $DALID_BENCH_THREADS at exit."""
    install()
    path = Path(os.environ[THREADS_ENV])
    atexit.register(lambda: path.write_text(json.dumps(TOTALS.as_dict())))
    from dalid.server.cli import main

    return main(["serve", *argv])


DAEMON_THREAD_FIGURES = (
    "daemon_own_us_per_sample",
    "daemon_all_us_per_sample",
    "io_us_per_sample",
    "executor_us_per_sample",
    "copy_out_us_per_sample",
    "io_cpu_us_per_message",
    "io_wall_over_cpu",
)


def figures(totals: dict[str, Any]) -> dict[str, float | None]:
    """The figures a run reports from a daemon's totals, per sample the executors ran (µs):
    its own threads' CPU (the I/O loop and the executors, not DALI's workers) less the output
    copies (``daemon_own``), and with them (``daemon_all``); each part; the I/O thread's CPU
    per message it took (µs), and its wall time per message over its CPU time."""
    if not totals:
        return dict.fromkeys(DAEMON_THREAD_FIGURES)
    samples = totals.get("executor_samples") or 0
    messages = totals.get("messages") or 0
    message_cpu = totals.get("message_cpu_s") or 0.0
    io = totals.get("io_loop_cpu_s") or 0.0
    executor = totals.get("executor_cpu_s") or 0.0
    copy_out = totals.get("copy_out_cpu_s") or 0.0

    def per_sample(seconds: float) -> float | None:
        return 1e6 * seconds / samples if samples else None

    return {
        "daemon_own_us_per_sample": per_sample(io + executor - copy_out),
        "daemon_all_us_per_sample": per_sample(io + executor),
        "io_us_per_sample": per_sample(io),
        "executor_us_per_sample": per_sample(executor - copy_out),
        "copy_out_us_per_sample": per_sample(copy_out),
        "io_cpu_us_per_message": 1e6 * message_cpu / messages if messages else None,
        "io_wall_over_cpu": totals["message_wall_s"] / message_cpu if message_cpu > 0 else None,
    }


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] != ["serve"]:
        raise SystemExit("usage: python -m bench.threads serve [dalid serve options]")
    sys.exit(serve(sys.argv[2:]))
