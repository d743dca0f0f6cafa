"""Rolling updates under running jobs: the daemon replaced, the jobs carry on.

Four jobs (``restart_job``: a trainer and two DataLoader workers each, ``reconnect=True``) run
while their daemon goes three times: twice stopped with SIGTERM to ``dalid serve`` (what
Kubernetes and systemd send before they start the new one), once with ``kill -9`` of
``dalid serve`` (its daemon gets SIGTERM from ``PR_SET_PDEATHSIG``). Each time a new daemon is
started on the same socket a moment later, while the jobs wait. Every job checks that each
epoch saw every index once and only once, and says one warning line per stop, naming why the
daemon went (the killed supervisor's daemon tells its peers that, not that it was stopped by
someone).
"""

from __future__ import annotations

import functools
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ..daemons import DaemonProcess, alive, kill_leftovers, start_daemon, wait_for
from .test_restarts import _job

JOBS = 4
LENGTH = 160  # 20 batches of 8 an epoch
PAUSES = "3,7,11"


def _wait_paused(jobs: list[subprocess.Popen[str]], outputs: list[list[str]]) -> None:
    for job, lines in zip(jobs, outputs, strict=True):
        assert job.stdout is not None
        while True:
            line = job.stdout.readline()
            if not line:
                raise AssertionError("a job ended before its pause:\n" + "".join(lines))
            lines.append(line)
            if line.strip() == "paused":
                break


def _gone(pid: int) -> bool:
    return not alive(pid)


def _go(jobs: list[subprocess.Popen[str]]) -> None:
    for job in jobs:
        assert job.stdin is not None
        job.stdin.write("go\n")
        job.stdin.flush()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_jobs_carry_on_across_rolling_updates_and_a_killed_supervisor(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp, supervised=True, log_name="d0")
    daemons: list[DaemonProcess] = [daemon]
    jobs = [
        _job(daemon.socket, "--reconnect", "--pause-at", PAUSES, "--length", str(LENGTH))
        for _ in range(JOBS)
    ]
    outputs: list[list[str]] = [[] for _ in jobs]
    stopped: list[tuple[int, str]] = []
    try:
        for round_, how in enumerate(("SIGTERM", "SIGTERM", "kill -9 of dalid serve"), start=1):
            _wait_paused(jobs, outputs)
            child = daemon.daemon_pid()
            if how == "SIGTERM":
                daemon.process.send_signal(signal.SIGTERM)
                assert daemon.process.wait(timeout=30) == 0, daemon.log_text()
                stopped.append((child, "it received SIGTERM"))
            else:
                daemon.process.kill()
                daemon.process.wait()
                wait_for(functools.partial(_gone, child), 30, "the orphaned daemon to stop")
                stopped.append((child, f"its supervisor `dalid serve` (pid {daemon.pid}) died"))
            # The jobs go on with the daemon gone, and wait; the new one comes a moment later.
            _go(jobs)
            time.sleep(1.0)
            daemon = start_daemon(short_tmp, supervised=True, log_name=f"d{round_}")
            daemons.append(daemon)
        for job, lines in zip(jobs, outputs, strict=True):
            out, _ = job.communicate(timeout=180)
            lines.append(out)
    finally:
        kill_leftovers(jobs)
        for each in daemons:
            each.stop()
    for job, lines in zip(jobs, outputs, strict=True):
        out = "".join(lines)
        assert job.returncode == 0, out
        # Every index of the epoch once (restart_job checks it, and says ok only then).
        assert f"ok {LENGTH} reconnects 3" in out, out
        for pid, reason in stopped:
            said = f"(pid {pid}) was stopped ({reason}): this job (reconnect=True) waits up to"
            assert out.count(said) == 1, out
        assert "Traceback" not in out, out
    for each in daemons:
        assert not each.segments(), each.log_text()
    assert not any(alive(pid) for each in daemons for pid in each.daemon_pids)
    assert not daemon.socket.exists()
