"""The daemon's socket shared by its loop and its executors, on real ZeroMQ sockets: a message
from another thread than the loop's leaves at once, wakes the loop when it took in the news of
a message the loop has not read, never waits for the loop, and keeps its place behind a
message that could not leave."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq

from dalid.protocol import Message, Ok, Ping, Pong, endpoint, transport
from dalid.server.intake.shared_socket import SharedSocket

PEER = b"peer"


@dataclass
class Loop:
    """What the daemon's loop would be told: wake-ups, and messages that could not leave."""

    wakes: int = 0
    undelivered: list[tuple[bytes, int | None]] = field(default_factory=list)
    dropped: set[bytes] = field(default_factory=set)

    def wake(self) -> None:
        self.wakes += 1

    def woken(self) -> bool:
        wakes, self.wakes = self.wakes, 0
        return wakes > 0

    def deliverable(self, identity: bytes, _message: Message) -> bool:
        return identity not in self.dropped

    def failed(self, identity: bytes, error: zmq.ZMQError) -> None:
        self.undelivered.append((identity, error.errno))


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    made: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield made
    made.term()


@pytest.fixture
def loop() -> Loop:
    return Loop()


@pytest.fixture
def router(context: zmq.Context[Any], short_tmp: Path) -> zmq.Socket[Any]:
    """The daemon's socket as the daemon makes it, bound; the SharedSocket closes it."""
    return transport.make_socket(
        context, zmq.ROUTER, endpoint(short_tmp / "d.sock"), bind=True, heartbeat_ms=None
    )


@pytest.fixture
def shared(loop: Loop, router: zmq.Socket[Any]) -> Iterator[SharedSocket]:
    made = SharedSocket(loop.wake, loop.deliverable, loop.failed)
    made.open(router)
    yield made
    made.close(0)


def connect(context: zmq.Context[Any], short_tmp: Path, shared: SharedSocket) -> zmq.Socket[Any]:
    """A client connection under a known identity, which has sent a ping (so that the daemon's
    socket knows it) that the daemon has not read."""
    sock: zmq.Socket[Any] = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, PEER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint(short_tmp / "d.sock"))
    transport.send(sock, Ping(), 1)
    poller = zmq.Poller()
    poller.register(shared.loop_starts(), zmq.POLLIN)
    # The test's thread plays the loop from here on; pushes come from other threads.
    for _ in range(50):
        if shared.readable():
            return sock
        poller.poll(100)
    raise AssertionError("the ping never reached the daemon's socket")


@pytest.fixture
def peer(
    context: zmq.Context[Any], short_tmp: Path, shared: SharedSocket
) -> Iterator[zmq.Socket[Any]]:
    sock = connect(context, short_tmp, shared)
    yield sock
    sock.close()


def received_from(shared: SharedSocket) -> bytes:
    """The routing id of the message that waits (one must)."""
    frames = shared.receive()
    assert frames is not None, "no message waited"
    return frames[0].bytes


def from_another_thread(function: Any, *args: Any) -> None:
    thread = threading.Thread(target=function, args=args)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the push waited"


def test_a_message_from_another_thread_leaves_at_once(
    shared: SharedSocket, peer: zmq.Socket[Any]
) -> None:
    from_another_thread(shared.push, PEER, Pong(42), 7)
    envelope = transport.recv(peer)  # the loop sent nothing
    assert envelope.message == Pong(42)
    assert envelope.request_id == 7


def test_a_send_that_took_in_the_news_of_a_waiting_message_wakes_the_loop(
    loop: Loop, shared: SharedSocket, peer: zmq.Socket[Any]
) -> None:
    # The loop waits on the socket's descriptor, which signals news once: the send may have
    # taken it in, so the loop must be woken to read the ping that waits.
    loop.woken()
    from_another_thread(shared.push, PEER, Ok())
    assert isinstance(transport.recv(peer).message, Ok)
    assert loop.woken()
    assert received_from(shared) == PEER
    # Nothing waits now: a send wakes nobody.
    from_another_thread(shared.push, PEER, Ok())
    assert isinstance(transport.recv(peer).message, Ok)
    assert not loop.woken()


def test_the_loops_own_pushes_wait_for_its_flush(
    shared: SharedSocket, peer: zmq.Socket[Any]
) -> None:
    shared.push(PEER, Pong(1))  # from the loop's thread: queued, in order with its replies
    peer.setsockopt(zmq.RCVTIMEO, 200)
    with pytest.raises(zmq.Again):
        peer.recv()
    shared.flush()
    assert transport.recv(peer).message == Pong(1)


def test_a_push_never_waits_for_the_loop_holding_the_socket(
    loop: Loop, shared: SharedSocket, peer: zmq.Socket[Any]
) -> None:
    loop.woken()
    with shared._lock:  # the loop, inside a receive or a send
        from_another_thread(shared.push, PEER, Pong(2))
    assert loop.woken()
    shared.flush()
    assert transport.recv(peer).message == Pong(2)


def test_a_message_behind_one_that_could_not_leave_waits_its_turn(
    loop: Loop, shared: SharedSocket, peer: zmq.Socket[Any]
) -> None:
    # No connection has this identity: the send fails, and the loop is to deal with it.
    from_another_thread(shared.push, b"gone", Ok())
    from_another_thread(shared.push, PEER, Pong(3))
    peer.setsockopt(zmq.RCVTIMEO, 200)
    with pytest.raises(zmq.Again):
        peer.recv()
    assert loop.woken()
    shared.flush()
    assert loop.undelivered == [(b"gone", zmq.EHOSTUNREACH)]
    peer.setsockopt(zmq.RCVTIMEO, 5000)
    assert transport.recv(peer).message == Pong(3)


def test_a_result_no_longer_wanted_is_dropped(
    loop: Loop, shared: SharedSocket, peer: zmq.Socket[Any]
) -> None:
    loop.dropped.add(PEER)
    from_another_thread(shared.push, PEER, Pong(4))
    shared.push(PEER, Pong(5))
    shared.flush()
    peer.setsockopt(zmq.RCVTIMEO, 200)
    with pytest.raises(zmq.Again):
        peer.recv()
    assert loop.undelivered == []


def test_a_message_waits_for_the_socket_to_open(
    context: zmq.Context[Any], short_tmp: Path, loop: Loop, router: zmq.Socket[Any]
) -> None:
    shared = SharedSocket(loop.wake, loop.deliverable, loop.failed)
    try:
        from_another_thread(shared.push, PEER, Pong(6))
        assert loop.woken()
        shared.open(router)
        sock = connect(context, short_tmp, shared)
        try:
            shared.flush()
            assert transport.recv(sock).message == Pong(6)
        finally:
            sock.close()
    finally:
        shared.close(0)


def test_many_threads_sending_while_the_loop_receives_lose_nothing_and_keep_order(
    shared: SharedSocket, peer: zmq.Socket[Any]
) -> None:
    senders, each = 4, 300
    # The loop: receives the peer's pings and flushes, as the daemon's would, until told.
    done = threading.Event()
    received = 0
    poller = zmq.Poller()
    poller.register(shared.loop_starts(), zmq.POLLIN)

    def push_all(sender: int) -> None:
        # Each sender's messages carry its number as their request id, and their own count.
        for number in range(each):
            shared.push(PEER, Pong(number), sender)

    threads = [threading.Thread(target=push_all, args=(s,)) for s in range(senders)]
    for thread in threads:
        thread.start()
    got: dict[int | None, list[int]] = {s: [] for s in range(senders)}

    def read_all() -> None:
        for _ in range(senders * each):
            envelope = transport.recv(peer)
            assert isinstance(envelope.message, Pong)
            got[envelope.request_id].append(envelope.message.daemon_pid)
            if envelope.message.daemon_pid % 50 == 0:
                transport.send(peer, Ping(), 1)
        done.set()

    reader = threading.Thread(target=read_all)
    reader.start()
    deadline = time.monotonic() + 60
    while not done.is_set() and time.monotonic() < deadline:
        waiting = shared.readable()
        poller.poll(0 if waiting else 20)
        while shared.receive() is not None:
            received += 1
        shared.flush()
    for thread in [*threads, reader]:
        thread.join(10)
    # The peer's last pings may still be on their way when it has read everything (on a loaded
    # machine the loop may not have run at all meanwhile): the loop takes them now.
    pings = 1 + senders * len(range(0, each, 50))  # and the one it sent on connecting
    deadline = time.monotonic() + 10
    while received < pings and time.monotonic() < deadline:
        poller.poll(20)
        while shared.receive() is not None:
            received += 1
    assert got == {s: list(range(each)) for s in range(senders)}
    assert received == pings


def test_the_loop_asks_again_whether_a_message_waits_only_after_it_used_the_socket(
    shared: SharedSocket, peer: zmq.Socket[Any]
) -> None:
    assert shared.may_wait()  # the ping waits
    assert received_from(shared) == PEER
    assert not shared.readable()
    # News that came since the look that found nothing is signalled on the descriptor, where
    # the loop waits: it is not asked again.
    transport.send(peer, Ping(), 2)
    poller = zmq.Poller()
    poller.register(shared.loop_starts(), zmq.POLLIN)
    assert poller.poll(5000)
    assert not shared.may_wait()
    # The loop's own send may take the news in, leaving nothing to signal: it asks again.
    shared.send(PEER, Pong(5), 3)
    assert transport.recv(peer).message == Pong(5)
    assert shared.may_wait()
    assert received_from(shared) == PEER
    assert not shared.may_wait()


def test_a_receive_that_finds_nothing_is_a_look_that_said_no(
    shared: SharedSocket, peer: zmq.Socket[Any]
) -> None:
    # The loop receives until nothing waits, without a look before each message: the receive
    # that finds nothing stands for the look, and news after it is signalled on the descriptor.
    assert received_from(shared) == PEER
    assert shared.receive() is None
    assert not shared.may_wait()
    transport.send(peer, Ping(), 2)
    poller = zmq.Poller()
    poller.register(shared.loop_starts(), zmq.POLLIN)
    assert poller.poll(5000)
    assert received_from(shared) == PEER
    assert shared.receive() is None
