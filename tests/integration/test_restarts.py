"""Daemon restarts for real: kill -9 of the daemon under a running job, and the supervisor."""

from __future__ import annotations

import functools
import gc
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dalid.client as dalid

from ..daemons import kill_leftovers, ping_pid, start_daemon, wait_for
from .helpers import BATCH, ProxyDataset, sample, two_output_pipeline

ROOT = Path(__file__).resolve().parents[2]
LENGTH = 160


def _job(socket: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.restart_job", "--socket", str(socket), *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _kill_daemon_at_pause(job: subprocess.Popen[str], daemon_pid: int) -> None:
    """Waits for the job to pause mid-epoch, kills its daemon and lets the job go on."""
    assert job.stdout is not None and job.stdin is not None
    line = job.stdout.readline()
    assert line.strip() == "paused", line + job.stdout.read()
    os.kill(daemon_pid, signal.SIGKILL)
    job.stdin.write("go\n")
    job.stdin.flush()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _batch(proxy: dalid.Proxy, number: int) -> Any:
    refs = [proxy(sample(BATCH * number + row)) for row in range(BATCH)]
    return torch.utils.data.default_collate(refs)


def _check(outputs: Any, number: int) -> None:
    scaled, shifted = outputs
    for row in range(BATCH):
        expected = sample(BATCH * number + row)
        np.testing.assert_array_equal(shifted[row].numpy(), expected + 7)
        np.testing.assert_array_equal(scaled[row].numpy(), expected * 0.5 + 1.0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_batches_of_a_killed_daemon_are_submitted_again(
    short_tmp: Path, deterministic: bool, caplog: pytest.LogCaptureFixture
) -> None:
    first = start_daemon(short_tmp)
    session = dalid.connect(socket=first.socket, autostart=False, reconnect=True)
    second = None
    try:
        proxy = session.proxy(two_output_pipeline(), deterministic=deterministic)
        batches = [_batch(proxy, number) for number in range(3)]
        delivered = session.produce_data(batches[0])
        os.kill(first.pid, signal.SIGKILL)
        first.process.wait()
        second = start_daemon(short_tmp)
        with caplog.at_level(logging.WARNING, logger="dalid.client"):
            # Batches 1 and 2 may have arrived before the kill, in slabs already mapped: then
            # they are delivered from the old daemon's memory, and the reconnection waits for
            # batch 3. Either way each batch comes once, with its own data.
            for number in (1, 2):
                _check(session.produce_data(batches[number]), number)
            # Tensors from the killed daemon stay valid; freeing them sends nothing to the new
            # one, whose regions have other ids.
            _check(delivered, 0)
            del delivered
            gc.collect()
            # The proxy now submits to the new daemon's job.
            _check(session.produce_data(_batch(proxy, 3)), 3)
            assert session.reconnects == 1
            assert session.daemon_pid == second.pid
            # The goodbye's answer comes after any error about the releases sent before it.
            session.close()
        assert not [r for r in caplog.records if r.getMessage().startswith("dalid daemon:")]
        assert not first.segments(), "the new daemon removes the killed one's segments"
    finally:
        session.close()
        if second is not None:
            assert second.stop() == 0


def _answers(socket: Path) -> bool:
    return ping_pid(socket) is not None


def test_a_reconnection_waits_for_the_daemon_to_end_the_abandoned_job(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that stopped answering pings for a while and lives on: the trainer reconnects
    to it, and its hello names the abandoned job, still open there until the daemon notices
    that its connection closed. The claim is refused (job_claimed) until then."""
    from dalid.client.link import launcher
    from dalid.protocol import ErrorCode

    refusals: list[Any] = []
    connect = launcher.autostart_connect

    def connect_after_a_refusal(*args: Any, **kwargs: Any) -> Any:
        if not refusals:
            refusals.append(kwargs["earlier_jobs"])
            raise dalid.RequestError(ErrorCode.JOB_CLAIMED, "earlier job 1 is a live job")
        return connect(*args, **kwargs)

    daemon = start_daemon(short_tmp)
    try:
        with dalid.connect(socket=daemon.socket, autostart=False, reconnect=True) as session:
            proxy = session.proxy(two_output_pipeline())
            first_job = session.job_id
            monkeypatch.setattr(launcher, "autostart_connect", connect_after_a_refusal)
            session._daemon.reconnect_now()  # what a ping gone unanswered leads to
            assert [job.job_id for job in refusals[0]] == [first_job]
            assert session.reconnects == 1 and session.job_id != first_job
            _check(session.produce_data(_batch(proxy, 0)), 0)
    finally:
        assert daemon.stop() == 0


def test_dali_server_with_reconnect_carries_on_across_a_daemon_kill(short_tmp: Path) -> None:
    from dalid.client import proxy as dali_proxy

    first = start_daemon(short_tmp)
    second = None
    server = dali_proxy.DALIServer(
        two_output_pipeline(), socket=first.socket, autostart=False, reconnect=True
    )
    try:
        with server:
            dataset = ProxyDataset(server.proxy, 4 * BATCH)
            loader = dali_proxy.DataLoader(server, dataset, batch_size=BATCH, num_workers=0)
            seen = []
            for step, ((scaled, shifted), indices) in enumerate(loader):
                for row, index in enumerate(indices.tolist()):
                    np.testing.assert_array_equal(shifted[row].numpy(), sample(index) + 7)
                    np.testing.assert_array_equal(scaled[row].numpy(), sample(index) * 0.5 + 1)
                seen += indices.tolist()
                if step == 1:
                    os.kill(first.pid, signal.SIGKILL)
                    first.process.wait()
                    second = start_daemon(short_tmp)
            assert seen == list(range(4 * BATCH))
            assert server.session.reconnects == 1
            assert second is not None
            assert server.session.daemon_pid == second.pid
    finally:
        if second is not None:
            assert second.stop() == 0


def test_without_reconnect_a_batch_of_a_killed_daemon_raises(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    with dalid.connect(socket=daemon.socket, autostart=False) as session:
        # Deterministic: the batch waits in the daemon until produce_data asks for it, so its
        # result cannot arrive before the kill, however fast the daemon runs it.
        batch = _batch(session.proxy(two_output_pipeline(), deterministic=True), 0)
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.process.wait()
        with pytest.raises(dalid.DaemonUnavailable, match=f"{daemon.socket}.*is gone"):
            session.produce_data(batch)
    # A new daemon on the socket removes the killed one's segments.
    assert start_daemon(short_tmp).stop() == 0
    assert not daemon.segments()


@pytest.fixture
def unwatched_daemon_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process in another pid namespace than the daemon, as far as the client can tell:
    the daemon's pid cannot be watched, and only pings tell whether it lives."""
    from dalid.client.link import connection, watch

    monkeypatch.setattr(connection, "pid_namespace", lambda: 1)
    monkeypatch.setattr(watch, "pid_namespace", lambda: 1)
    monkeypatch.setattr(watch, "PING_TIMEOUT_S", 1.0)


def test_a_killed_daemon_whose_pid_cannot_be_watched_is_noticed_by_ping(
    short_tmp: Path, unwatched_daemon_pid: None
) -> None:
    daemon = start_daemon(short_tmp)
    with dalid.connect(socket=daemon.socket, autostart=False) as session:
        batch = _batch(session.proxy(two_output_pipeline()), 0)
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.process.wait()
        with pytest.raises(dalid.DaemonUnavailable, match="no reply to a ping in 1 s"):
            session.produce_data(batch)
    assert start_daemon(short_tmp).stop() == 0


def test_a_restarted_daemon_whose_pid_cannot_be_watched_is_noticed_by_its_pong(
    short_tmp: Path, unwatched_daemon_pid: None
) -> None:
    first = start_daemon(short_tmp)
    with dalid.connect(socket=first.socket, autostart=False) as session:
        batch = _batch(session.proxy(two_output_pipeline()), 0)
        os.kill(first.pid, signal.SIGKILL)
        first.process.wait()
        second = start_daemon(short_tmp)
        try:
            with pytest.raises(dalid.DaemonUnavailable, match=f"pid {second.pid} now answers"):
                session.produce_data(batch)
        finally:
            assert second.stop() == 0


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_job_with_reconnect_finishes_its_epoch_across_a_daemon_kill(
    short_tmp: Path, workers: int
) -> None:
    daemon = start_daemon(short_tmp, supervised=True)
    first = daemon.daemon_pid()
    job = _job(daemon.socket, "--reconnect", "--workers", str(workers), "--length", str(LENGTH))
    try:
        _kill_daemon_at_pause(job, first)
        out, _ = job.communicate(timeout=180)
        assert job.returncode == 0, out
        # Every sample once, each equal to the pipeline's output, after one reconnection.
        assert f"ok {LENGTH} reconnects 1" in out, out
        assert daemon.daemon_pid() != first
    finally:
        kill_leftovers([job])
        assert daemon.stop() == 0
    assert not daemon.segments()
    assert not daemon.socket.exists()


@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [False, True])
def test_running_workers_rejoin_the_job_after_a_daemon_kill(
    short_tmp: Path, deterministic: bool
) -> None:
    daemon = start_daemon(short_tmp, supervised=True)
    first = daemon.daemon_pid()
    job = _job(
        daemon.socket,
        "--reconnect",
        "--workers", "2",
        "--persistent-workers",
        "--epochs", "2",
        "--length", str(LENGTH),
        "--step-seconds", "0.05",
        *(["--deterministic"] if deterministic else []),
    )  # fmt: skip
    try:
        _kill_daemon_at_pause(job, first)
        out, _ = job.communicate(timeout=180)
        assert job.returncode == 0, out
        # Each epoch saw every sample once, each equal to the pipeline's output.
        assert f"ok {2 * LENGTH} reconnects 1" in out, out
        # In the epoch of the kill the trainer submits the batches that were in flight, and
        # those the workers made before they rejoined (how many depends on timing). Persistent
        # workers started before the kill then submit every batch of the next epoch: without
        # rejoining, the trainer would submit all of them.
        assert "epoch 2 trainer-submitted 0" in out, out
        second = daemon.daemon_pid()
        assert second != first
        joined = re.findall(
            r"job \d+: worker pid (\d+) joined as job \d+ of an earlier", daemon.log_text()
        )
        assert len(set(joined)) == 2, daemon.log_text()
    finally:
        kill_leftovers([job])
        assert daemon.stop() == 0
    assert not daemon.segments()
    assert not daemon.socket.exists()


@pytest.mark.slow
def test_a_job_without_reconnect_fails_naming_the_socket(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp, supervised=True)
    job = _job(daemon.socket, "--length", str(LENGTH))
    try:
        _kill_daemon_at_pause(job, daemon.daemon_pid())
        started = time.monotonic()
        out, _ = job.communicate(timeout=60)
        noticed_after = time.monotonic() - started
        assert job.returncode != 0, out
        assert "DaemonUnavailable" in out and str(daemon.socket) in out, out
        assert "is gone" in out, out
        # Noticed within a few seconds, not after a long timeout (the job's exit included).
        assert noticed_after < 15, f"{noticed_after:.1f} s\n{out}"
    finally:
        kill_leftovers([job])
        assert daemon.stop() == 0
    assert not daemon.segments()


def test_supervisor_restarts_a_killed_daemon(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp, supervised=True)
    try:
        first = daemon.daemon_pid()
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: not _alive(first), 10.0, "the killed daemon to be reaped")
        ping = subprocess.run(
            [sys.executable, "-m", "dalid.server", "ping", "--socket", str(daemon.socket),
             "--timeout", "30"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert ping.returncode == 0, ping.stderr
        second = daemon.daemon_pid()
        assert second != first and f"pid {second} answers" in ping.stdout
        assert "was killed by signal 9: restarting" in daemon.log_text()
        assert daemon.process.poll() is None
    finally:
        assert daemon.stop() == 0


def test_sigterm_to_the_supervisor_stops_everything(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp, supervised=True)
    child = daemon.daemon_pid()
    session = dalid.connect(socket=daemon.socket, autostart=False)
    try:
        proxy = session.proxy(two_output_pipeline())
        loader = dalid.DataLoader(session, ProxyDataset(proxy, BATCH), batch_size=BATCH)
        (_, shifted), _ = next(iter(loader))
        assert daemon.segments()
        assert daemon.stop() == 0
        assert not _alive(child), "the supervisor left its daemon running"
        assert not daemon.socket.exists()
        assert not daemon.segments()
        np.testing.assert_array_equal(shifted[2].numpy(), sample(2) + 7)
    finally:
        session.close()


def test_two_daemons_under_one_supervisor(short_tmp: Path) -> None:
    """The supervisor of several devices, with two CPU daemons on their own sockets."""
    sockets = [short_tmp / "a.sock", short_tmp / "b.sock"]
    log = short_tmp / "supervisor.log"
    with log.open("wb") as out:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.supervise_two", *map(str, sockets)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        for path in sockets:
            wait_for(functools.partial(_answers, path), 60.0, f"a daemon on {path}")
        a, b = (ping_pid(path) for path in sockets)
        assert a is not None and b is not None and a != b
        os.kill(a, signal.SIGKILL)
        wait_for(lambda: ping_pid(sockets[0]) not in (None, a), 60.0, "daemon a to come back")
        assert ping_pid(sockets[1]) == b, "the other daemon was left alone"
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(30) == 0, log.read_text()
        assert not any(_alive(pid) for pid in (a, b, ping_pid(sockets[0]) or 0) if pid)
        assert not any(path.exists() for path in sockets)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()


def test_serve_devices_cpu_supervises_a_daemon_on_the_default_socket(short_tmp: Path) -> None:
    log = short_tmp / "serve.log"
    with log.open("wb") as out:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "dalid.server", "serve", "--devices", "cpu"],
            env={**os.environ, "DALID_RUNTIME_DIR": str(short_tmp)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    socket = short_tmp / "cpu.sock"
    try:
        wait_for(lambda: ping_pid(socket) is not None, 60.0, "the CPU daemon to answer")
        child = ping_pid(socket)
        assert child is not None and child != supervisor.pid
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(30) == 0, log.read_text()
        assert not _alive(child)
        assert not socket.exists()
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
