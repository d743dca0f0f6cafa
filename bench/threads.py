"""The daemon's own threads, measured from inside: ``python -m bench.threads serve ...``.

The bench starts every daemon of a dalid run through this module (:mod:`bench.daemon`): it
wraps, in the daemon process, the functions its own threads run, then runs ``dalid serve``.
A thread of the probe appends a snapshot of the running totals to ``$DALID_BENCH_THREADS``
every :data:`SNAPSHOT_INTERVAL_S` (one JSON line each, stamped with ``time.monotonic_ns``, the
clock the trainers stamp their batches with), and a last one at exit, so that the bench reads
what the threads used over the jobs' timed window, without the pipelines' builds, the warm-up
and the jobs' teardown:

- the I/O thread (``Daemon._loop``): its CPU time, and for every message it took
  (``SharedSocket.receive`` then ``Reception._receive``: receive, decode, handle, answer) the wall
  time and the thread's CPU time, summed, and the CPU time of each operation's handler, and
  of the heap trims that follow jobs' departures (``give_back_free_memory``). Wall
  over CPU per message is what the thread waited for meanwhile: the GIL while other threads
  held it (the convoy of a thread that gives up the GIL around each frame it receives), and on
  a machine with more runnable threads than cores, the cores;
- the pipelines' executor threads (``RunLoop.run``, one per DALI instance): their CPU
  time and the samples they ran; and of that, the CPU time spent copying outputs into the
  jobs' memory (``JobOutputs.write_batch`` and ``private_copies``), which grows with the
  outputs' bytes, not with the Python per batch (on a CPU daemon a memcpy of every output
  byte; on a GPU one, a device copy queued), and the CPU time of its calls into DALI
  (``PipelineRunner.schedule`` and ``collect``: the inputs fed, the run started, its outputs
  taken), DALI's own work done on the thread that asks, as an in-process job does it on its
  own.

DALI's own worker threads are what the process used beyond these. A live thread's CPU time is
read from its own clock (``pthread_getcpuclockid``), so nothing outside the daemon has to tell
its threads apart (Python threads have no names of their own in ``/proc``).

Why one module of some 740 lines: the probes that count inside the daemon and the figures
made of their counts change together (a count the figures misread is a wrong figure), and
neither is of use without the other.
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import resource
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

THREADS_ENV = "DALID_BENCH_THREADS"
SNAPSHOT_INTERVAL_S = 0.25
# The steps of a message on the I/O thread, each its CPU time: ``receive`` (its frames from
# the socket), ``admit`` (the intake's look at its connection and sender, their credentials
# read), ``decode`` (the codec's, the message's own checks included), ``handle`` (the
# operation's handler) and ``answer`` (the reply encoded and sent); what a message's CPU time
# holds beyond them is the loop's code between the steps, and the probes' own clocks.
MESSAGE_STEPS = ("receive", "admit", "decode", "handle", "answer")
# Set (to anything but "" or "0") in the bench's environment, the daemon counts its messages'
# steps: ten more reads of the thread's clock a message, CPU of the I/O thread's that the
# figures of the daemon's own threads would count, so off by default.
STEPS_ENV = "DALID_BENCH_IO_STEPS"


def _thread_cpu_s(ident: int) -> float:
    """The CPU time of a live thread of this process (0 once it has ended)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (OSError, ProcessLookupError):
        return 0.0


def _cpu_by_thread_name() -> dict[str, float]:
    """CPU seconds of this process's live threads, added up by thread name (``comm``: DALI's
    workers, CUDA's and ZeroMQ's threads, Python's own), from ``/proc/self/task/*/stat``. A
    thread that ended is no longer counted, so a window's difference is a pointer to where a
    process's CPU goes (which of DALI's threads, say), not an account."""
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    for task in os.scandir("/proc/self/task"):
        try:
            with open(f"{task.path}/stat", "rb") as stat:
                text = stat.read()
        except OSError:
            continue
        # The name is between the first "(" and the last ")"; utime and stime are the 12th
        # and 13th fields after it.
        name = text[text.index(b"(") + 1 : text.rindex(b")")].decode(errors="replace")
        fields = text[text.rindex(b")") + 2 :].split()
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return totals


def _sched_by_thread() -> dict[str, list[Any]]:
    """By thread id: [name, seconds on a CPU, seconds runnable but waiting for one], from the
    scheduler's ``/proc/self/task/*/schedstat``. What a window leaves over of its seconds, a
    thread slept: DALI's workers waiting for work, not for a core, which tells a pipeline
    starved of runs from a machine short of cores. By id, not name: DALI names its threads
    only once they run."""
    threads: dict[str, list[Any]] = {}
    for task in os.scandir("/proc/self/task"):
        try:
            with open(f"{task.path}/schedstat", "rb") as stat:
                on_cpu, waiting = (int(x) for x in stat.read().split()[:2])
            name = _THREAD_NAMES.get(task.name)
            if name is None or name == "python":
                # A thread's name is read once it is DALI's or the like (a file less a look).
                with open(f"{task.path}/comm", "rb") as comm:
                    name = _THREAD_NAMES[task.name] = comm.read().strip().decode(errors="replace")
        except (OSError, ValueError):
            continue
        threads[task.name] = [name, on_cpu / 1e9, waiting / 1e9]
    return threads


def _run_delay_s(native_id: int | None) -> float:
    """Seconds a thread of this process has been runnable but waiting for a core
    (``/proc/self/task/<tid>/schedstat``); 0 for none, or one that has ended."""
    if native_id is None:
        return 0.0
    try:
        with open(f"/proc/self/task/{native_id}/schedstat", "rb") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _core_wait_ns(fd: int | None) -> int:
    """Nanoseconds the thread whose ``schedstat`` ``fd`` reads has been runnable without a
    core (one ``pread``: the file is made anew at each read from its start); 0 without one."""
    if fd is None:
        return 0
    try:
        return int(os.pread(fd, 128, 0).split()[1])
    except (OSError, ValueError, IndexError):
        return 0


# Thread names by id, read once named (a Python thread is "python" until DALI names its own).
_THREAD_NAMES: dict[str, str] = {}


class _Totals:
    """The running totals; counters are written by one thread each, or under the lock.

    A snapshot reads every clock under the lock, at one moment, and counts what is under way
    then up to that moment (a message or an operation the I/O thread is handling, an output
    copy): a total that grew only at the end of each would lag the threads' clocks by up to
    one of them, a whole batch's copy or a job's goodbye, and a window's differences would be
    off by as much (less than nothing, for the executors less their copies).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.io_ident: int | None = None
        self.io_cpu_done_s = 0.0
        self.messages = 0
        self.message_wall_ns = 0
        self.message_cpu_ns = 0
        # The I/O thread's context switches inside its messages (getrusage(RUSAGE_THREAD)):
        # voluntary, where it blocked (on the GIL, which pyzmq lets go of around a send or a
        # receive, or a lock: its socket is never waited on inside a message), and involuntary,
        # where the kernel took its core away.
        self.message_blocks = 0
        self.message_preemptions = 0
        # Of the messages' wall time, what the I/O thread spent runnable without a core (its
        # scheduler statistics read around each message, outside the clocks of its CPU and
        # wall time): the rest of wall less CPU is what it spent blocked.
        self.message_core_wait_ns = 0
        # Whether the message under way starts or ends a job (LIFECYCLE_OPS): its waits are
        # left out of these, as its times are out of the figures per message (a goodbye takes
        # some 160 ms, and is preempted as often as that lasts).
        self.message_lifecycle = False
        # The I/O thread's CPU time in those reads (two system calls before a message and two
        # after it, outside its clocks): the probe's, taken away from the thread's loop.
        self.probe_cpu_ns = 0
        self.io_schedstat_fd: int | None = None
        # The message the I/O thread is taking: its start (perf_counter_ns, thread_time_ns,
        # voluntary and involuntary switches so far, its time without a core so far).
        self.message_started: tuple[int, int, int, int, int] | None = None
        # The I/O thread's id in /proc (its scheduler statistics: time runnable, waiting for a
        # core).
        self.io_native_id: int | None = None
        self.io_run_delay_done_s = 0.0  # the I/O thread's, once its loop has ended
        # The I/O loop's turns (each a wake from poll, or a look that found news waiting), and
        # its once-a-second reap's CPU time (every peer's process looked at): the two parts
        # of its chores that may grow with the number of jobs.
        self.io_wakes = 0
        self.reap_cpu_s = 0.0
        # The I/O thread's CPU inside its messages by step (MESSAGE_STEPS), summed over the
        # messages that neither start nor end a job, and how many those were: the steps of the
        # message under way are kept apart until it ends, when it is known which it was.
        self.message_steps_ns: dict[str, int] = dict.fromkeys(MESSAGE_STEPS, 0)
        self.message_steps_under_way: dict[str, int] = dict.fromkeys(MESSAGE_STEPS, 0)
        self.stepped_messages = 0
        self.stepping = False  # whether the steps are counted (STEPS_ENV)
        self.stepped_cpu_ns = 0  # those messages' whole CPU time
        # The loop's sends of what waits in its outbox (``SharedSocket.flush``), outside its
        # messages: their CPU time and the messages sent.
        self.outbox_cpu_s = 0.0
        self.outbox_sent = 0
        # Each operation's count, and the I/O thread's CPU and wall time in its handler
        # (DaemonCore.handle).
        self.by_op: dict[str, list[float]] = {}
        # The operation under way: its name and start (thread_time, perf_counter).
        self.op_started: tuple[str, float, float] | None = None
        # The I/O thread's heap trims (heap.give_back_free_memory) after jobs or connections
        # went: what a job's end costs, as its goodbye does.
        self.departure_trim_cpu_s = 0.0
        # Python's cyclic garbage collections on the I/O thread: how many and their CPU time
        # (each is counted on the thread whose allocation set it off).
        self.io_gc_collections = 0
        self.io_gc_cpu_s = 0.0
        self.gc_started: float | None = None
        self.departures_trimmed = 0
        self.daemon: Any = None
        # Executors' instances running (ident -> the instance) and what the ended ones used.
        self.executors: dict[int, Any] = {}
        self.executor_cpu_done_s = 0.0
        self.executor_samples_done = 0
        self.copy_out_cpu_s = 0.0
        # Output copies under way: the copying thread -> its CPU time when the copy started.
        self.copying: dict[int, float] = {}
        # The executors' calls into DALI (PipelineRunner.schedule and .collect: feeding the
        # inputs, starting the run, taking its outputs), done and under way, as for the copies.
        self.dali_calls_cpu_s = 0.0
        self.calling_dali: dict[int, float] = {}
        # The executors' forming of runs (``RunPlanner.next_run``: the scheduler's order, the
        # jobs' windows and memory, a slot, the paths' checks), done and under way: the step
        # whose looks may grow with the number of jobs of a pipeline.
        self.forming_cpu_s = 0.0
        self.forming: dict[int, float] = {}
        # Wall time the executors spent waiting: in ``RunPlanner.next_run`` (for batches to run,
        # or for room in the jobs' windows) and in ``PipelineRunner.collect`` (for DALI to
        # finish a run); counted when each call returns.
        self.next_run_wall_s = 0.0
        self.collect_wall_s = 0.0
        self.executor_runs_done = 0

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            running = list(self.executors.items())
            executor_cpu = self.executor_cpu_done_s
            executor_cpu += sum(_thread_cpu_s(ident) for ident, _ in running)
            copy_out = self.copy_out_cpu_s
            copy_out += sum(_thread_cpu_s(ident) - cpu for ident, cpu in self.copying.items())
            dali_calls = self.dali_calls_cpu_s + sum(
                _thread_cpu_s(ident) - cpu for ident, cpu in self.calling_dali.items()
            )
            forming = self.forming_cpu_s + sum(
                _thread_cpu_s(ident) - cpu for ident, cpu in self.forming.items()
            )
            samples = self.executor_samples_done
            samples += sum(instance.samples for _, instance in running)
            runs = self.executor_runs_done + sum(instance.runs for _, instance in running)
            next_run_wall, collect_wall = self.next_run_wall_s, self.collect_wall_s
            io_now = _thread_cpu_s(self.io_ident) if self.io_ident else 0.0
            wall_now = time.perf_counter()
            message_wall, message_cpu = self.message_wall_ns / 1e9, self.message_cpu_ns / 1e9
            if self.message_started is not None and self.io_ident:
                wall0, cpu0, _, _, _ = self.message_started
                message_wall += wall_now - wall0 / 1e9
                message_cpu += io_now - cpu0 / 1e9
            blocks, preemptions = self.message_blocks, self.message_preemptions
            core_wait = self.message_core_wait_ns / 1e9
            io_native_id = self.io_native_id
            by_op = {op: list(figures) for op, figures in self.by_op.items()}
            if self.op_started is not None and self.io_ident:
                op, cpu1, wall1 = self.op_started
                figures = by_op.setdefault(op, [0, 0.0, 0.0])
                figures[1] += io_now - cpu1
                figures[2] += wall_now - wall1
            messages = self.messages
            trims = self.departure_trim_cpu_s
            gc_collections, gc_cpu = self.io_gc_collections, self.io_gc_cpu_s
            wakes, reap = self.io_wakes, self.reap_cpu_s
            steps = {step: ns / 1e9 for step, ns in self.message_steps_ns.items()}
            stepped = self.stepped_messages
            stepped_cpu = self.stepped_cpu_ns / 1e9
            outbox_cpu, outbox_sent = self.outbox_cpu_s, self.outbox_sent
        return {
            "t_ns": time.monotonic_ns(),
            "io_loop_cpu_s": self.io_cpu_done_s + io_now - self.probe_cpu_ns / 1e9,
            "messages": messages,
            "message_wall_s": message_wall,
            "message_cpu_s": message_cpu,
            "message_blocks": blocks,
            "message_preemptions": preemptions,
            "message_core_wait_s": core_wait,
            "io_wakes": wakes,
            "reap_cpu_s": reap,
            **(
                {"message_steps": steps, "stepped_messages": stepped, "stepped_cpu_s": stepped_cpu}
                if self.stepping
                else {}
            ),
            "outbox_cpu_s": outbox_cpu,
            "outbox_sent": outbox_sent,
            "io_run_delay_s": (
                _run_delay_s(io_native_id) if io_native_id else self.io_run_delay_done_s
            ),
            "by_op": by_op,
            "departure_trim_cpu_s": trims,
            "io_gc_collections": gc_collections,
            "io_gc_cpu_s": gc_cpu,
            "executor_cpu_s": executor_cpu,
            "copy_out_cpu_s": copy_out,
            "dali_calls_cpu_s": dali_calls,
            "forming_cpu_s": forming,
            "executor_samples": samples,
            "executor_runs": runs,
            "next_run_wall_s": next_run_wall,
            "collect_wall_s": collect_wall,
            "process_cpu_s": sum(os.times()[:2]),
            "cpu_by_thread_name": _cpu_by_thread_name(),
            "sched_by_thread": _sched_by_thread(),
        }


TOTALS = _Totals()


def install() -> None:
    """Wraps the daemon's thread functions in place (before the daemon starts)."""
    from dalid.server.handling.core import DaemonCore
    from dalid.server.intake import chores as chores_module
    from dalid.server.intake import reception as reception_module
    from dalid.server.intake.daemon import Daemon
    from dalid.server.intake.intake import Intake
    from dalid.server.intake.reception import Reception
    from dalid.server.intake.shared_socket import SharedSocket
    from dalid.server.outputs.job_outputs import JobOutputs
    from dalid.server.pipelines.runner import PipelineRunner
    from dalid.server.runs.run_loop import RunLoop
    from dalid.server.runs.run_planner import RunPlanner

    loop = Daemon._loop

    @functools.wraps(loop)
    def io_loop(self: Any) -> None:
        ident = threading.get_ident()
        start = _thread_cpu_s(ident)
        with TOTALS.lock:
            TOTALS.io_cpu_done_s -= start  # the thread's CPU before its loop is not the loop's
            TOTALS.io_ident = ident
            TOTALS.io_native_id = threading.get_native_id()
            TOTALS.io_schedstat_fd = os.open(
                f"/proc/self/task/{TOTALS.io_native_id}/schedstat", os.O_RDONLY | os.O_CLOEXEC
            )
            TOTALS.daemon = self
            TOTALS.departures_trimmed = chores_module.departures(self.core, self._intake)
        try:
            loop(self)
        finally:
            with TOTALS.lock:
                TOTALS.io_cpu_done_s += _thread_cpu_s(ident)
                TOTALS.io_ident = None
                TOTALS.io_run_delay_done_s = _run_delay_s(TOTALS.io_native_id)
                TOTALS.io_native_id = None
                if TOTALS.io_schedstat_fd is not None:
                    os.close(TOTALS.io_schedstat_fd)
                    TOTALS.io_schedstat_fd = None

    receive = SharedSocket.receive
    handle = Reception._receive
    stepping = TOTALS.stepping = os.environ.get(STEPS_ENV, "") not in ("", "0")

    # The receive of a message starts its span; the handling that follows ends it. A receive
    # that finds nothing waiting (the end of a turn) is the loop's, not a message's.
    @functools.wraps(receive)
    def timed_receive(self: Any) -> Any:
        probe = time.thread_time_ns()
        switches = resource.getrusage(resource.RUSAGE_THREAD)
        core_wait = _core_wait_ns(TOTALS.io_schedstat_fd)
        with TOTALS.lock:
            cpu = time.thread_time_ns()
            TOTALS.probe_cpu_ns += cpu - probe
            TOTALS.message_started = (
                time.perf_counter_ns(), cpu, switches.ru_nvcsw, switches.ru_nivcsw, core_wait,
            )  # fmt: skip
        frames = receive(self)
        if frames is None:
            with TOTALS.lock:
                TOTALS.message_started = None
        elif stepping:
            TOTALS.message_steps_under_way["receive"] += time.thread_time_ns() - cpu
        return frames

    @functools.wraps(handle)
    def timed_handle(self: Any, frames: Any) -> None:
        try:
            handle(self, frames)
        finally:
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            switches = resource.getrusage(resource.RUSAGE_THREAD)
            core_wait = _core_wait_ns(TOTALS.io_schedstat_fd)
            with TOTALS.lock:
                TOTALS.probe_cpu_ns += time.thread_time_ns() - cpu
                if TOTALS.message_started is not None:
                    wall0, cpu0, blocks0, preemptions0, core_wait0 = TOTALS.message_started
                    TOTALS.message_wall_ns += wall - wall0
                    TOTALS.message_cpu_ns += cpu - cpu0
                    if not TOTALS.message_lifecycle:
                        TOTALS.message_blocks += switches.ru_nvcsw - blocks0
                        TOTALS.message_preemptions += switches.ru_nivcsw - preemptions0
                        TOTALS.message_core_wait_ns += core_wait - core_wait0
                    TOTALS.messages += 1
                    if not TOTALS.message_lifecycle:
                        TOTALS.stepped_messages += 1
                        TOTALS.stepped_cpu_ns += cpu - cpu0
                        for step, ns in TOTALS.message_steps_under_way.items():
                            TOTALS.message_steps_ns[step] += ns
                TOTALS.message_steps_under_way = dict.fromkeys(MESSAGE_STEPS, 0)
                TOTALS.message_started = None
                TOTALS.message_lifecycle = False

    core_handle = DaemonCore.handle

    @functools.wraps(core_handle)
    def handle_op(self: Any, identity: bytes, message: Any, request_id: Any) -> Any:
        op = type(message).OP
        cpu, wall = time.thread_time(), time.perf_counter()
        with TOTALS.lock:
            TOTALS.op_started = (op, cpu, wall)
            TOTALS.message_lifecycle = op in LIFECYCLE_OPS
        try:
            return core_handle(self, identity, message, request_id)
        finally:
            used, took = time.thread_time() - cpu, time.perf_counter() - wall
            TOTALS.message_steps_under_way["handle"] += int(used * 1e9)
            with TOTALS.lock:
                TOTALS.op_started = None
                figures = TOTALS.by_op.setdefault(op, [0, 0.0, 0.0])
                figures[0] += 1
                figures[1] += used
                figures[2] += took

    def step(function: Any, name: str) -> Any:
        """``function`` with its CPU time counted into step ``name`` of the message under way
        (MESSAGE_STEPS), when the I/O thread calls it inside one."""

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            cpu = time.thread_time_ns()
            try:
                return function(*args, **kwargs)
            finally:
                if TOTALS.message_started is not None and threading.get_ident() == TOTALS.io_ident:
                    TOTALS.message_steps_under_way[name] += time.thread_time_ns() - cpu

        return timed

    flush = SharedSocket.flush
    send_locked = SharedSocket._send_locked
    flushing = threading.local()

    @functools.wraps(flush)
    def timed_flush(self: Any) -> None:
        if not self._outbox:
            return flush(self)  # the loop's look at an empty outbox, each turn: its chores'
        cpu = time.thread_time()
        flushing.active = True
        try:
            return flush(self)
        finally:
            flushing.active = False
            used = time.thread_time() - cpu
            with TOTALS.lock:
                TOTALS.outbox_cpu_s += used

    @functools.wraps(send_locked)
    def counted_send_locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(flushing, "active", False):
            TOTALS.outbox_sent += 1  # on the loop's thread, in its flush
        return send_locked(self, *args, **kwargs)

    def collecting(phase: str, _info: dict[str, Any]) -> None:
        # gc calls back on the thread that collects, with the GIL held: one at a time.
        if threading.get_ident() != TOTALS.io_ident:
            return
        if phase == "start":
            TOTALS.gc_started = time.thread_time()
        elif TOTALS.gc_started is not None:
            TOTALS.io_gc_cpu_s += time.thread_time() - TOTALS.gc_started
            TOTALS.io_gc_collections += 1
            TOTALS.gc_started = None

    gc.callbacks.append(collecting)

    sleep_ms = chores_module.sleep_ms

    @functools.wraps(sleep_ms)
    def counted_sleep_ms(*args: Any, **kwargs: Any) -> Any:
        TOTALS.io_wakes += 1  # once a turn of the loop, on its thread
        return sleep_ms(*args, **kwargs)

    reap = DaemonCore.reap

    @functools.wraps(reap)
    def timed_reap(self: Any) -> Any:
        cpu = time.thread_time()
        try:
            return reap(self)
        finally:
            used = time.thread_time() - cpu
            with TOTALS.lock:
                TOTALS.reap_cpu_s += used

    trim = chores_module.give_back_free_memory  # type: ignore[attr-defined]

    @functools.wraps(trim)
    def timed_trim() -> None:
        # A trim after jobs or connections went is their end's cost; one after input memory
        # was freed (batches of large samples) is the loop's, and stays in its chores.
        cpu = time.thread_time()
        try:
            trim()
        finally:
            used = time.thread_time() - cpu
            daemon = TOTALS.daemon
            departures = (
                chores_module.departures(daemon.core, daemon._intake) if daemon is not None else 0
            )
            with TOTALS.lock:
                if departures != TOTALS.departures_trimmed:
                    TOTALS.departure_trim_cpu_s += used
                    TOTALS.departures_trimmed = departures

    run_loop = RunLoop.run

    @functools.wraps(run_loop)
    def executor_loop(self: Any) -> None:
        instance = self._instance
        ident = threading.get_ident()
        with TOTALS.lock:
            # The pipeline's build is not the loop's.
            TOTALS.executor_cpu_done_s -= _thread_cpu_s(ident)
            TOTALS.executors[ident] = instance
        try:
            run_loop(self)
        finally:
            with TOTALS.lock:
                del TOTALS.executors[ident]
                TOTALS.executor_cpu_done_s += _thread_cpu_s(ident)
                TOTALS.executor_samples_done += instance.samples
                TOTALS.executor_runs_done += instance.runs

    def accounted(method: Any, under_way: dict[int, float], total: str) -> Any:
        """``method`` with its thread's CPU time counted into ``TOTALS.<total>``, and while it
        runs, ``under_way`` holding when it started (a snapshot counts it up to its moment)."""

        @functools.wraps(method)
        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            ident = threading.get_ident()
            cpu = time.thread_time()
            with TOTALS.lock:
                under_way[ident] = cpu
            try:
                return method(self, *args, **kwargs)
            finally:
                used = time.thread_time() - cpu
                with TOTALS.lock:
                    del under_way[ident]
                    setattr(TOTALS, total, getattr(TOTALS, total) + used)

        return timed

    def waited(method: Any, total: str) -> Any:
        """``method`` with its wall time added to ``TOTALS.<total>`` when it returns."""

        @functools.wraps(method)
        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                used = time.perf_counter() - start
                with TOTALS.lock:
                    setattr(TOTALS, total, getattr(TOTALS, total) + used)

        return timed

    def copying(method: Any) -> Any:
        return accounted(method, TOTALS.copying, "copy_out_cpu_s")

    def calling_dali(method: Any) -> Any:
        return accounted(method, TOTALS.calling_dali, "dali_calls_cpu_s")

    chores_module.give_back_free_memory = timed_trim  # type: ignore[attr-defined]
    chores_module.sleep_ms = counted_sleep_ms
    DaemonCore.reap = timed_reap  # type: ignore[method-assign]
    SharedSocket.flush = timed_flush  # type: ignore[method-assign]
    SharedSocket._send_locked = counted_send_locked  # type: ignore[method-assign]
    if stepping:
        reception_module.decode = step(reception_module.decode, "decode")  # type: ignore[attr-defined]
        reception_module.from_message = step(reception_module.from_message, "admit")  # type: ignore[attr-defined]
        Intake.admit = step(Intake.admit, "admit")  # type: ignore[method-assign]
        Reception.answer = step(Reception.answer, "answer")  # type: ignore[method-assign]
    Daemon._loop = io_loop  # type: ignore[method-assign]
    SharedSocket.receive = timed_receive  # type: ignore[method-assign]
    Reception._receive = timed_handle  # type: ignore[method-assign]
    DaemonCore.handle = handle_op  # type: ignore[method-assign]
    RunLoop.run = executor_loop  # type: ignore[method-assign]
    JobOutputs.write_batch = copying(JobOutputs.write_batch)  # type: ignore[method-assign]
    JobOutputs.private_copies = copying(JobOutputs.private_copies)  # type: ignore[method-assign]
    PipelineRunner.schedule = calling_dali(PipelineRunner.schedule)  # type: ignore[method-assign]
    PipelineRunner.collect = calling_dali(PipelineRunner.collect)  # type: ignore[method-assign]
    PipelineRunner.collect = waited(PipelineRunner.collect, "collect_wall_s")  # type: ignore[method-assign]
    RunPlanner.next_run = accounted(RunPlanner.next_run, TOTALS.forming, "forming_cpu_s")  # type: ignore[method-assign]
    RunPlanner.next_run = waited(RunPlanner.next_run, "next_run_wall_s")  # type: ignore[method-assign]


def _write_snapshots(path: Path, stop: threading.Event) -> None:
    with path.open("a") as out:
        while not stop.wait(SNAPSHOT_INTERVAL_S):
            out.write(json.dumps(TOTALS.snapshot()) + "\n")
            out.flush()


def serve(argv: Sequence[str]) -> int:
    """``dalid serve`` with the probes, snapshots of the totals appended to
    $DALID_BENCH_THREADS while it runs and once more at exit."""
    install()
    path = Path(os.environ[THREADS_ENV])
    stop = threading.Event()
    writer = threading.Thread(
        target=_write_snapshots, args=(path, stop), name="bench-threads", daemon=True
    )

    def last() -> None:
        stop.set()
        writer.join()
        with path.open("a") as out:
            out.write(json.dumps(TOTALS.snapshot()) + "\n")

    from dalid.server.intake import heap
    from dalid.server.operations import cli

    limit = heap.limit_malloc_arenas

    # The writer starts once the daemon has set its malloc arena limit, as the daemon makes
    # its own threads: a thread that allocates before the limit gets an arena of its own, which
    # DALI's threads then share with the main one, and the daemon measured would hold more
    # memory than one run without the probes (two arenas of some 55 MiB each, measured).
    @functools.wraps(limit)
    def limit_then_write(arenas: int) -> bool:
        limited = limit(arenas)
        writer.start()
        atexit.register(last)
        return limited

    # `dalid serve` imports it from its module when it starts the daemon.
    heap.limit_malloc_arenas = limit_then_write
    return cli.main(["serve", *argv])


def read_snapshots(path: Path) -> list[dict[str, Any]]:
    """The snapshots a probed daemon wrote, oldest first (a line cut short is left out)."""
    snapshots = []
    for line in path.read_text().splitlines():
        try:
            snapshots.append(json.loads(line))
        except ValueError:
            continue
    return snapshots


def window(snapshots: Sequence[dict[str, Any]], start_ns: int, end_ns: int) -> dict[str, Any]:
    """What the threads used from ``start_ns`` to ``end_ns`` (monotonic): the difference of the
    last snapshot at or before the start and the first at or after the end (the last one if
    none is), with ``seconds`` the span they cover; {} without two such snapshots."""
    before = [s for s in snapshots if s["t_ns"] <= start_ns]
    after = [s for s in snapshots if s["t_ns"] >= end_ns] or list(snapshots[-1:])
    if not before or not after or after[0]["t_ns"] <= before[-1]["t_ns"]:
        return {}
    a, b = before[-1], after[0]
    used: dict[str, Any] = {
        name: b[name] - a[name] for name in b if isinstance(b[name], int | float)
    }
    used["seconds"] = (b["t_ns"] - a["t_ns"]) / 1e9
    names = b.get("cpu_by_thread_name") or {}
    used["cpu_by_thread_name"] = {
        name: round(cpu - (a.get("cpu_by_thread_name") or {}).get(name, 0.0), 2)
        for name, cpu in names.items()
    }
    # Threads alive at both ends, by their name at the end: [threads, CPU s, runnable-waiting s],
    # over ``sched_seconds``. It ends at the last snapshot inside the window: a pipeline's
    # threads end with its last job, often before the first snapshot after the window.
    sched: dict[str, list[float]] = {}
    earlier = a.get("sched_by_thread") or {}
    inside = [s for s in snapshots if a["t_ns"] < s["t_ns"] <= end_ns] or [b]
    used["sched_seconds"] = (inside[-1]["t_ns"] - a["t_ns"]) / 1e9
    for tid, (name, cpu, waiting) in (inside[-1].get("sched_by_thread") or {}).items():
        if tid in earlier:
            figures = sched.setdefault(name, [0, 0.0, 0.0])
            figures[0] += 1
            figures[1] += cpu - earlier[tid][1]
            figures[2] += waiting - earlier[tid][2]
    used["sched_by_thread_name"] = sched
    steps_a, steps_b = a.get("message_steps") or {}, b.get("message_steps") or {}
    used["message_steps"] = {step: steps_b[step] - steps_a.get(step, 0.0) for step in steps_b}
    used["by_op"] = {
        op: [x - y for x, y in zip(now, a["by_op"].get(op, [0] * len(now)), strict=True)]
        for op, now in b["by_op"].items()
    }
    return used


# Operations of a job's life, not of its batches: a job that starts or ends inside another
# job's window (the union of the jobs' windows holds both) must not count them per sample.
LIFECYCLE_OPS = frozenset(
    {"hello", "ipc_probe_result", "register_pipeline", "register_named_pipeline", "goodbye"}
)

DAEMON_THREAD_FIGURES = (
    "daemon_own_us_per_sample",
    "daemon_all_us_per_sample",
    "io_us_per_sample",
    "io_messages_us_per_sample",
    "io_chores_ms_per_s",
    "io_lifecycle_ms",
    "executor_us_per_sample",
    "copy_out_us_per_sample",
    "dali_calls_us_per_sample",
    "forming_us_per_sample",
    "io_cpu_us_per_message",
    "io_wall_over_cpu",
    "io_wait_us_per_message",
    "io_core_wait_us_per_message",
    "io_blocks_per_message",
    "io_preemptions_per_message",
    "io_run_delay_us_per_message",
    "messages_per_run",
    "io_wakes_per_s",
    "io_reap_ms_per_s",
    "io_outbox_ms_per_s",
    "io_outbox_sent_per_s",
    "io_gc_ms_per_s",
    "io_gc_per_s",
    *(f"io_{step}_us_per_message" for step in MESSAGE_STEPS),
    "io_between_steps_us_per_message",
    "samples_per_run",
    "executors_waiting_for_batches",
    "executors_waiting_for_dali",
    "dali_workers_asleep",
    "dali_workers_waiting_for_a_core",
)

# The names DALI gives its pipelines' worker threads (a thread pool's "[DALI][TP<i>]Exec").
DALI_WORKER_PREFIX = "[DALI][TP"


def figures(used: dict[str, Any]) -> dict[str, float | None]:
    """The figures of what the threads used over a window (:func:`window`), per sample the
    executors ran (µs): the daemon's own threads' CPU (the I/O loop and the executors, not
    DALI's workers; the I/O thread's handling of jobs starting and ending, LIFECYCLE_OPS and
    the heap trims after jobs went, apart in ``io_lifecycle_ms``) less the output copies
    (``daemon_own``), and with them
    (``daemon_all``);
    each part, the I/O thread's split into the messages it took (per sample) and the rest of its
    loop (polls, the once-a-second reaping and status snapshot: ms per second of the window,
    a cost of time, not of samples); of the executors', their calls into DALI (feeding a run,
    starting it, taking its outputs: DALI's own work on the executor's thread, which an
    in-process job does on its own); the I/O thread's CPU per message it took (µs), and its
    wall time per message over its CPU time."""
    samples = used.get("executor_samples") or 0
    if not samples:
        return dict.fromkeys(DAEMON_THREAD_FIGURES)
    # [count, CPU s, wall s] of each operation (wall as CPU where a probe kept none).
    ops = [(f[0], f[1], f[2] if len(f) > 2 else f[1]) for op, f in
           (used.get("by_op") or {}).items() if op in LIFECYCLE_OPS]  # fmt: skip
    lifecycle_ops = sum(cpu for _, cpu, _ in ops)
    # The heap trims after jobs went are their end's too (not a message).
    lifecycle = lifecycle_ops + (used.get("departure_trim_cpu_s") or 0.0)
    messages = (used.get("messages") or 0) - sum(count for count, _, _ in ops)
    message_cpu = (used.get("message_cpu_s") or 0.0) - lifecycle_ops
    message_wall = (used.get("message_wall_s") or 0.0) - sum(wall for _, _, wall in ops)
    io = (used.get("io_loop_cpu_s") or 0.0) - lifecycle
    executor = used.get("executor_cpu_s") or 0.0
    copy_out = used.get("copy_out_cpu_s") or 0.0

    def per_sample(seconds: float) -> float:
        return 1e6 * seconds / samples

    return {
        "daemon_own_us_per_sample": per_sample(io + executor - copy_out),
        "daemon_all_us_per_sample": per_sample(io + executor),
        "io_us_per_sample": per_sample(io),
        "io_messages_us_per_sample": per_sample(message_cpu),
        "io_chores_ms_per_s": (
            1e3 * (io - message_cpu) / used["seconds"] if used.get("seconds") else None
        ),
        "io_lifecycle_ms": 1e3 * lifecycle,
        "executor_us_per_sample": per_sample(executor - copy_out),
        "copy_out_us_per_sample": per_sample(copy_out),
        "dali_calls_us_per_sample": per_sample(used.get("dali_calls_cpu_s") or 0.0),
        "forming_us_per_sample": (
            per_sample(used["forming_cpu_s"]) if "forming_cpu_s" in used else None
        ),
        "io_cpu_us_per_message": 1e6 * message_cpu / messages if messages else None,
        "io_wall_over_cpu": message_wall / message_cpu if message_cpu > 0 else None,
        **_io_waits(used, messages, message_wall - message_cpu),
        "io_wakes_per_s": (
            used["io_wakes"] / used["seconds"]
            if used.get("seconds") and "io_wakes" in used
            else None
        ),
        "io_reap_ms_per_s": (
            1e3 * used["reap_cpu_s"] / used["seconds"]
            if used.get("seconds") and "reap_cpu_s" in used
            else None
        ),
        **_steps(used),
        **_feeding(used, samples),
    }


def _steps(used: dict[str, Any]) -> dict[str, float | None]:
    """The I/O thread's CPU a message by step (µs; MESSAGE_STEPS, over the messages that
    neither start nor end a job) and what was between them; its sends of the outbox outside its
    messages (ms and messages a second); and its garbage collections, inside messages or not
    (ms and collections a second)."""
    stepped = used.get("stepped_messages") or 0
    steps = used.get("message_steps") or {}
    seconds = used.get("seconds") or 0.0
    figures: dict[str, float | None] = {
        "io_gc_ms_per_s": (
            1e3 * used["io_gc_cpu_s"] / seconds if seconds and "io_gc_cpu_s" in used else None
        ),
        "io_gc_per_s": (
            used["io_gc_collections"] / seconds if seconds and "io_gc_collections" in used else None
        ),
        "io_outbox_ms_per_s": (
            1e3 * used["outbox_cpu_s"] / seconds if seconds and "outbox_cpu_s" in used else None
        ),
        "io_outbox_sent_per_s": (
            used["outbox_sent"] / seconds if seconds and "outbox_sent" in used else None
        ),
    }
    for step in MESSAGE_STEPS:
        figures[f"io_{step}_us_per_message"] = (
            1e6 * steps[step] / stepped if stepped and step in steps else None
        )
    figures["io_between_steps_us_per_message"] = (
        1e6 * (used["stepped_cpu_s"] - sum(steps.values())) / stepped
        if stepped and steps and "stepped_cpu_s" in used
        else None
    )
    return figures


def _io_waits(used: dict[str, Any], messages: int, waited_s: float) -> dict[str, float | None]:
    """What the I/O thread's messages waited for, per message: wall less CPU time (µs); the
    times it blocked inside one (voluntary context switches: the GIL, taken back after pyzmq's
    send or receive let go of it, or a lock) and had its core taken away (involuntary); and its
    time runnable without a core over the whole window (µs a message: a wake from ``poll``
    included, so an upper bound of what the messages waited for cores); and the messages a run
    of the executors (about a batch)."""
    runs = used.get("executor_runs") or 0
    taken = used.get("messages") or 0
    if not messages:
        return dict.fromkeys(
            ("io_wait_us_per_message", "io_core_wait_us_per_message", "io_blocks_per_message",
             "io_preemptions_per_message", "io_run_delay_us_per_message"),
            None,
        ) | {"messages_per_run": taken / runs if runs else None}  # fmt: skip
    return {
        "io_wait_us_per_message": 1e6 * waited_s / messages,
        "io_core_wait_us_per_message": (
            1e6 * used["message_core_wait_s"] / messages if "message_core_wait_s" in used else None
        ),
        "io_blocks_per_message": (
            used["message_blocks"] / messages if "message_blocks" in used else None
        ),
        "io_preemptions_per_message": (
            used["message_preemptions"] / messages if "message_preemptions" in used else None
        ),
        "io_run_delay_us_per_message": (
            1e6 * used["io_run_delay_s"] / taken if taken and "io_run_delay_s" in used else None
        ),
        "messages_per_run": taken / runs if runs else None,
    }


def _feeding(used: dict[str, Any], samples: int) -> dict[str, float | None]:
    """Whether the pipelines' DALI threads were kept fed over a window: the samples of a run
    (how full the runs were), the executors' seconds per second spent waiting for batches to
    run (``RunPlanner.next_run``) and for DALI to finish a run (``PipelineRunner.collect``),
    summed over executors, and the share of the window DALI's worker threads slept (no work:
    a core left to others, or idle) and were runnable but waiting for a core."""
    seconds = used.get("seconds") or 0.0
    runs = used.get("executor_runs") or 0
    workers = [
        figures
        for name, figures in (used.get("sched_by_thread_name") or {}).items()
        if name.startswith(DALI_WORKER_PREFIX)
    ]
    span = sum(count for count, _, _ in workers) * (used.get("sched_seconds") or 0.0)
    on_cpu = sum(cpu for _, cpu, _ in workers)
    waiting = sum(wait for _, _, wait in workers)
    return {
        "samples_per_run": samples / runs if runs else None,
        "executors_waiting_for_batches": (
            used["next_run_wall_s"] / seconds if seconds and "next_run_wall_s" in used else None
        ),
        "executors_waiting_for_dali": (
            used["collect_wall_s"] / seconds if seconds and "collect_wall_s" in used else None
        ),
        "dali_workers_asleep": max(0.0, 1 - (on_cpu + waiting) / span) if span else None,
        "dali_workers_waiting_for_a_core": waiting / span if span else None,
    }


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] != ["serve"]:
        raise SystemExit("usage: python -m bench.threads serve [dalid serve options]")
    sys.exit(serve(sys.argv[2:]))
