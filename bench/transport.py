"""Per-batch overhead of going through the daemon, measured on an empty pipeline.

Each probe is timed call by call with ``perf_counter_ns``:

- ``os_echo``: one byte to an echo process over a Unix socketpair and back: what any
  cross-process round trip costs on this machine (wake-ups included), the floor of floors.
- ``zmq_echo``: one frame to a ZeroMQ ROUTER echo process over ipc (no dalid): the floor of
  dalid's transport, whose messages ride such sockets.
- ``ping``: a bare protocol round trip (ping -> pong) on a socket of its own; the floor.
- ``dalid_b1`` / ``dalid_b32``: one batch of 1 (or 32) tiny samples through the real client
  path: proxy call, collate (which submits), wait for the batch, view its output, drop it.
  ``dalid_b1_submit`` is the part until the batch is sent (proxy calls and collate, which
  reads the previous batch's acceptance first), ``dalid_b1_ready`` the rest (waiting for the
  batch, mapping its output).
- ``dali_b1`` / ``dali_b32``: the same empty pipeline run in-process with ``pipe.run``; what
  DALI itself costs per batch, so that ``dalid - dali`` is what the transport adds.
- On a GPU, ``dalid_gpu_b1`` / ``dali_gpu_b1``: one tiny sample copied to the GPU by the
  pipeline, through dalid (a CUDA IPC slab, the batch's event) and in-process, read back on the
  host: what delivering a GPU output adds per batch.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from torch.utils.data import default_collate

import dalid.client as dalid
from dalid.protocol import Ping, Pong, endpoint, transport

from .config import Settings
from .echo import STOP
from .pipelines import TINY_INPUT, tiny_pipeline

SAMPLE = np.arange(8, dtype=np.uint8)  # one tiny sample: 8 bytes
WARMUP_FRACTION = 0.1


def _time(step: Callable[[], object], iterations: int) -> list[float]:
    """Microseconds per call of ``step``, after a warm-up of a tenth as many calls."""
    for _ in range(max(10, int(iterations * WARMUP_FRACTION))):
        step()
    times = []
    for _ in range(iterations):
        start = time.perf_counter_ns()
        step()
        times.append((time.perf_counter_ns() - start) / 1e3)
    return times


def _ping_step(socket_path: str) -> tuple[Callable[[], object], Callable[[], None]]:
    context: zmq.Context[Any] = zmq.Context()
    sock = transport.make_socket(context, zmq.DEALER, endpoint(Path(socket_path)), bind=False)

    def step() -> object:
        transport.send(sock, Ping(), 1)
        reply = transport.recv(sock).message
        assert isinstance(reply, Pong)
        return reply

    def close() -> None:
        sock.close(linger=0)
        context.term()

    return step, close


def _echo(kind: str, where: str, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "bench.echo", kind, where]
    return subprocess.Popen(command, pass_fds=pass_fds)


def _reap(server: subprocess.Popen[bytes]) -> None:
    """Waits for an echo server told to stop; kills it if it does not."""
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@contextlib.contextmanager
def _os_echo() -> Iterator[Callable[[], object]]:
    ours, theirs = socket.socketpair()
    server = _echo("socket", str(theirs.fileno()), (theirs.fileno(),))
    theirs.close()

    def step() -> object:
        ours.send(b"x")
        return ours.recv(64)

    try:
        yield step
    finally:
        ours.sendall(STOP)
        ours.close()
        _reap(server)


@contextlib.contextmanager
def _zmq_echo() -> Iterator[Callable[[], object]]:
    directory = Path(tempfile.mkdtemp(prefix="dalidb-echo-", dir="/tmp"))
    address = endpoint(directory / "echo.sock")
    server = _echo("zmq", address)
    context: zmq.Context[Any] = zmq.Context()
    sock = transport.make_socket(context, zmq.DEALER, address, bind=False)

    def step() -> object:
        sock.send(b"x")
        return sock.recv()

    try:
        yield step
    finally:
        sock.send(STOP)
        sock.close(linger=200)
        context.term()
        _reap(server)
        shutil.rmtree(directory, ignore_errors=True)


class _DalidStep:
    """One tiny batch through dalid; also keeps how long its two halves took (µs)."""

    def __init__(self, session: Any, proxy: Any, batch: int) -> None:
        self.session = session
        self.proxy = proxy
        self.batch = batch
        self.submit_us: list[float] = []
        self.ready_us: list[float] = []

    def __call__(self) -> object:
        start = time.perf_counter_ns()
        refs = [self.proxy(SAMPLE) for _ in range(self.batch)]
        batch = default_collate(refs)  # collating submits the batch and waits for its id
        submitted = time.perf_counter_ns()
        output = self.session.produce_data(batch)
        value = int(output[0, 0])
        del output  # releases the region back to the daemon
        self.submit_us.append((submitted - start) / 1e3)
        self.ready_us.append((time.perf_counter_ns() - submitted) / 1e3)
        return value


def _dali_step(pipe: Any, batch: int) -> Callable[[], object]:
    samples = [SAMPLE] * batch

    def step() -> object:
        (output,) = pipe.run(**{TINY_INPUT: samples})
        if type(output).__name__ == "TensorListGPU":
            output = output.as_cpu()  # read on the host, as the dalid step reads its tensor
        return int(np.asarray(output.at(0))[0])

    return step


@contextlib.contextmanager
def transport_probes(settings: Settings) -> Iterator[Callable[[], dict[str, list[float]]]]:
    """Connects to the daemon and builds the pipelines; yields the function that measures."""
    n = settings.transport_iterations
    ping, close_ping = _ping_step(settings.socket)
    try:
        with (
            _os_echo() as os_echo,
            _zmq_echo() as zmq_echo,
            dalid.connect(
                device=settings.device,
                socket=settings.socket,
                autostart=False,
                name="bench transport",
            ) as session,
        ):
            # CPU pipelines: these probes measure messaging, not where an empty pipeline runs;
            # on a GPU, the gpu ones measure the delivery of a GPU output besides.
            proxies = {b: session.proxy(tiny_pipeline(b)) for b in (1, 32)}
            pipes = {b: tiny_pipeline(b) for b in (1, 32)}
            if settings.gpu:
                proxies[-1] = session.proxy(tiny_pipeline(1, gpu=True))
                pipes[-1] = tiny_pipeline(1, gpu=True)
            for pipe in pipes.values():
                pipe.build()

            def measure() -> dict[str, list[float]]:
                dalid_b1 = _DalidStep(session, proxies[1], 1)
                gpu = (
                    {
                        "dalid_gpu_b1": _time(_DalidStep(session, proxies[-1], 1), n),
                        "dali_gpu_b1": _time(_dali_step(pipes[-1], 1), n),
                    }
                    if settings.gpu
                    else {}
                )
                return {
                    **gpu,
                    "os_echo": _time(os_echo, n),
                    "zmq_echo": _time(zmq_echo, n),
                    "ping": _time(ping, n),
                    "dalid_b1": _time(dalid_b1, n),
                    # The last n calls are the timed ones; the first were warm-up.
                    "dalid_b1_submit": dalid_b1.submit_us[-n:],
                    "dalid_b1_ready": dalid_b1.ready_us[-n:],
                    "dali_b1": _time(_dali_step(pipes[1], 1), n),
                    "dalid_b32": _time(_DalidStep(session, proxies[32], 32), n),
                    "dali_b32": _time(_dali_step(pipes[32], 32), n),
                }

            yield measure
    finally:
        close_ping()
