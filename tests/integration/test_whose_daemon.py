"""The default daemon is the trainer's own: a trainer says when the daemon on its socket is of
another dalid installation, and autostart starts a daemon only on the default socket."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dalid.client as dalid
from dalid.client.link.launcher import OtherInstallationWarning
from dalid.protocol import installation, socket_path

from ..daemons import ROOT, STARTED_PIDS, DaemonProcess, wait_until_answering


def test_a_mistyped_socket_is_an_error_naming_it_not_a_second_daemon(
    private_runtime_dir: Path, short_tmp: Path
) -> None:
    mistyped = short_tmp / "cpu.sokc"
    with pytest.raises(dalid.DaemonUnavailable) as raised:
        dalid.connect(socket=mistyped, autostart=True)
    message = str(raised.value)
    assert f"ipc://{mistyped}" in message
    assert "the socket this trainer was given" in message
    # It names the default socket, where autostart would have started one.
    assert str(socket_path("cpu")) in message
    assert f"dalid serve --device cpu --socket {mistyped}" in message
    # Nothing was started, there or on the default socket.
    assert list(short_tmp.iterdir()) == []
    assert not socket_path("cpu").exists()


def test_dalid_socket_set_to_a_path_with_no_daemon_starts_none(
    private_runtime_dir: Path, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DALID_SOCKET", str(short_tmp / "elsewhere.sock"))
    with pytest.raises(dalid.DaemonUnavailable, match="the socket this trainer was given"):
        dalid.connect()
    assert list(short_tmp.iterdir()) == []


def _copy_of_dalid(directory: Path) -> Path:
    """dalid's three packages copied under ``directory``: another installation of the same
    release, as another checkout's environment has."""
    for package in ("protocol", "server", "client"):
        shutil.copytree(
            ROOT / package,
            directory / "dalid" / package,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    return directory


def test_a_daemon_of_another_installation_is_named_in_a_warning(short_tmp: Path) -> None:
    other = _copy_of_dalid(short_tmp / "other")
    socket = short_tmp / "cpu.sock"
    log = short_tmp / "daemon.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "dalid.server", "serve", "--no-supervisor",
             "--socket", str(socket)],
            env={**os.environ, "PYTHONPATH": str(other)},
            cwd=short_tmp, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    STARTED_PIDS.add(process.pid)
    daemon = DaemonProcess(socket, process, log)
    try:
        wait_until_answering(socket, process)
        with pytest.warns(OtherInstallationWarning) as warned:
            session = dalid.connect(socket=socket, autostart=False)
        session.close()
        (warning,) = warned
        text = str(warning.message)
        assert f"pid {process.pid}" in text
        assert f"from {other / 'dalid'}" in text, text
        assert f"from {installation()}" in text, text
        assert f"dalid stop --socket {socket}" in text
        # Given a socket, the trainer starts no daemon of its own there: it is told to.
        assert "this trainer starts its own" not in text
        assert f"`dalid serve --socket {socket}`" in text
    finally:
        assert daemon.stop() == 0, daemon.log_text()


def test_a_daemon_of_this_installation_is_not_warned_about(daemon: DaemonProcess) -> None:
    # Warnings are errors in the tests: a warning here fails the test.
    with dalid.connect(socket=daemon.socket, autostart=False) as session:
        assert session.daemon_pid == daemon.daemon_pid()
