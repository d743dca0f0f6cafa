"""Processes for real: several jobs, killed trainers, daemon shutdown, autostart, stale sockets."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dalid.client as dalid
from dalid.protocol import socket_path

from ..daemons import (
    alive,
    kill_leftovers,
    start_daemon,
    start_job,
    wait_for,
    wait_until_answering,
)
from .helpers import BATCH, ProxyDataset, sample, two_output_pipeline


@pytest.mark.slow
def test_two_jobs_at_once_each_get_their_own_data(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    jobs = [
        start_job("trainer_job", daemon.socket, "--offset", str(offset)) for offset in (0, 1000)
    ]
    try:
        for job in jobs:
            out, _ = job.communicate(timeout=120)
            assert job.returncode == 0, out
            assert "ok 64" in out
    finally:
        kill_leftovers(jobs)
        assert daemon.stop() == 0
    assert not daemon.segments()


@pytest.mark.slow
def test_killed_trainer_is_reclaimed_while_another_job_runs(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    jobs: list[subprocess.Popen[str]] = []
    try:
        holder = start_job("trainer_job", daemon.socket, "--hold", "--offset", "5")
        jobs.append(holder)
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "holding"
        assert daemon.segments(), "the held batch lives in the daemon's shared memory"
        survivor = start_job("trainer_job", daemon.socket, "--offset", "77", "--length", "200")
        jobs.append(survivor)
        os.kill(holder.pid, signal.SIGKILL)
        holder.communicate()
        # The killed job's slabs go within 5 s; the survivor's own may come and go meanwhile.
        wait_for(
            lambda: re.search(r"job 1: .*freeing what it held", daemon.log_text()) is not None,
            5.0,
            "the daemon to notice the killed trainer",
        )
        wait_for(lambda: not daemon.job_segments(1), 5.0, "job 1's slabs")
        out, _ = survivor.communicate(timeout=120)
        assert survivor.returncode == 0, out
        assert "ok 200" in out
    finally:
        kill_leftovers(jobs)
        assert daemon.stop() == 0
    assert not daemon.segments()


def test_sigterm_stops_cleanly_while_a_job_holds_tensors(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    session = dalid.connect(socket=daemon.socket, autostart=False)
    try:
        proxy = session.proxy(two_output_pipeline())
        loader = dalid.DataLoader(session, ProxyDataset(proxy, BATCH), batch_size=BATCH)
        (_, shifted), _ = next(iter(loader))
        assert daemon.segments()
        assert daemon.stop() == 0
        assert not daemon.socket.exists()
        assert not daemon.segments()
        # The names are gone, but the pages stay mapped for the tensors that view them.
        np.testing.assert_array_equal(shifted[3].numpy(), sample(3) + 7)
    finally:
        session.close()


def test_a_second_daemon_on_the_same_socket_is_refused(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    try:
        second = subprocess.run(
            [sys.executable, "-m", "dalid.server", "serve", "--socket", str(daemon.socket)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert second.returncode == 3
        assert f"pid {daemon.pid}" in second.stderr and "already serves" in second.stderr
    finally:
        assert daemon.stop() == 0


def test_a_new_daemon_takes_over_the_socket_of_a_killed_one(short_tmp: Path) -> None:
    first = start_daemon(short_tmp)
    os.kill(first.pid, signal.SIGKILL)
    first.process.wait()
    assert first.socket.exists(), "a killed daemon leaves its socket file"
    with pytest.raises(dalid.DaemonUnavailable):
        dalid.connect(socket=first.socket, autostart=False)
    second = start_daemon(short_tmp)
    try:
        with dalid.connect(socket=second.socket, autostart=False) as session:
            proxy = session.proxy(two_output_pipeline())
            loader = dalid.DataLoader(session, ProxyDataset(proxy, BATCH), batch_size=BATCH)
            (_, shifted), _ = next(iter(loader))
            np.testing.assert_array_equal(shifted[0].numpy(), sample(0) + 7)
    finally:
        assert second.stop() == 0


def test_client_notices_a_killed_daemon(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dalid.client.link import watch

    monkeypatch.setattr(watch, "PING_AFTER_S", 0.2)
    monkeypatch.setattr(watch, "PING_TIMEOUT_S", 1.0)
    daemon = start_daemon(short_tmp)
    with dalid.connect(socket=daemon.socket, autostart=False) as session:
        # Deterministic: the batch waits in the daemon until produce_data asks for it, so its
        # result cannot arrive before the kill, however busy the machine.
        proxy = session.proxy(two_output_pipeline(), deterministic=True)
        refs = [proxy(sample(i)) for i in range(2)]
        import torch

        batch = torch.utils.data.default_collate(refs)
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.process.wait()
        with pytest.raises(dalid.DaemonUnavailable, match=str(daemon.socket)):
            session.produce_data(batch)


def test_autostart_then_dalid_stop(
    private_runtime_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = socket_path("cpu")
    assert path.parent == private_runtime_dir
    with dalid.connect(device="cpu") as session:
        # Where the daemon's log is, printed whatever the trainer's logging.
        log = private_runtime_dir / "cpu.sock.log"
        said = capfd.readouterr().err
        assert f"its log is {log}" in said
        pid = session.daemon_pid
        # Which daemon it started, and where.
        assert f"started a daemon (pid {pid}) for device cpu on ipc://{path}" in said
        proxy = session.proxy(two_output_pipeline())
        loader = dalid.DataLoader(session, ProxyDataset(proxy, BATCH), batch_size=BATCH)
        (_, shifted), _ = next(iter(loader))
        np.testing.assert_array_equal(shifted[1].numpy(), sample(1) + 7)
        del shifted, loader
    stop = subprocess.run(
        [sys.executable, "-m", "dalid.server", "stop", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert stop.returncode == 0, stop.stderr
    assert stop.stdout.startswith(f"stopped the dalid cpu daemon pid {pid} on ipc://{path}")
    wait_for(lambda: not alive(pid), 10.0, "the autostarted daemon to exit")
    # Of this daemon, only the log, which says what it did, stays behind (the directory is
    # the whole test session's; the next test checks an empty one).
    left = {p.name for p in private_runtime_dir.iterdir() if p.name.startswith("cpu.sock")}
    assert left == {"cpu.sock.log"}
    log.unlink()


def test_a_clean_stop_leaves_nothing_behind_and_every_command_says_how_to_start_one(
    short_tmp: Path,
) -> None:
    runtime = short_tmp / "runtime"
    serve = [sys.executable, "-m", "dalid.server", "serve", "--runtime-dir", str(runtime)]
    daemon = subprocess.Popen([*serve, "--no-supervisor"], stderr=subprocess.PIPE, text=True)
    try:
        wait_until_answering(runtime / "cpu.sock", daemon)  # type: ignore[arg-type]
        # The socket, its lock, and what the pipelines run (crash attribution,
        # server/pipelines/flight.py).
        assert {p.name for p in runtime.iterdir()} == {
            "cpu.sock",
            "cpu.sock.lock",
            "cpu.sock.inflight",
            "cpu.sock.fault",
            "cpu.sock.oom",
        }
        with dalid.connect(socket=runtime / "cpu.sock", autostart=False, name="told"):
            stop = _dalid("stop", "--runtime-dir", str(runtime))
            assert stop.returncode == 0, stop.stderr
            assert "stopped the dalid cpu daemon pid" in stop.stdout
            assert "its 1 job(s) were told" in stop.stdout
        assert daemon.wait(timeout=20) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
        daemon.communicate()
    assert list(runtime.iterdir()) == []
    for command in ("stop", "ping", "status", "reload"):
        done = _dalid(command, "--runtime-dir", str(runtime))
        assert done.returncode == 1
        start = f"start one with `dalid serve --device cpu --socket {runtime}/cpu.sock`"
        assert start in done.stderr, done.stderr


def test_dalid_stop_with_a_job_connected_stops_the_daemon_and_imports_no_numpy_torch_or_dali(
    short_tmp: Path,
) -> None:
    """`dalid stop` is mostly its own start on a busy machine: the daemon is gone in a fraction
    of a second. Its process imports nothing a training job needs (numpy, torch, DALI) nor the
    daemon itself, so that it starts in a fraction of a second too (timings are the bench's)."""
    daemon = start_daemon(short_tmp)
    session = dalid.connect(socket=daemon.socket, autostart=False, name="training")
    try:
        proxy = session.proxy(two_output_pipeline())
        loader = dalid.DataLoader(session, ProxyDataset(proxy, BATCH * 2), batch_size=BATCH)
        batches = iter(loader)
        next(batches)  # a job mid-epoch, holding outputs
        # -X importtime lists, on stderr, every module the command's process imports.
        command = [sys.executable, "-X", "importtime", "-m", "dalid.server", "stop"]
        stop = subprocess.run(
            [*command, "--socket", str(daemon.socket)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert stop.returncode == 0, stop.stderr
        assert "its 1 job(s) were told that it was stopped" in stop.stdout
        assert daemon.process.wait(timeout=20) == 0
        assert not daemon.socket.exists()
        imported = {
            line.rpartition("|")[2].strip()
            for line in stop.stderr.splitlines()
            if line.startswith("import time:")
        }
        assert {"zmq", "dalid.server.operations.control", "dalid.protocol.codec"} <= imported
        heavy = sorted(
            name
            for name in imported
            if name.partition(".")[0] in ("numpy", "torch", "nvidia", "rich")
            or name.startswith(("dalid.server.intake.daemon", "dalid.server.handling"))
        )
        assert heavy == [], heavy
        del batches
    finally:
        session.close()
        daemon.stop()
    assert not daemon.segments()


def _dalid(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dalid.server", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_version() -> None:
    from importlib import metadata

    from dalid.protocol import PROTOCOL_VERSION

    done = _dalid("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == (
        f"dalid {metadata.version('dalid')}, protocol version {PROTOCOL_VERSION}"
    )


def test_idle_timeout_ends_an_unused_daemon(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp, "--idle-timeout", "1")
    with dalid.connect(socket=daemon.socket, autostart=False):
        time.sleep(1.5)
        assert daemon.process.poll() is None, "a daemon with a job is not idle"
    daemon.process.wait(timeout=10)
    assert daemon.process.returncode == 0
    assert not daemon.socket.exists()


def test_wait_until_answering_is_used(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    try:
        wait_until_answering(daemon.socket, daemon.process)
    finally:
        daemon.stop()
