"""The limits of one connection, on real Unix sockets standing for the daemon's connections."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator

import pytest

from dalid.protocol import Error, ErrorCode
from dalid.server.intake.credentials import PeerCredentials, parse_peer_address
from dalid.server.intake.intake import (
    CUT_GRACE_S,
    MIN_PER_PROCESS,
    Intake,
    IntakeLimits,
    Verdict,
    per_process_connections,
)
from dalid.server.intake.log_damper import LINES_PER_SECOND, DampedLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made: list[tuple[socket.socket, socket.socket]] = []
    yield made
    for ours, theirs in made:
        ours.close()
        theirs.close()


def connect(
    intake: Intake, pairs: list[tuple[socket.socket, socket.socket]]
) -> tuple[int, socket.socket]:
    ours, theirs = socket.socketpair()
    pairs.append((ours, theirs))
    theirs.settimeout(1.0)
    assert intake.accepted(ours.fileno()) is None
    return ours.fileno(), theirs


def is_cut(theirs: socket.socket) -> bool:
    theirs.settimeout(0.2)
    try:
        return theirs.recv(1) == b""
    except TimeoutError:
        return False


# What ZeroMQ attaches to a message of a connection of this process (a socketpair's peer).
ME = PeerCredentials(os.getpid(), os.getuid(), os.getgid())
REFUSED = Error(ErrorCode.NOT_WELCOMED, "send hello first")


def test_refusals_over_the_burst_cut_the_connection_after_telling_it(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    clock = Clock()
    intake = Intake(IntakeLimits(refusal_burst=3, refusals_per_second=1.0), clock=clock)
    fd, theirs = connect(intake, pairs)
    assert intake.admit(b"a", fd, 10, ME) is Verdict.PROCESS
    assert intake.credentials(b"a") is not None
    for _ in range(3):
        assert intake.refused(b"a", REFUSED) is None
    notice = intake.refused(b"a", REFUSED)
    assert isinstance(notice, Error) and notice.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "4 requests" in notice.message and "closes this connection" in notice.message
    assert "send hello first" in notice.message
    assert intake.admit(b"a", fd, 10, ME) is Verdict.DROP  # told: the rest is not read
    intake.cut_due()
    assert not is_cut(theirs)  # the error leaves first
    assert intake.next_cut() == pytest.approx(CUT_GRACE_S)
    clock.now += CUT_GRACE_S
    intake.cut_due()
    assert is_cut(theirs)
    assert intake.next_cut() is None
    assert intake.closed(fd) == b"a"
    assert intake.open_connections == 0
    assert intake.cuts == 1  # shut down here, then seen closed: one cut


def test_a_cut_connection_its_peer_closes_during_the_grace_counts_as_cut(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    # The daemon gives back the memory of each cut connection once it is gone, however it went.
    clock = Clock()
    intake = Intake(IntakeLimits(max_message_bytes=1000), clock=clock)
    fd, _ = connect(intake, pairs)
    assert isinstance(intake.admit(b"a", fd, 1001, ME), Error)
    assert intake.cuts == 0
    assert intake.closed(fd) == b"a"
    assert intake.cuts == 1
    assert intake.next_cut() is None
    clock.now += CUT_GRACE_S
    intake.cut_due()
    assert intake.cuts == 1


def test_refusals_at_a_sustainable_rate_are_never_cut(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    clock = Clock()
    intake = Intake(IntakeLimits(refusal_burst=3, refusals_per_second=2.0), clock=clock)
    fd, theirs = connect(intake, pairs)
    intake.admit(b"a", fd, 10, ME)
    for _ in range(100):
        clock.now += 0.5
        assert intake.refused(b"a", REFUSED) is None
    assert not is_cut(theirs)


def test_another_users_process_is_told_and_cut(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    clock = Clock()
    intake = Intake(IntakeLimits(), uids=frozenset({12345}), clock=clock)
    fd, theirs = connect(intake, pairs)
    notice = intake.admit(b"a", fd, 10, ME)
    assert isinstance(notice, Error) and notice.code is ErrorCode.NOT_WELCOMED
    assert "uid 12345 only" in notice.message and "closes this connection" in notice.message
    assert intake.admit(b"a", fd, 10, ME) is Verdict.DROP
    clock.now += CUT_GRACE_S
    intake.cut_due()
    assert is_cut(theirs)


def test_another_users_process_that_says_nothing_is_cut_too(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    clock = Clock()
    intake = Intake(IntakeLimits(), uids=frozenset({12345}), clock=clock)
    _, theirs = connect(intake, pairs)
    assert intake.next_cut() == pytest.approx(CUT_GRACE_S)
    clock.now += CUT_GRACE_S
    intake.cut_due()
    assert is_cut(theirs)


def test_a_message_over_the_limit_is_refused_and_its_connection_cut(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    clock = Clock()
    intake = Intake(IntakeLimits(max_message_bytes=1000), clock=clock)
    fd, theirs = connect(intake, pairs)
    assert intake.admit(b"a", fd, 1000, ME) is Verdict.PROCESS
    notice = intake.admit(b"a", fd, 1001, ME)
    assert isinstance(notice, Error) and "1001 bytes" in notice.message
    clock.now += CUT_GRACE_S
    intake.cut_due()
    assert is_cut(theirs)


def test_connections_past_the_limit_are_cut_at_once(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    intake = Intake(IntakeLimits(max_connections=2))
    kept = [connect(intake, pairs)[1] for _ in range(2)]
    _, third = connect(intake, pairs)
    assert is_cut(third)
    assert not any(is_cut(theirs) for theirs in kept)


def test_one_process_holds_at_most_its_share_of_the_connections(
    pairs: list[tuple[socket.socket, socket.socket]], caplog: pytest.LogCaptureFixture
) -> None:
    intake = Intake(IntakeLimits(max_connections=200))
    share = per_process_connections(200)
    assert share == MIN_PER_PROCESS  # an eighth of 200 is fewer
    held = [connect(intake, pairs) for _ in range(share)]
    with caplog.at_level(logging.WARNING, logger="dalid.server"):
        fd, over = connect(intake, pairs)
    assert is_cut(over)
    assert f"process {os.getpid()} holds {share + 1} connections" in caplog.text
    assert "--max-connections 200" in caplog.text
    assert not is_cut(held[0][1])
    # Connections that close give their place back to their process.
    intake.closed(fd)
    intake.closed(held[0][0])
    assert not is_cut(connect(intake, pairs)[1])


def test_a_storm_of_connections_is_cut_with_a_few_log_lines_that_count_the_rest(
    pairs: list[tuple[socket.socket, socket.socket]], caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    intake = Intake(IntakeLimits(max_connections=1), clock=clock)
    connect(intake, pairs)
    with caplog.at_level(logging.WARNING, logger="dalid.server"):
        storm = [connect(intake, pairs)[1] for _ in range(50)]
        assert all(is_cut(theirs) for theirs in storm)  # every one is still cut
        lines = [r.getMessage() for r in caplog.records if "cut at once" in r.getMessage()]
        assert len(lines) == LINES_PER_SECOND
        intake.cut_due()  # within the second: nothing more
        clock.now += 1.5
        intake.cut_due()  # the second is over: the lines left out are counted
    told = caplog.records[-1].getMessage()
    assert f"{50 - LINES_PER_SECOND} more lines like the last were not logged" in told
    assert len(caplog.records) == LINES_PER_SECOND + 1


def test_a_damped_line_says_how_many_of_its_kind_were_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    damped = DampedLog(logging.getLogger("dalid.test"), per_second=2, clock=clock)
    with caplog.at_level(logging.WARNING, logger="dalid.test"):
        for n in range(10):
            damped.warning("line %d", n)
        clock.now += 1.0
        damped.warning("line %d", 10)
    assert [r.getMessage() for r in caplog.records] == [
        "line 0",
        "line 1",
        "line 10 (and 8 more like it not logged)",
    ]
    assert damped.left_out == 0 and damped.left_out_total == 8


def test_a_peer_that_reads_nothing_is_cut_at_once(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    intake = Intake(IntakeLimits())
    fd, theirs = connect(intake, pairs)
    intake.admit(b"a", fd, 10, ME)
    intake.unreachable(b"a")
    assert is_cut(theirs)
    intake.unreachable(b"a")  # once is enough


def test_a_late_message_of_a_closed_connection_is_dropped(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    intake = Intake(IntakeLimits())
    fd, _ = connect(intake, pairs)
    intake.admit(b"a", fd, 10, ME)
    assert intake.closed(fd) == b"a"
    assert intake.admit(b"a", fd, 10, ME) is Verdict.DROP
    assert intake.credentials(b"a") is None


def test_a_descriptor_reused_unreported_is_a_new_connection(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    intake = Intake(IntakeLimits())
    fd, _ = connect(intake, pairs)
    intake.admit(b"a", fd, 10, ME)
    # Accepted again with no close reported: the identity that sent on it is gone.
    assert intake.accepted(fd) == b"a"
    assert intake.admit(b"b", fd, 10, ME) is Verdict.PROCESS
    assert intake.closed(fd) == b"b"


def test_the_credentials_zeromq_attaches_are_read_and_nothing_else() -> None:
    assert parse_peer_address("localhost:1000:100:4242") == PeerCredentials(4242, 1000, 100)
    assert parse_peer_address(":0:0:1") == PeerCredentials(1, 0, 0)
    for unreadable in ("", "localhost", "localhost:1:2", "localhost:a:1:2", "1:2:-3:4"):
        assert parse_peer_address(unreadable) is None, unreadable


def test_a_message_whose_sender_cannot_be_told_is_refused(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    # Its process closed the connection before the daemon read it, say: fail closed.
    clock = Clock()
    intake = Intake(IntakeLimits(), clock=clock)
    fd, theirs = connect(intake, pairs)
    notice = intake.admit(b"a", fd, 10, None)
    assert isinstance(notice, Error) and notice.code is ErrorCode.NOT_WELCOMED
    assert "cannot tell which process" in notice.message
    # Nothing it sends later is acted on, whatever credentials it comes with.
    assert intake.admit(b"a", fd, 10, None) is Verdict.DROP
    assert intake.admit(b"a", fd, 10, ME) is not Verdict.PROCESS
    # The descriptor is not known to be the sender's: its connection is left alone.
    clock.now += CUT_GRACE_S
    intake.cut_due()
    assert not is_cut(theirs)


def test_another_users_message_is_refused_whatever_its_descriptor_says(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    # The descriptor, read late, names a connection of the daemon's user (the stranger's
    # closed and its number was reused): the message's own credentials decide.
    clock = Clock()
    intake = Intake(IntakeLimits(), clock=clock)
    fd, theirs = connect(intake, pairs)
    stranger = PeerCredentials(4242, ME.uid + 1, ME.gid)
    notice = intake.admit(b"s", fd, 10, stranger)
    assert isinstance(notice, Error) and notice.code is ErrorCode.NOT_WELCOMED
    assert f"uid {stranger.uid} is refused" in notice.message
    assert intake.admit(b"s", fd, 10, stranger) is Verdict.DROP
    clock.now += CUT_GRACE_S
    intake.cut_due()
    assert not is_cut(theirs)  # the connection on that descriptor now is not the stranger's
    assert intake.admit(b"a", fd, 10, ME) is Verdict.PROCESS  # and is served


def test_an_identity_is_bound_to_the_connection_and_process_it_first_came_from(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    clock = Clock()
    intake = Intake(IntakeLimits(), clock=clock)
    fd, theirs = connect(intake, pairs)
    other_fd, other = connect(intake, pairs)
    assert intake.admit(b"a", fd, 10, ME) is Verdict.PROCESS
    # The same routing id on another connection (a peer that chose it), or from another
    # process: refused, each time.
    for descriptor, sender in (
        (other_fd, ME),
        (fd, PeerCredentials(ME.pid + 1, ME.uid, ME.gid)),
        (fd, PeerCredentials(ME.pid, ME.uid + 1, ME.gid)),
        (fd, None),
    ):
        refusal = intake.admit(b"a", descriptor, 10, sender)
        assert isinstance(refusal, Error) and refusal.code is ErrorCode.NOT_WELCOMED
        assert "routing id is another connection's" in refusal.message
    assert intake.impostors == 4
    # The connection it belongs to is served as before, and neither is cut.
    assert intake.admit(b"a", fd, 10, ME) is Verdict.PROCESS
    assert intake.credentials(b"a") == ME
    clock.now += CUT_GRACE_S
    intake.cut_due()
    assert not is_cut(theirs) and not is_cut(other)
