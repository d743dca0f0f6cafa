"""A daemon stopped under a running job, and no daemon after it: the job is told, and says so.

The job (``restart_job``: a trainer and two DataLoader workers) pauses mid-epoch with batches
in flight; the test stops the daemon with ``dalid stop`` or SIGTERM to ``dalid serve``, then
lets the job go on. A job without ``reconnect=True`` must fail at once with ``DaemonStopped``
saying that the daemon was stopped and why; so must one with it after ``dalid stop
--end-jobs``. One with it after a plain stop waits for a new daemon (test_rolling_update.py),
and when none comes within its reconnect timeout, says that the daemon was stopped and that
nothing came back. Nothing in its output may speak of a crash or of protocol errors.
"""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dalid.client as dalid

from ..daemons import DaemonProcess, kill_leftovers, start_daemon
from .helpers import sample, two_output_pipeline
from .test_restarts import _job

# What a job that saw its daemon stopped must not say: guesses at a crash, protocol noise.
NOT_SAID = (
    "killed",
    "crashed",
    "send hello first",
    "malformed",
    "not_welcomed",
    "it was restarted",
)


@pytest.mark.parametrize(
    ("how", "reconnect"),
    [("dalid stop", False), ("dalid stop --end-jobs", True), ("SIGTERM", False)],
    ids=["dalid-stop", "end-jobs-reconnect", "sigterm"],
)
def test_a_job_is_told_that_its_daemon_was_stopped(
    short_tmp: Path, how: str, reconnect: bool
) -> None:
    daemon = start_daemon(short_tmp, supervised=True)
    job = _job(daemon.socket, "--pause-at", "3", *(["--reconnect"] if reconnect else []))
    try:
        assert job.stdout is not None and job.stdin is not None
        line = job.stdout.readline()
        assert line.strip() == "paused", line + job.stdout.read()
        if how.startswith("dalid stop"):
            stop = subprocess.run(
                [sys.executable, "-m", "dalid.server", *how.split()[1:], "--socket",
                 str(daemon.socket)],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )  # fmt: skip
            assert stop.returncode == 0, stop.stderr
            assert "its 1 job(s) were told that it was stopped" in stop.stdout
            reason = f"`{how}` asked it to"
            said = "and ended this job" if reconnect else "which ends a job without reconnect=True"
        else:
            daemon.process.send_signal(signal.SIGTERM)
            reason = "it received SIGTERM"
            said = "which ends a job without reconnect=True"
        # The supervisor does not restart a daemon that was stopped: it exits, cleanly.
        assert daemon.process.wait(timeout=30) == 0
        started = time.monotonic()
        job.stdin.write("go\n")
        job.stdin.flush()
        out, _ = job.communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        kill_leftovers([job])
        daemon.stop()
    assert job.returncode != 0, out
    assert "DaemonStopped" in out, out
    assert f"was stopped ({reason}" in out, out
    assert said in out, out
    assert "waits up to" not in out, out
    for words in NOT_SAID:
        assert words not in out, f"{words!r} in the job's output:\n{out}"
    # Not the minute a reconnecting job waits for a daemon that was killed.
    assert took < 20, f"the job took {took:.0f} s to give up:\n{out}"
    log = daemon.log_text()
    assert "telling 3 connected peer(s)" in log, log
    assert not daemon.segments()
    assert not daemon.socket.exists()
    assert not daemon.socket.with_name(daemon.socket.name + ".lock").exists()


def test_a_job_with_reconnect_waits_for_a_new_daemon_then_says_none_came(short_tmp: Path) -> None:
    """SIGTERM, as an upgrade starts, and no daemon after it: the job waits its reconnect
    timeout, saying so in one warning line, then fails saying what happened."""
    daemon = start_daemon(short_tmp, supervised=True)
    job = _job(daemon.socket, "--pause-at", "3", "--reconnect", "--reconnect-timeout", "3")
    try:
        assert job.stdout is not None and job.stdin is not None
        line = job.stdout.readline()
        assert line.strip() == "paused", line + job.stdout.read()
        daemon_pid = daemon.daemon_pid()
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.process.wait(timeout=30) == 0
        job.stdin.write("go\n")
        job.stdin.flush()
        out, _ = job.communicate(timeout=60)
    finally:
        kill_leftovers([job])
        daemon.stop()
    assert job.returncode != 0, out
    notice = f"the dalid daemon on ipc://{daemon.socket} (pid {daemon_pid}) was stopped (it "
    assert f"{notice}received SIGTERM): this job (reconnect=True) waits up to 3 s" in out, out
    assert out.count("waits up to") == 1, out
    assert "DaemonStopped" in out, out
    assert f"received SIGTERM), and no dalid daemon came back on {daemon.socket} within 3 s" in out
    for words in NOT_SAID:
        assert words not in out, f"{words!r} in the job's output:\n{out}"


def test_a_worker_whose_job_ended_is_told_so_not_that_the_daemon_restarted(
    daemon: DaemonProcess,
) -> None:
    from dalid.client.link.connection import Connection
    from dalid.protocol import Role

    session = dalid.connect(socket=daemon.socket, autostart=False)
    target = session.proxy(two_output_pipeline()).target
    worker = Connection(
        daemon.socket, Role.WORKER, job_id=target.job_id, job_token=target.job_token
    )
    try:
        session.close()
        request = target.submission({target.input_names[0]: [sample(0)]}, deferred=False)
        with pytest.raises(dalid.DaemonUnavailable) as caught:
            worker.request(request)
        assert f"ended job {target.job_id}" in str(caught.value)
        assert "restarted" not in str(caught.value)
    finally:
        worker.close()


def test_a_worker_whose_job_ended_says_goodbye_and_nothing_more(daemon: DaemonProcess) -> None:
    """A worker that leaves after its job ended is answered ``not_welcomed``: its goodbye is
    done, and it does not ping the daemon to learn whether another one answers now (with many
    jobs, every worker's goodbye at the end of each job would cost the daemon a message)."""
    from dalid.client.link.connection import Connection
    from dalid.protocol import Message, Role

    sent: list[str] = []

    class Recorded(Connection):
        def _send(self, message: Message, request_id: int | None) -> None:
            sent.append(message.OP)
            super()._send(message, request_id)

    session = dalid.connect(socket=daemon.socket, autostart=False)
    target = session.proxy(two_output_pipeline()).target
    worker = Recorded(daemon.socket, Role.WORKER, job_id=target.job_id, job_token=target.job_token)
    try:
        session.close()
    finally:
        worker.close()
    assert sent == ["hello", "goodbye"]


def test_a_live_dalid_status_says_at_once_that_the_daemon_stopped(short_tmp: Path) -> None:
    """`dalid status` in a terminal refreshes its table until the daemon stops cleanly; then it
    says that the daemon stopped, not, a timeout later, that it may have been killed."""
    daemon = start_daemon(short_tmp)
    controller, terminal = pty.openpty()
    status = subprocess.Popen(
        [sys.executable, "-m", "dalid.server", "status", "--socket", str(daemon.socket),
         "--interval", "0.1", "--timeout", "60"],
        stdin=terminal, stdout=terminal, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    os.close(terminal)
    try:
        seen = b""
        while b"daemon pid" not in seen:  # the live table is up
            seen += os.read(controller, 4096)
        stop = subprocess.run(
            [sys.executable, "-m", "dalid.server", "stop", "--socket", str(daemon.socket)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert stop.returncode == 0, stop.stderr
        # Well within its 60 s timeout: it noticed the socket go.
        _, said = status.communicate(timeout=30)
    finally:
        kill_leftovers([status])
        os.close(controller)
        daemon.stop()
    assert status.returncode == 1
    assert f"the dalid daemon on ipc://{daemon.socket} stopped" in said, said
    assert not any(word in said for word in NOT_SAID), said
