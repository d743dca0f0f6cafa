"""A trainer frozen past its heartbeats (SIGSTOP of its process group, as a debugger or a
container freeze does): the daemon ends its job, and once it runs again the job carries on
(``reconnect=True``) or raises an error that says why, never a silent wait."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..daemons import STARTED_PIDS, kill_leftovers, start_daemon

ROOT = Path(__file__).resolve().parents[2]
LENGTH = 160
# Past the time a trainer may stay stopped before the daemon drops it (FROZEN_LIMIT_S, 3 s).
FROZEN_S = 6.0


def _frozen_at_pause(socket: Path, *args: str) -> subprocess.Popen[str]:
    """restart_job in a process group of its own, frozen with its DataLoader workers for
    FROZEN_S at its pause, then let go on."""
    job = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.restart_job", "--socket", str(socket), *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    STARTED_PIDS.add(job.pid)
    assert job.stdout is not None and job.stdin is not None
    line = job.stdout.readline()
    assert line.strip() == "paused", line + job.stdout.read()
    os.killpg(job.pid, signal.SIGSTOP)
    time.sleep(FROZEN_S)
    os.killpg(job.pid, signal.SIGCONT)
    job.stdin.write("go\n")
    job.stdin.flush()
    return job


@pytest.mark.slow
def test_a_frozen_job_with_reconnect_carries_on_with_every_sample_once(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    job = _frozen_at_pause(daemon.socket, "--reconnect", "--epochs", "2", "--length", str(LENGTH))
    try:
        out, _ = job.communicate(timeout=120)
        assert job.returncode == 0, out
        # Both epochs, every sample once each, after one reconnection to the same daemon.
        assert f"ok {2 * LENGTH} reconnects 1" in out, out
        assert "was stopped or frozen for a few seconds" in out, out
    finally:
        kill_leftovers([job])
        assert daemon.stop() == 0
    assert not daemon.segments()


def test_a_frozen_job_without_reconnect_raises_why(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    job = _frozen_at_pause(daemon.socket, "--length", str(LENGTH))
    try:
        out, _ = job.communicate(timeout=120)
        assert job.returncode != 0, out
        assert "DaemonUnavailable" in out, out
        assert "dropped the trainer's connection" in out, out
        assert "was stopped or frozen for a few seconds" in out, out
        assert "connect with reconnect=True" in out, out
        assert "restarts a crashed daemon" not in out, out
    finally:
        kill_leftovers([job])
        assert daemon.stop() == 0
    assert not daemon.segments()
