"""Trainers stopped or frozen past the limit, told apart from running ones by their process's
state (server/intake/frozen.py), with real processes."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dalid.server.intake.frozen import (
    FROZEN_LIMIT_S,
    Freezers,
    FrozenTrainers,
    ProcessState,
    is_frozen,
)

NO_FREEZERS = Freezers(None, None)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(["sleep", "60"])
    try:
        yield process
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait()


def test_a_process_is_running_stopped_or_gone(sleeper: subprocess.Popen[bytes]) -> None:
    trainers = FrozenTrainers(NO_FREEZERS)
    assert trainers.state(sleeper.pid) is ProcessState.RUNNING
    sleeper.send_signal(signal.SIGSTOP)
    _wait_for_state(trainers, sleeper.pid, ProcessState.STOPPED)
    sleeper.send_signal(signal.SIGCONT)
    _wait_for_state(trainers, sleeper.pid, ProcessState.RUNNING)
    sleeper.kill()
    sleeper.wait()
    assert trainers.state(sleeper.pid) is ProcessState.GONE


def test_a_trainer_stopped_at_every_look_for_the_limit_is_reported_once(
    sleeper: subprocess.Popen[bytes],
) -> None:
    trainers = FrozenTrainers(NO_FREEZERS)
    listed = [(b"trainer", sleeper.pid), (b"unseen", 0)]
    sleeper.send_signal(signal.SIGSTOP)
    _wait_for_state(trainers, sleeper.pid, ProcessState.STOPPED)
    assert trainers.past_limit(100.0, listed) == []
    assert trainers.past_limit(100.0 + FROZEN_LIMIT_S - 0.5, listed) == []
    found = trainers.past_limit(100.0 + FROZEN_LIMIT_S, listed)
    assert found == [(b"trainer", sleeper.pid, ProcessState.STOPPED, FROZEN_LIMIT_S)]
    assert trainers.past_limit(110.0, listed) == []  # reported once
    # Let go, then stopped again: held from the new stop, reported again.
    sleeper.send_signal(signal.SIGCONT)
    _wait_for_state(trainers, sleeper.pid, ProcessState.RUNNING)
    assert trainers.past_limit(111.0, listed) == []
    sleeper.send_signal(signal.SIGSTOP)
    _wait_for_state(trainers, sleeper.pid, ProcessState.STOPPED)
    assert trainers.past_limit(112.0, listed) == []
    assert [f[0] for f in trainers.past_limit(112.0 + FROZEN_LIMIT_S, listed)] == [b"trainer"]


def test_a_running_trainer_is_never_reported(sleeper: subprocess.Popen[bytes]) -> None:
    trainers = FrozenTrainers(NO_FREEZERS)
    for now in (0.0, 10.0, 100.0):
        assert trainers.past_limit(now, [(b"trainer", sleeper.pid)]) == []


def test_the_freezers_are_found_where_their_hierarchies_are_mounted(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "30 25 0:26 / /sys/fs/cgroup/cpu rw,relatime shared:9 - cgroup cgroup rw,cpu\n"
        "31 25 0:27 /sub /elsewhere rw - cgroup cgroup rw,freezer\n"
        "32 25 0:28 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer\n"
        "33 25 0:29 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
    )
    assert Freezers.mounted(mountinfo) == Freezers(
        Path("/sys/fs/cgroup/freezer"), Path("/sys/fs/cgroup/unified")
    )
    assert Freezers.mounted(tmp_path / "none") == NO_FREEZERS


def test_a_cgroup_is_frozen_as_its_freezer_says(tmp_path: Path) -> None:
    v1 = tmp_path / "freezer.state"
    v2 = tmp_path / "cgroup.events"
    for text, frozen in (("FROZEN\n", True), ("FREEZING\n", False), ("THAWED\n", False)):
        v1.write_text(text)
        assert is_frozen(v1) is frozen
    for text, frozen in (("populated 1\nfrozen 1\n", True), ("populated 1\nfrozen 0\n", False)):
        v2.write_text(text)
        assert is_frozen(v2) is frozen
    assert not is_frozen(tmp_path / "missing")


def _wait_for_state(trainers: FrozenTrainers, pid: int, state: ProcessState) -> None:
    """A signal's effect on the state is not instant."""
    deadline = time.monotonic() + 5
    while trainers.state(pid) is not state:
        assert time.monotonic() < deadline, f"pid {pid} never {state.value}"
        time.sleep(0.01)
