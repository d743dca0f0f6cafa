"""The supervisor and its daemon, each outliving the other in the wrong way, for real: a daemon
that keeps crashing (as under an OOM killer) and a supervisor killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import dalid.client as dalid
from dalid.protocol import slabs
from dalid.server.operations import crash_report
from dalid.server.operations.lifeline import ORPHAN_GRACE_S

from ..daemons import ROOT, alive, descendants, ping_pid, start_daemon, wait_for
from .helpers import BATCH, ProxyDataset, sample, two_output_pipeline


def _children(pid: int) -> list[int]:
    return sorted(descendants(pid))


def _kill(pid: int) -> None:
    """Kills a daemon left behind by a test that failed (it is no longer the test's child)."""
    if pid and alive(pid):
        os.kill(pid, signal.SIGKILL)


def _status(socket: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dalid.server", "status", "--socket", str(socket), *flags],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _serve(socket: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "dalid.server", "serve", "--socket", str(socket), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _end(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


# A repository file that kills its daemon as an OOM killer would, at each of the first three
# starts (saying so first), and at the fourth start waits for the test to let it load.
CRASHING = """
import os, pathlib, signal, sys, time
count = pathlib.Path({count!r})
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
if n <= 3:
    print(f"start {{n}}: simulated out of memory", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
while not pathlib.Path({release!r}).exists():
    time.sleep(0.05)
from nvidia.dali import fn, pipeline_def

@pipeline_def(batch_size=4, num_threads=1, device_id=None)
def doubled():
    return fn.external_source(name="data", no_copy=True) * 2
"""


def test_a_crash_looping_daemon_is_restarted_and_reported(short_tmp: Path, tmp_path: Path) -> None:
    repository = tmp_path / "pipelines"
    repository.mkdir(mode=0o755)
    count, release = tmp_path / "count", tmp_path / "release"
    (repository / "crash.py").write_text(CRASHING.format(count=str(count), release=str(release)))
    socket, log = short_tmp / "d.sock", short_tmp / "serve.log"
    supervisor = _serve(socket, log, "--pipelines", str(repository))
    try:
        # Three crashes in a row, then a fourth start that waits: no daemon answers meanwhile.
        wait_for(lambda: count.exists() and count.read_text() == "4", 60, "the fourth start")
        assert crash_report.path_for(socket).exists()
        status = _status(socket)
        assert status.returncode == 1
        assert "daemon cpu is crash-looping: 3 crashes in a row, each within 30 s" in status.stderr
        assert "the last one was killed by signal 9" in status.stderr
        assert "start 3: simulated out of memory" in status.stderr  # its last log lines
        assert "no dalid daemon listens on" in status.stderr
        as_json = _status(socket, "--json")
        assert as_json.returncode == 1
        report = json.loads(as_json.stdout)["crash_loop"]
        assert report["crashes"] == 3 and report["last_exit"] == "was killed by signal 9"
        text = log.read_text()
        assert "is crash-looping" in text and "start 3: simulated out of memory" in text
        # The supervisor did not give up: the next start serves, and says it recovers.
        release.touch()
        wait_for(lambda: ping_pid(socket) is not None, 60, "the daemon to answer")
        status = _status(socket, "--once")
        assert status.returncode == 0, status.stderr
        assert "is crash-looping" in status.stderr  # until it has run 30 s
        assert "dalid cpu daemon pid" in status.stdout
        with dalid.connect(socket=socket, autostart=False) as session:
            proxy = session.proxy("doubled")
            refs = [proxy(data=sample(i)) for i in range(4)]
            (out,) = session.produce_data([torch.utils.data.default_collate(refs)])
            np.testing.assert_array_equal(out.numpy(), np.stack([sample(i) for i in range(4)]) * 2)
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(60) == 0, log.read_text()
        assert not crash_report.path_for(socket).exists()
        assert not socket.exists()
    finally:
        _end(supervisor)


def test_a_killed_supervisor_takes_its_daemon_with_it(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp, supervised=True)
    child = daemon.daemon_pid()
    try:
        with dalid.connect(socket=daemon.socket, autostart=False) as session:
            proxy = session.proxy(two_output_pipeline())
            loader = dalid.DataLoader(session, ProxyDataset(proxy, BATCH), batch_size=BATCH)
            (_, shifted), _ = next(iter(loader))
            assert daemon.segments()
            os.kill(daemon.pid, signal.SIGKILL)
            daemon.process.wait()
            wait_for(lambda: not alive(child), 15, "the daemon to exit with its supervisor")
            # It stopped as on SIGTERM: nothing of it is left to block a new supervisor.
            assert not daemon.socket.exists()
            assert not daemon.segments()
            np.testing.assert_array_equal(shifted[1].numpy(), sample(1) + 7)
    finally:
        daemon.stop()
    assert start_daemon(short_tmp).stop() == 0


def test_a_stuck_daemon_exits_when_its_supervisor_is_killed(short_tmp: Path) -> None:
    """A daemon whose loop never sees a stop (as one stuck receiving a flood): SIGTERM from
    PR_SET_PDEATHSIG alone would leave it running, holding the socket."""
    socket, log = short_tmp / "d.sock", short_tmp / "stuck.log"
    with log.open("wb") as out:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.stuck_daemon", str(socket)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    child = 0
    try:
        wait_for(lambda: "the loop is stuck" in log.read_text(), 60, "the daemon to get stuck")
        (child,) = _children(supervisor.pid)
        assert socket.exists()
        assert any(record.pid == child for _, record in slabs.user_segments())
        os.kill(supervisor.pid, signal.SIGKILL)
        killed = time.monotonic()
        supervisor.wait()
        wait_for(lambda: not alive(child), ORPHAN_GRACE_S + 15, "the stuck daemon to exit")
        # Not by the SIGTERM (which it ignored) but once its grace had passed. (Its log went to
        # the supervisor's pipe, gone with it.)
        assert time.monotonic() - killed >= ORPHAN_GRACE_S - 0.5
        # What a stop would have removed, it removed.
        assert not socket.exists()
        assert not any(record.pid == child for _, record in slabs.user_segments())
    finally:
        _end(supervisor)
        _kill(child)
    assert start_daemon(short_tmp).stop() == 0


def test_a_daemon_stuck_loading_its_repository_exits_when_its_supervisor_is_killed(
    short_tmp: Path, tmp_path: Path
) -> None:
    repository = tmp_path / "pipelines"
    repository.mkdir(mode=0o755)
    (repository / "hangs.py").write_text("import time\nwhile True:\n    time.sleep(1)\n")
    socket, log = short_tmp / "d.sock", short_tmp / "serve.log"
    supervisor = _serve(socket, log, "--pipelines", str(repository))
    child = 0
    try:
        wait_for(lambda: len(_children(supervisor.pid)) == 1, 60, "the daemon to start")
        (child,) = _children(supervisor.pid)
        # It holds the socket's lock, then handles SIGTERM, then loads its repository.
        lock = socket.with_name("d.sock.lock")
        wait_for(lambda: lock.exists() and lock.read_text() == str(child), 60, "the socket's lock")
        time.sleep(1.0)
        os.kill(supervisor.pid, signal.SIGKILL)
        killed = time.monotonic()
        supervisor.wait()
        wait_for(lambda: not alive(child), ORPHAN_GRACE_S + 15, "the stuck daemon to exit")
        assert time.monotonic() - killed >= ORPHAN_GRACE_S - 0.5  # its grace, not SIGTERM
    finally:
        _end(supervisor)
        _kill(child)
    # The socket's lock went with it: a new daemon serves there.
    assert start_daemon(short_tmp).stop() == 0
