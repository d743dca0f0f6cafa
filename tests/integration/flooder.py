"""A client that floods the daemon on purpose, as its own process: raw pyzmq, no dalid client.

    python -m tests.integration.flooder --socket PATH MODE

Modes:

- ``batches``: a trainer that registers a pipeline, then sends ``submit_batch`` as fast as it
  can, never waiting for an acceptance nor reading an answer (nothing blocks: its own queue is
  unbounded). When the daemon cuts it, ZeroMQ reconnects it and it goes on.
- ``batches-reading``: the same, reading every answer between sends; prints each error that
  closes its connection (``cut <code>: <message>``).
- ``random``: 2,000 messages of random frames, then holds the connection open.
- ``unread``: pings as fast as it can and never reads the pongs.
- ``oversized``: a trainer that sends one batch of ``--sample-bytes`` frames, 40 of them;
  prints the error it gets.
- ``connections``: opens ``--count`` connections and pings on each; prints how many answered.

Prints ``flooding`` once the flood starts; runs until killed (the last two modes exit).
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import zmq

from dalid.protocol import (
    PROTOCOL_VERSION,
    Error,
    Hello,
    InputBatch,
    Ping,
    PipelineRegistered,
    RegisterPipeline,
    Role,
    SubmitBatch,
    Welcome,
    decode,
    encode,
)

from .helpers import two_output_pipeline

CUT = "closes this connection"


def _socket(context: zmq.Context[Any], path: str) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)  # never blocks: everything queues on this side
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{path}")
    return sock


def _request(sock: zmq.Socket[Any], message: Any, rid: int, timeout: float = 30.0) -> Any:
    sock.send_multipart(encode(message, rid))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sock.poll(100):
            envelope = decode(sock.recv_multipart())
            if envelope.request_id == rid:
                return envelope.message
    raise SystemExit(f"no answer to {message.OP}")


def _trainer(sock: zmq.Socket[Any]) -> tuple[int, int]:
    """Hello and a registered pipeline; the pipeline's id and the connection's batch ids' base."""
    welcome = _request(sock, Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER, name="flooder"), 1)
    assert isinstance(welcome, Welcome), welcome
    serialized = memoryview(two_output_pipeline().serialize())
    registered = _request(sock, RegisterPipeline(serialized, ("data",), 2, 8, 1, 1), 2)
    assert isinstance(registered, PipelineRegistered), registered
    return registered.pipeline_id, welcome.batch_id_base


def _batches(pipeline_id: int, base: int, sample_bytes: int, samples: int = 1) -> Iterator[Any]:
    """The frames of one batch after another, each under the connection's next id."""
    side = max(1, int((sample_bytes // 4) ** 0.5))
    batch = InputBatch.of("data", [np.zeros((side, side), np.int32)] * samples)
    for batch_id in itertools.count(base + 1):
        yield encode(SubmitBatch(pipeline_id, (batch,), batch_id), 9)


def _print_cuts(sock: zmq.Socket[Any], seen: set[str]) -> None:
    while sock.poll(0):
        try:
            message = decode(sock.recv_multipart()).message
        except ValueError:
            continue
        if isinstance(message, Error) and CUT in message.message and message.message not in seen:
            seen.add(message.message)
            print(f"cut {message.code}: {message.message}", flush=True)


def flood_batches(sock: zmq.Socket[Any], sample_bytes: int, read: bool) -> None:
    batches = _batches(*_trainer(sock), sample_bytes)
    print("flooding", flush=True)
    seen: set[str] = set()
    for frames in batches:
        sock.send_multipart(frames, copy=False)
        if read:
            _print_cuts(sock, seen)


def flood_random(sock: zmq.Socket[Any]) -> None:
    print("flooding", flush=True)
    rng = random.Random(1234)
    for _ in range(2000):
        sock.send_multipart([rng.randbytes(rng.randint(0, 256)) for _ in range(rng.randint(1, 4))])
    print("sent", flush=True)
    while True:
        time.sleep(1)


def flood_unread(sock: zmq.Socket[Any]) -> None:
    sock.setsockopt(zmq.RCVHWM, 1)
    frames = encode(Ping(), 1)
    print("flooding", flush=True)
    while True:
        sock.send_multipart(frames)


def oversized(sock: zmq.Socket[Any], sample_bytes: int) -> None:
    frames = next(_batches(*_trainer(sock), sample_bytes, samples=40))
    print("flooding", flush=True)
    sock.send_multipart(frames, copy=False)
    seen: set[str] = set()
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        if sock.poll(100):
            _print_cuts(sock, seen)


def connections(context: zmq.Context[Any], path: str, count: int) -> None:
    print("flooding", flush=True)
    socks = [_socket(context, path) for _ in range(count)]
    for sock in socks:
        sock.send_multipart(encode(Ping(), 1))
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    answered: set[zmq.Socket[Any]] = set()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and len(answered) < count:
        answered.update(sock for sock, _ in poller.poll(100))
    print(f"answered {len(answered)}", flush=True)
    for sock in socks:
        sock.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("mode")
    parser.add_argument("--sample-bytes", type=int, default=256 << 10)
    parser.add_argument("--count", type=int, default=16)
    args = parser.parse_args()
    context: zmq.Context[Any] = zmq.Context()
    sock = _socket(context, args.socket)
    try:
        if args.mode in ("batches", "batches-reading"):
            flood_batches(sock, args.sample_bytes, read=args.mode == "batches-reading")
        elif args.mode == "random":
            flood_random(sock)
        elif args.mode == "unread":
            flood_unread(sock)
        elif args.mode == "oversized":
            oversized(sock, args.sample_bytes)
        elif args.mode == "connections":
            connections(context, args.socket, args.count)
        else:
            sys.exit(f"unknown mode {args.mode!r}")
    finally:
        sock.close()
        context.term()


if __name__ == "__main__":
    main()
