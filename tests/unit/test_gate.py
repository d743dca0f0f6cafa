"""The gate's answers to ZeroMQ about new connections, by the credentials in their address; a
real ZeroMQ socket behind it refuses a connection it refuses."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import zmq

from dalid.server.intake.gate import DOMAIN, Gate


def test_the_gate_admits_served_users_only_and_fails_closed() -> None:
    context: zmq.Context[Any] = zmq.Context()
    gate = Gate(context, frozenset({1000, 0}))
    try:
        assert gate.verdict("localhost:1000:100:42") == (b"200", "OK")
        assert gate.verdict("localhost:0:0:1")[0] == b"200"
        code, text = gate.verdict("localhost:65534:65534:7")
        assert code == b"400" and "uid 65534 is refused" in text and "uid 1000 and 0" in text
        for unreadable in ("", "localhost", "localhost:x:1:2"):
            code, text = gate.verdict(unreadable)
            assert code == b"400" and "cannot tell which process" in text
    finally:
        gate.close()
        gate.close()  # idempotent
        context.term()


def test_a_socket_behind_the_gate_serves_its_user_and_not_another(short_tmp: Path) -> None:
    address = f"ipc://{short_tmp}/gate.sock"
    for served, answered in ((os.getuid(), True), (os.getuid() + 1, False)):
        # A context each: the gate's inproc address is the context's one ZAP handler.
        context: zmq.Context[Any] = zmq.Context()
        gate = Gate(context, frozenset({served}))
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
        router.bind(address)
        dealer = context.socket(zmq.DEALER)
        try:
            dealer.connect(address)
            dealer.send(b"hello")
            assert bool(router.poll(1000)) is answered
            assert (gate.refused == 0) is answered
        finally:
            dealer.close(linger=0)
            router.close(linger=0)
            gate.close()
            context.term()


def test_with_its_gate_gone_the_socket_lets_no_one_in(short_tmp: Path) -> None:
    # Fails closed: a gate whose thread stopped leaves no connection attached unasked.
    from dalid.protocol import transport

    context: zmq.Context[Any] = zmq.Context()
    address = f"ipc://{short_tmp}/gate.sock"
    Gate(context, frozenset({os.getuid()})).close()
    router = transport.make_socket(context, zmq.ROUTER, address, bind=True, zap_domain=DOMAIN)
    dealer = transport.make_socket(context, zmq.DEALER, address, bind=False)
    try:
        dealer.send(b"hello")
        assert router.poll(500) == 0
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        context.term()
