"""Shared fixtures: a real daemon subprocess per test module, and checks that nothing leaks.

Every test session runs with a private runtime directory ($DALID_RUNTIME_DIR), so autostarted
daemons and default sockets never touch the user's own. Every test is checked for what it left
behind (:mod:`tests.leaks`): processes, dalid's /dev/shm segments, socket files, threads and
file descriptors; the session is checked once more at its end, for what module fixtures left.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dalid.protocol import slabs

from . import foreign, host_sync, leaks
from .daemons import (
    OWN_DIRECTORIES,
    STARTED_PIDS,
    DaemonProcess,
    alive,
    module_daemon,
    own_directory,
)


def _dalid_segments() -> dict[str, int]:
    """This user's dalid segments, each with the pid of the process that made it."""
    return {path.name: record.pid for path, record in slabs.user_segments()}


def _dalid_daemons() -> list[int]:
    """Pids of `dalid serve` processes (supervisors and daemons) that this session's tests
    started: by a socket path in their command line, or by the runtime directory in their
    environment (a supervisor of `--devices` names no socket)."""
    out = subprocess.run(
        ["pgrep", "-af", "(dalid.server|simulated_gpu) serve"],
        capture_output=True,
        text=True,
        check=False,
    )
    pids = []
    for line in out.stdout.splitlines():
        pid, _, command = line.partition(" ")
        if any(directory in command for directory in OWN_DIRECTORIES) or _own_runtime(pid):
            pids.append(int(pid))
    return pids


def _own_runtime(pid: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    for entry in environ:
        name, _, value = entry.decode(errors="replace").partition("=")
        if name == "DALID_RUNTIME_DIR":
            return any(value.rstrip("/") + "/" == directory for directory in OWN_DIRECTORIES)
    return False


@pytest.fixture(scope="session", autouse=True)
def private_runtime_dir() -> Iterator[Path]:
    path = own_directory("dalid-rt-")
    os.environ["DALID_RUNTIME_DIR"] = str(path)
    os.environ.pop("DALID_SOCKET", None)
    leaks.start_long_lived()
    segments_before = set(_dalid_segments())
    yield path
    leaked_daemons = set(_dalid_daemons())
    for pid in leaked_daemons:
        os.kill(pid, signal.SIGKILL)
    # Segments of daemons this session did not start (and that still run) are not ours.
    leaked_segments = {
        name
        for name, pid in _dalid_segments().items()
        if name not in segments_before and (not alive(pid) or pid in leaked_daemons)
    }
    for name in leaked_segments:
        (slabs.SHM_DIR / name).unlink(missing_ok=True)
    sockets = [p.name for p in path.rglob("*.sock")]
    shutil.rmtree(path, ignore_errors=True)
    assert not leaked_daemons, f"daemon processes left running: {sorted(leaked_daemons)}"
    assert not leaked_segments, f"/dev/shm segments left behind: {sorted(leaked_segments)}"
    assert not sockets, f"socket files left behind: {sockets}"


@pytest.fixture(scope="module", autouse=True)
def nothing_left_in_this_process() -> Iterator[dict[str, leaks.Leaks]]:
    """What each test of the module made in this process (threads, descriptors, segments),
    judged once the module's fixtures, which may own it, are gone: an autouse fixture is set up
    before the other fixtures of its scope, and torn down after them."""
    made: dict[str, leaks.Leaks] = {}
    yield made
    found = {nodeid: leaks.still_there(things) for nodeid, things in made.items()}
    failures = [
        f"{nodeid} left behind:\n  " + "\n  ".join(left.lines())
        for nodeid, left in found.items()
        if left
    ]
    for left in found.values():
        left.clean_up()
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)


@pytest.fixture(autouse=True)
def nothing_left_behind(
    request: pytest.FixtureRequest,
    private_runtime_dir: Path,
    nothing_left_in_this_process: dict[str, leaks.Leaks],
) -> Iterator[None]:
    """Fails the test that leaves a process, segment or socket file behind, and hands what it
    made in this process to :func:`nothing_left_in_this_process`.

    Autouse fixtures are set up before, and torn down after, the test's other function-scoped
    fixtures; module-scoped ones (a module's daemon) are up before the first snapshot and
    stopped after the last, so they are never counted.
    """
    before = leaks.take(_test_directories(request))
    yield
    outside, inside = leaks.left_behind(
        before,
        _test_directories(request),
        private_runtime_dir,
        STARTED_PIDS,
        foreign_code=request.node.stash.get(foreign.FOREIGN_CODE, None),
    )
    if inside:
        nothing_left_in_this_process[request.node.nodeid] = inside
    if outside:
        failure = f"{request.node.nodeid} left behind:\n  " + "\n  ".join(outside.lines())
        outside.clean_up()
        pytest.fail(failure, pytrace=False)


@pytest.fixture(autouse=True)
def sync_debug_mode_restored() -> Iterator[None]:
    """Fails the test that leaves torch's synchronization debug mode on (and turns it off), so
    that the tests after it do not fail on their first host synchronization instead."""
    yield
    left = host_sync.reset_if_left_on()
    if left:
        pytest.fail(
            f"left torch.cuda's synchronization debug mode at {left}: use "
            "tests.host_sync.host_syncs_raise()",
            pytrace=False,
        )


def _test_directories(request: pytest.FixtureRequest) -> list[Path]:
    """The directories whose socket files count: those the tests made, and the test's tmp_path."""
    directories = [Path(directory) for directory in OWN_DIRECTORIES]
    tmp_path = request.node.funcargs.get("tmp_path")
    if isinstance(tmp_path, Path):
        directories.append(tmp_path)
    return [directory for directory in directories if directory.exists()]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory for sockets (a Unix socket path has at most 107 bytes)."""
    path = own_directory()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    """A CPU daemon (under its supervisor) shared by the tests of one module; checked for a
    clean stop of both."""
    with module_daemon(supervised=True) as running:
        yield running
