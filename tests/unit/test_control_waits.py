"""A control command (`dalid stop`, `status`) whose daemon is slow to answer says what it waits
for, once, rather than wait in silence; here against a real socket that never answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from dalid.protocol import Ping, endpoint
from dalid.server.operations.control import QUIET_S, DaemonLine, NoAnswer


@pytest.fixture
def silent_socket(short_tmp: Path) -> Iterator[Path]:
    """A socket of this user's that a ROUTER listens on and never answers."""
    path = short_tmp / "cpu.sock"
    context: zmq.Context[Any] = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(endpoint(path))
    try:
        yield path
    finally:
        router.close(linger=0)
        context.term()


def test_a_late_answer_is_said_to_be_waited_for_once(
    silent_socket: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with (
        DaemonLine(silent_socket, QUIET_S + 0.5, "dalid serve") as line,
        pytest.raises(NoAnswer, match="no dalid daemon answered"),
    ):
        line.ask(Ping(), slow="dalid stop: waiting for the daemon to answer")
    assert capsys.readouterr().err.count("dalid stop: waiting for the daemon to answer") == 1


def test_a_quick_command_says_nothing_of_waiting(
    silent_socket: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its timeout passes before it would say so: nothing but the refusal.
    with (
        DaemonLine(silent_socket, QUIET_S / 4, "dalid serve") as line,
        pytest.raises(NoAnswer),
    ):
        line.ask(Ping(), slow="dalid stop: waiting for the daemon to answer")
    assert capsys.readouterr().err == ""
