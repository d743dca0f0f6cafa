"""Daemon and clients of different releases that speak one protocol version (SPEC.md, Versions):
a message carrying a field from a later release, and one without a field an earlier release
did not have, each way, through a real daemon and a real client connection."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from dalid.client.link.connection import Connection
from dalid.protocol import (
    PROTOCOL_VERSION,
    Hello,
    Limits,
    Ping,
    Pong,
    Role,
    StatusReport,
    StatusRequest,
    Welcome,
    decode,
    encode,
    endpoint,
    transport,
)

from ..daemons import DaemonProcess


def _with_future_fields(frames: list[Any]) -> list[Any]:
    """``frames`` as a later release would send them: a new field in the body and in a nested
    map of it, and a new frame that only the new field references."""
    header = msgpack.unpackb(bytes(frames[0]), raw=False)
    header["body"]["from_the_future"] = {"any": ["value", 1, None]}
    for value in header["body"].values():
        if isinstance(value, dict):
            value["also_from_the_future"] = 2.5
    header["body"]["future_blob"] = len(frames)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:], b"a later release's data"]


def _without(frames: list[Any], *fields: str) -> list[Any]:
    """``frames`` as an earlier release would send them, without ``fields``."""
    header = msgpack.unpackb(bytes(frames[0]), raw=False)
    for name in fields:
        del header["body"][name]
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def _exchange(socket_path: Any, frames: list[Any]) -> Any:
    context = zmq.Context()
    sock = transport.make_socket(context, zmq.DEALER, endpoint(socket_path), bind=False)
    try:
        sock.send_multipart(frames)
        assert sock.poll(10_000), "no reply"
        return transport.recv(sock).message
    finally:
        sock.close(linger=0)
        context.term()


def test_a_newer_client_is_welcomed_by_this_daemon(daemon: DaemonProcess) -> None:
    hello = Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER, name="from a later release")
    welcome = _exchange(daemon.socket, _with_future_fields(encode(hello, 1)))
    assert isinstance(welcome, Welcome)
    assert isinstance(_exchange(daemon.socket, _with_future_fields(encode(Ping(), 2))), Pong)


def test_an_older_client_without_later_fields_is_welcomed_with_defaults(
    daemon: DaemonProcess,
) -> None:
    hello = Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER, name="from an earlier release")
    frames = _without(encode(hello, 1), "earlier_jobs", "weight", "memory_bytes", "name")
    welcome = _exchange(daemon.socket, frames)
    assert isinstance(welcome, Welcome)
    assert welcome.limits.weight == 1.0  # the default of the field it did not send


class _StandInDaemon:
    """A daemon of another release, as far as a client's hello and ping go: it answers with
    what ``reply`` makes of each request's frames."""

    def __init__(self, path: Any, reply: Any) -> None:
        self._context = zmq.Context()
        self._router = transport.make_socket(self._context, zmq.ROUTER, endpoint(path), bind=True)
        self._reply = reply
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            peer, *frames = self._router.recv_multipart()
            envelope = decode(frames)
            answer = self._reply(envelope)
            if answer is not None:
                self._router.send_multipart([peer, *answer])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._router.close(linger=0)
        self._context.term()


def _welcome(**fields: Any) -> Welcome:
    return Welcome(
        protocol_version=PROTOCOL_VERSION,
        daemon_pid=os.getpid(),
        device="cpu",
        dali_version="x",
        job_id=1,
        job_token="t" * 32,
        limits=Limits(
            max_batch_size=8, max_message_bytes=1 << 20, pool_bytes=1 << 20, slab_bytes=1 << 16
        ),
        **fields,
    )


@pytest.mark.parametrize("release", ["newer", "older"])
def test_this_client_connects_to_a_daemon_of_another_release(short_tmp: Path, release: str) -> None:
    def reply(envelope: Any) -> list[Any] | None:
        message, rid = envelope.message, envelope.request_id
        if isinstance(message, Hello):
            frames = encode(_welcome(), rid)
            if release == "newer":
                return _with_future_fields(frames)
            return _without(frames, "device_uuid", "pid_namespace")
        if isinstance(message, Ping):
            frames = encode(Pong(os.getpid()), rid)
            return _with_future_fields(frames) if release == "newer" else frames
        return None

    daemon = _StandInDaemon(short_tmp / "other.sock", reply)
    try:
        connection = Connection(short_tmp / "other.sock", Role.TRAINER, name="this release")
        try:
            assert connection.welcome.job_id == 1
            assert connection.welcome.pid_namespace == 0  # the older release's default
            assert isinstance(connection.request(Ping(), timeout=5.0), Pong)
        finally:
            connection.close(goodbye=False)
    finally:
        daemon.close()


def test_a_newer_clients_status_request_is_answered(daemon: DaemonProcess) -> None:
    report = _exchange(daemon.socket, _with_future_fields(encode(StatusRequest(), 3)))
    assert isinstance(report, StatusReport)
