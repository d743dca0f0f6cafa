"""Jobs that die at any moment: noticed within 5 s, everything they held freed, others unharmed."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import zmq

import dalid.client as dalid
from dalid.protocol import Ping, Pong, transport
from dalid.protocol.address import endpoint

from ..daemons import DaemonProcess, kill_leftovers, start_daemon, start_job, wait_for
from .helpers import two_output_pipeline

pytestmark = pytest.mark.slow

# The promise: a dead job's pipelines and buffers are freed within this long.
NOTICE_S = 5.0


def _first_line(job: subprocess.Popen[str]) -> str:
    assert job.stdout is not None
    return job.stdout.readline().strip()


def _job_id(daemon: DaemonProcess, name: str) -> int:
    (job,) = [job for job in daemon.status().jobs if job.name == name]
    return int(job.job_id)


def _freed(daemon: DaemonProcess, job_id: int) -> bool:
    jobs = {job.job_id for job in daemon.status().jobs}
    return job_id not in jobs and not daemon.job_segments(job_id)


def test_a_killed_trainer_is_freed_within_5_s_and_can_come_back_at_once(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    jobs: list[subprocess.Popen[str]] = []
    try:
        victim = start_job(
            "trainer_job", daemon.socket, "--hold", "--offset", "5", "--workers", "4"
        )
        jobs.append(victim)
        assert _first_line(victim) == "holding"
        job_id = _job_id(daemon, "job5")
        assert daemon.job_segments(job_id), "the held batch lives in the daemon's shared memory"
        survivors = [
            start_job("trainer_job", daemon.socket, "--offset", str(offset), "--length", "400")
            for offset in (77, 88)
        ]
        jobs.extend(survivors)
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # Not communicate(): its DataLoader workers hold its stdout until they notice it died.
        victim.wait()
        wait_for(lambda: _freed(daemon, job_id), NOTICE_S, "the killed job's pipelines and slabs")
        assert time.monotonic() - killed_at < NOTICE_S
        # The same job, restarted, connects and runs at once.
        again = start_job("trainer_job", daemon.socket, "--offset", "5", "--length", "64")
        jobs.append(again)
        for job, length in ((survivors[0], 400), (survivors[1], 400), (again, 64)):
            out, _ = job.communicate(timeout=180)
            assert job.returncode == 0, out
            assert f"ok {length}" in out
        victim.communicate()  # its workers are gone by now, and with them its stdout
    finally:
        kill_leftovers(jobs)
        assert daemon.stop() == 0
    assert not daemon.segments()


def test_a_stopped_trainer_is_dropped(short_tmp: Path) -> None:
    # A stopped process is alive to the kernel, and its socket stays open: the daemon finds it
    # by its process's state (server/intake/frozen.py).
    daemon = start_daemon(short_tmp)
    victim = start_job("trainer_job", daemon.socket, "--hold", "--offset", "6")
    try:
        assert _first_line(victim) == "holding"
        job_id = _job_id(daemon, "job6")
        os.kill(victim.pid, signal.SIGSTOP)
        wait_for(lambda: _freed(daemon, job_id), NOTICE_S, "the stopped job to be dropped")
        log = daemon.log_text()
        assert f"the trainer of pid {victim.pid} has been stopped for" in log, log
        assert "freeing what it held" in log, log
    finally:
        victim.kill()
        os.kill(victim.pid, signal.SIGCONT)
        victim.communicate()
        assert daemon.stop() == 0
    assert not daemon.segments()


FREEZER = Path("/sys/fs/cgroup/freezer")


@pytest.mark.skipif(
    not os.access(FREEZER, os.W_OK), reason="needs a writable cgroup v1 freezer (root)"
)
def test_a_trainer_frozen_by_its_cgroup_is_dropped(short_tmp: Path) -> None:
    """A paused container: its processes sleep as they were, their cgroup frozen."""
    daemon = start_daemon(short_tmp)
    cgroup = FREEZER / f"dalid-test-{os.getpid()}"
    cgroup.mkdir()
    victim = start_job("trainer_job", daemon.socket, "--hold", "--offset", "7")
    try:
        assert _first_line(victim) == "holding"
        job_id = _job_id(daemon, "job7")
        (cgroup / "cgroup.procs").write_text(str(victim.pid))
        (cgroup / "freezer.state").write_text("FROZEN")
        wait_for(lambda: _freed(daemon, job_id), NOTICE_S, "the frozen job to be dropped")
        log = daemon.log_text()
        assert f"the trainer of pid {victim.pid} has been frozen for" in log, log
    finally:
        (cgroup / "freezer.state").write_text("THAWED")
        victim.kill()
        victim.communicate()
        wait_for(lambda: not (cgroup / "cgroup.procs").read_text().strip(), 10, "an empty cgroup")
        cgroup.rmdir()
        assert daemon.stop() == 0
    assert not daemon.segments()


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def test_a_killed_worker_ends_its_job_and_no_other(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    jobs: list[subprocess.Popen[str]] = []
    try:
        victim = start_job("load_job", daemon.socket, "--name", "victim", "--workers", "4")
        other = start_job("load_job", daemon.socket, "--name", "other", "--batches", "40")
        jobs.extend([victim, other])
        assert _first_line(victim) == "running"
        job_id = _job_id(daemon, "victim")
        wait_for(lambda: len(_children(victim.pid)) >= 4, 30, "the victim's workers")
        os.kill(_children(victim.pid)[0], signal.SIGKILL)
        # torch's DataLoader notices its dead worker and fails the trainer's loop, which ends
        # the job; the daemon frees it once the trainer is gone.
        out, _ = victim.communicate(timeout=60)
        # Which error torch raises depends on what the worker was doing ("DataLoader worker
        # (pid N) is killed by signal", a reset connection, an EOF on its queue).
        assert victim.returncode != 0 and "Traceback" in out, out
        exited_at = time.monotonic()
        wait_for(lambda: _freed(daemon, job_id), NOTICE_S, "the victim's job to be freed")
        assert time.monotonic() - exited_at < NOTICE_S
        out, _ = other.communicate(timeout=120)
        assert other.returncode == 0, out
        assert "ok 40" in out
    finally:
        kill_leftovers(jobs)
        assert daemon.stop() == 0
    assert not daemon.segments()


def test_fifty_connect_and_kill_cycles_leave_the_daemon_at_its_baseline(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    try:

        def cycles(count: int) -> None:
            job = start_job("cycle_job", daemon.socket, "--cycles", str(count))
            out, _ = job.communicate(timeout=300)
            assert job.returncode == 0 and f"ok {count}" in out, out

        cycles(5)  # first allocations of the daemon's libraries, made once
        baseline = daemon.rss_bytes()
        cycles(50)
        assert not daemon.status().jobs
        assert not daemon.segments()
        grown = daemon.rss_bytes() - baseline
        assert grown < 16 << 20, f"the daemon grew by {grown >> 20} MiB over 50 cycles"
    finally:
        assert daemon.stop() == 0


def _ping_and_close_until(socket: Path, stop: threading.Event) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        while not stop.is_set():
            probe = transport.make_socket(context, zmq.DEALER, endpoint(socket), bind=False)
            try:
                transport.send(probe, Ping(), 1)
                assert isinstance(transport.recv(probe).message, Pong)
            finally:
                probe.close(linger=0)
    finally:
        context.term()


def test_connections_closing_while_jobs_connect_take_no_job_with_them(short_tmp: Path) -> None:
    # A closed connection's descriptor is reused at once by the next one to open (each
    # DataLoader worker that ends closes one): its close must never end the new peer's job.
    daemon = start_daemon(short_tmp)
    stop = threading.Event()
    churn = threading.Thread(target=_ping_and_close_until, args=(daemon.socket, stop))
    churn.start()
    try:
        for _ in range(60):
            with dalid.connect(socket=daemon.socket, autostart=False, name="next") as session:
                for _ in range(3):
                    session.proxy(two_output_pipeline())
    finally:
        stop.set()
        churn.join(10)
        assert daemon.stop() == 0
