"""A connection's watch on its daemon (client/link/watch.py), its times given: when a silent
daemon is pinged and counts as gone, what a pong says, and a watched daemon's process. The
real path, with a daemon killed or restarted under a connection, is in
tests/integration/test_restarts.py and test_processes.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dalid.client.errors import DaemonUnavailable
from dalid.client.link.advice import NO_ADVICE
from dalid.client.link.watch import (
    PING_AFTER_S,
    PING_AFTER_WATCHED_S,
    PING_TIMEOUT_S,
    WATCH_EVERY_S,
    DaemonWatch,
    Silence,
)
from dalid.protocol import Envelope, Limits, Ok, Pong, Welcome, pid_namespace

SOCKET = Path("/tmp/dalid-test-watch.sock")


def _watch(daemon_pid: int, namespace: int = 0) -> DaemonWatch:
    watch = DaemonWatch(SOCKET, NO_ADVICE)
    limits = Limits(64, 1 << 20, 1 << 20, 1 << 16)
    watch.welcomed(Welcome(5, daemon_pid, "cpu", "2.4.0", 1, "t", limits, "", namespace))
    return watch


class Pings:
    """Counts the pings a wait sends; each gets the next request id."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def __call__(self) -> int:
        self.sent.append(100 + len(self.sent))
        return self.sent[-1]


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_silent_daemon_is_pinged_once_then_counts_as_gone() -> None:
    watch = _watch(os.getpid())
    assert not watch.watched and watch.ping_after == PING_AFTER_S
    silence, pings = Silence(watch, True, 0.0), Pings()
    silence.quiet(PING_AFTER_S / 2, pings, lambda: False)
    assert pings.sent == []
    silence.quiet(PING_AFTER_S + 0.1, pings, lambda: False)
    silence.quiet(PING_AFTER_S + PING_TIMEOUT_S / 2, pings, lambda: False)
    assert pings.sent == [100]
    assert not watch.gone
    with pytest.raises(DaemonUnavailable, match=f"no reply to a ping in {PING_TIMEOUT_S:.0f} s"):
        silence.quiet(PING_AFTER_S + PING_TIMEOUT_S + 0.1, pings, lambda: False)
    assert watch.gone


def test_a_pong_ends_the_ping_and_a_message_restarts_the_silence() -> None:
    watch = _watch(os.getpid())
    silence, pings = Silence(watch, True, 0.0), Pings()
    silence.quiet(PING_AFTER_S + 0.1, pings, lambda: False)
    assert not silence.answers_ping(Envelope(Ok(), 99))  # another request's reply
    assert silence.answers_ping(Envelope(Pong(os.getpid()), 100))
    heard = PING_AFTER_S + 0.2
    silence.heard(heard)
    silence.quiet(heard + PING_AFTER_S / 2, pings, lambda: False)
    assert pings.sent == [100]
    silence.quiet(heard + PING_AFTER_S + 0.1, pings, lambda: False)
    assert pings.sent == [100, 101] and not watch.gone


def test_another_daemons_pong_says_the_welcomed_one_was_replaced() -> None:
    watch = _watch(os.getpid())
    silence, pings = Silence(watch, True, 0.0), Pings()
    silence.quiet(PING_AFTER_S + 0.1, pings, lambda: False)
    with pytest.raises(DaemonUnavailable, match=r"daemon pid 1 now answers \(it was restarted\)"):
        silence.answers_ping(Envelope(Pong(1), 100))
    assert watch.gone


def test_a_watched_daemon_that_exited_is_gone_once_no_last_words_come() -> None:
    watch = _watch(_exited_pid(), pid_namespace())
    assert watch.watched and watch.ping_after == PING_AFTER_WATCHED_S
    silence, pings = Silence(watch, True, 0.0), Pings()
    silence.quiet(WATCH_EVERY_S / 2, pings, lambda: False)  # not looked at yet
    silence.quiet(WATCH_EVERY_S, pings, lambda: True)  # a stop notice may be on its way
    assert not watch.gone
    with pytest.raises(DaemonUnavailable, match="its process has exited"):
        silence.quiet(2 * WATCH_EVERY_S, pings, lambda: False)
    assert pings.sent == []


def test_a_watched_daemon_that_lives_is_pinged_later() -> None:
    watch = _watch(os.getpid(), pid_namespace())
    silence, pings = Silence(watch, True, 0.0), Pings()
    silence.quiet(PING_AFTER_S + 0.1, pings, lambda: False)
    assert pings.sent == []
    silence.quiet(PING_AFTER_WATCHED_S + 0.1, pings, lambda: False)
    assert pings.sent == [100]


def test_a_wait_that_does_not_ping_looks_at_nothing() -> None:
    watch = _watch(_exited_pid(), pid_namespace())
    silence, pings = Silence(watch, False, 0.0), Pings()
    silence.quiet(1000.0, pings, lambda: False)
    assert pings.sent == [] and not watch.gone
    assert not silence.answers_ping(Envelope(Pong(1), 100))


def test_a_dropped_connection_is_a_job_ended_by_a_live_daemon_or_a_daemon_gone() -> None:
    watch = _watch(os.getpid())
    ended = watch.dropped_error(lambda timeout: os.getpid(), 7)
    assert "ended job 7" in str(ended) and watch.gone
    gone = _watch(os.getpid()).dropped_error(lambda timeout: None, 7)
    assert "is gone: no reply to a ping" in str(gone)
    replaced = _watch(os.getpid()).dropped_error(lambda timeout: 1, 7)
    assert "daemon pid 1 now answers" in str(replaced)
    exited = _watch(_exited_pid(), pid_namespace()).dropped_error(lambda timeout: None, 7)
    assert "its process has exited" in str(exited)
