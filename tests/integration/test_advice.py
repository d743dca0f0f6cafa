"""Advice that fits the call that failed, one test per kind of message that gives advice.

Each test makes the failure for real (no daemon, a daemon killed, a daemon stopped) and checks
both the cause the message names and that what it tells the user to do applies: a trainer given
a socket is never told to use autostart, and a job with ``reconnect=True`` is never told to
connect with it.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import dalid.client as dalid
from dalid.protocol import socket_path

from ..daemons import start_daemon
from .helpers import BATCH, sample, two_output_pipeline


def _batch(proxy: dalid.Proxy) -> Any:
    return torch.utils.data.default_collate([proxy(sample(row)) for row in range(BATCH)])


def test_no_daemon_on_a_given_socket_advises_serving_there_not_autostart(short_tmp: Path) -> None:
    socket = short_tmp / "cpu.sock"
    with pytest.raises(dalid.DaemonUnavailable) as raised:
        dalid.connect(socket=socket, autostart=False)
    message = str(raised.value)
    assert f"no dalid daemon answers on ipc://{socket}" in message
    assert f"`dalid serve --device cpu --socket {socket}`" in message
    assert "autostart" not in message


def test_no_daemon_on_the_default_socket_advises_autostart_when_it_was_off(
    private_runtime_dir: Path,
) -> None:
    with pytest.raises(dalid.DaemonUnavailable) as raised:
        dalid.connect(device="cpu", autostart=False)
    message = str(raised.value)
    assert f"no dalid daemon answers on ipc://{socket_path('cpu')}" in message
    assert "connect with autostart=True" in message
    assert not socket_path("cpu").exists()


def test_a_killed_daemon_advises_reconnect_to_a_job_without_it(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    with dalid.connect(socket=daemon.socket, autostart=False) as session:
        # Deterministic: the batch waits in the daemon until produce_data asks for it.
        batch = _batch(session.proxy(two_output_pipeline(), deterministic=True))
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.process.wait()
        with pytest.raises(dalid.DaemonUnavailable) as raised:
            session.produce_data(batch)
    message = str(raised.value)
    assert f"(pid {daemon.pid}) is gone: its process has exited" in message
    assert "connect with reconnect=True" in message
    assert "autostart" not in message
    assert start_daemon(short_tmp).stop() == 0


def test_a_killed_daemon_does_not_advise_reconnect_to_a_job_that_has_it(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = start_daemon(short_tmp)
    second = None
    with dalid.connect(socket=first.socket, autostart=False, reconnect=True) as session:
        batch = _batch(session.proxy(two_output_pipeline(), deterministic=True))
        os.kill(first.pid, signal.SIGKILL)
        first.process.wait()
        second = start_daemon(short_tmp)
        try:
            with caplog.at_level(logging.WARNING, logger="dalid.client"):
                session.produce_data(batch)
            assert session.reconnects == 1
        finally:
            session.close()
            assert second.stop() == 0
    (said,) = [record.getMessage() for record in caplog.records if "is gone" in record.getMessage()]
    # Found gone by its exit or by its successor's answer, whichever the trainer saw first.
    assert f"(pid {first.pid}) is gone: " in said
    assert "This job has reconnect=True and carries on" in said
    assert "connect with reconnect=True" not in said


def test_a_stopped_daemon_advises_serving_on_the_given_socket_not_autostart(
    short_tmp: Path,
) -> None:
    daemon = start_daemon(short_tmp)
    with dalid.connect(socket=daemon.socket, autostart=False) as session:
        batch = _batch(session.proxy(two_output_pipeline(), deterministic=True))
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.process.wait(timeout=30) == 0
        with pytest.raises(dalid.DaemonStopped) as raised:
            session.produce_data(batch)
    message = str(raised.value)
    assert "was stopped (it received SIGTERM)" in message
    assert f"`dalid serve --device cpu --socket {daemon.socket}`" in message
    assert "autostart" not in message
