"""Reloading the pipeline repository of a running daemon: `dalid reload` and SIGHUP."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dalid.client as dalid

from ..daemons import DaemonProcess, own_directory, start_daemon, wait_for
from .helpers import sample

BATCH = 4

# One pipeline per file: `name` multiplies its one input by `factor`.
SCALING = """
from nvidia.dali import fn, pipeline_def

@pipeline_def(batch_size={batch}, num_threads=1)
def {name}():
    return fn.external_source(name="data", no_copy=True) * {factor}
"""


def _write(directory: Path, file: str, name: str, factor: int) -> None:
    (directory / file).write_text(SCALING.format(batch=BATCH, name=name, factor=factor))


def _run_batch(session: dalid.Session, proxy: dalid.Proxy, factor: int) -> None:
    """One batch through ``proxy``, checked to come out multiplied by ``factor``."""
    refs = [proxy(data=sample(index)) for index in range(BATCH)]
    (out,) = session.produce_data([torch.utils.data.default_collate(refs)])
    expected = np.stack([sample(index) for index in range(BATCH)]) * factor
    np.testing.assert_array_equal(out.numpy(), expected)


def _reload(daemon: DaemonProcess) -> subprocess.CompletedProcess[str]:
    """`dalid reload`, the real command, for the daemon's socket."""
    return subprocess.run(
        [sys.executable, "-m", "dalid.server", "reload", "--socket", str(daemon.socket)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _connect(daemon: DaemonProcess) -> dalid.Session:
    return dalid.connect(socket=daemon.socket, autostart=False)


def _serve(repository: Path, directory: Path, supervised: bool = False) -> DaemonProcess:
    return start_daemon(directory, "--pipelines", str(repository), supervised=supervised)


def _stop(daemon: DaemonProcess, directory: Path) -> None:
    code = daemon.stop()
    log = daemon.log_text()
    segments = daemon.segments()
    shutil.rmtree(directory, ignore_errors=True)
    assert code == 0, log
    assert not segments, f"daemon left shared memory: {segments}"


def test_dalid_reload_serves_new_definitions_while_running_pipelines_keep_theirs() -> None:
    directory = own_directory()
    repository = directory / "pipelines"
    repository.mkdir()
    _write(repository, "doubled.py", "doubled", 2)
    daemon = _serve(repository, directory)
    try:
        with _connect(daemon) as running:
            doubled = running.proxy("doubled")
            _run_batch(running, doubled, 2)

            # A new file, and a changed definition of a name that a job runs.
            _write(repository, "tripled.py", "tripled", 3)
            _write(repository, "doubled.py", "doubled", 20)
            result = _reload(daemon)
            assert result.returncode == 0, result.stderr
            assert f"reloaded {repository}: doubled, tripled" in result.stdout
            with _connect(daemon) as fresh:
                _run_batch(fresh, fresh.proxy("tripled"), 3)
                _run_batch(fresh, fresh.proxy("doubled"), 20)
            # Built from the definition it was registered with, and still working.
            _run_batch(running, doubled, 2)

            # A file that fails to load now keeps its last good definition.
            (repository / "tripled.py").write_text("def half_saved(:\n")
            result = _reload(daemon)
            assert result.returncode == 3, result.stdout + result.stderr
            assert "doubled, tripled" in result.stdout
            assert "failed: tripled.py: SyntaxError" in result.stderr
            assert "still serving tripled from its last good load" in result.stderr
            with _connect(daemon) as fresh:
                _run_batch(fresh, fresh.proxy("tripled"), 3)
                _run_batch(fresh, fresh.proxy("doubled"), 20)

            # A removed file's names are gone for new registrations, with the usual error.
            (repository / "tripled.py").unlink()
            result = _reload(daemon)
            assert result.returncode == 0, result.stderr
            assert f"reloaded {repository}: doubled\n" in result.stdout
            with _connect(daemon) as fresh, pytest.raises(dalid.PipelineError) as raised:
                fresh.proxy("tripled")
            assert "no pipeline named 'tripled'" in str(raised.value)
            assert "available: doubled" in str(raised.value)
            _run_batch(running, doubled, 2)
        log = daemon.log_text()
        assert "reloaded: added tripled" in log
        assert "tripled.py could not be loaded" in log
        assert "reloaded: removed tripled" in log
    finally:
        _stop(daemon, directory)


def test_dalid_reload_of_a_daemon_without_a_repository_fails_and_says_why() -> None:
    directory = own_directory()
    daemon = start_daemon(directory)
    try:
        result = _reload(daemon)
        assert result.returncode == 1
        assert "no pipeline repository" in result.stderr and "--pipelines DIR" in result.stderr
    finally:
        _stop(daemon, directory)


@pytest.mark.parametrize("supervised", [False, True], ids=["daemon", "supervisor"])
def test_sighup_reloads_the_repository(supervised: bool) -> None:
    directory = own_directory()
    repository = directory / "pipelines"
    repository.mkdir()
    _write(repository, "doubled.py", "doubled", 2)
    daemon = _serve(repository, directory, supervised=supervised)
    try:
        daemon_pid = daemon.daemon_pid()
        with _connect(daemon) as running:
            doubled = running.proxy("doubled")
            _run_batch(running, doubled, 2)
            _write(repository, "tripled.py", "tripled", 3)
            # To the supervisor when supervised: it passes the signal on to its daemon.
            os.kill(daemon.pid, signal.SIGHUP)
            wait_for(
                lambda: "reloaded: added tripled" in daemon.log_text(), 60, "the reload's log line"
            )
            with _connect(daemon) as fresh:
                _run_batch(fresh, fresh.proxy("tripled"), 3)
            _run_batch(running, doubled, 2)
        # The same daemon still serves: the signal reloaded it, it did not end it.
        assert daemon.process.poll() is None
        assert daemon.daemon_pid() == daemon_pid
        if supervised:
            assert "SIGHUP: 1 daemon(s) reload their pipeline repository" in daemon.log_text()
    finally:
        _stop(daemon, directory)
