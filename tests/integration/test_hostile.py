"""A daemon under hostile traffic and other users: private files, owned buffers, fuzzed frames."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dalid.client as dalid
from dalid.protocol import (
    PROTOCOL_VERSION,
    BatchAccepted,
    Error,
    ErrorCode,
    Goodbye,
    Hello,
    InputBatch,
    Message,
    Ping,
    PipelineRegistered,
    Pong,
    RegisterNamedPipeline,
    RegisterPipeline,
    ReleaseRegions,
    Role,
    ScheduleBatch,
    Shutdown,
    SubmitBatch,
    Welcome,
    encode,
    endpoint,
    transport,
)
from dalid.protocol.messages import MESSAGE_TYPES, Ok

from ..daemons import DaemonProcess, own_directory, start_daemon, wait_for, wait_until_answering
from .helpers import BATCH, ProxyDataset, run_in_process, sample, two_output_pipeline


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def check_outputs(session: dalid.Session) -> None:
    """A normal job gets the right data: the outputs equal the in-process run's."""
    proxy = session.proxy(two_output_pipeline())
    loader = dalid.DataLoader(session, ProxyDataset(proxy, BATCH), batch_size=BATCH)
    ((scaled, shifted), indices) = next(iter(loader))
    (expected,) = run_in_process(two_output_pipeline(), [{"data": [sample(i) for i in range(8)]}])
    np.testing.assert_array_equal(scaled.numpy(), expected[0])
    np.testing.assert_array_equal(shifted.numpy(), expected[1])
    assert indices.tolist() == list(range(BATCH))


def test_runtime_dir_socket_and_segments_are_private_even_with_umask_0() -> None:
    directory = own_directory()
    runtime = directory / "runtime"  # made by the daemon
    socket = runtime / "cpu.sock"
    log = directory / "d.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "dalid.server", "serve", "--socket", str(socket)],
            stdout=out,
            stderr=subprocess.STDOUT,
            umask=0,
        )
    daemon = DaemonProcess(socket, process, log)
    try:
        wait_until_answering(socket, process)
        assert mode(runtime) == 0o700
        assert mode(socket) == 0o600 and stat.S_ISSOCK(socket.stat().st_mode)
        assert mode(socket.with_name("cpu.sock.lock")) == 0o600
        with dalid.connect(socket=socket, autostart=False) as session:
            check_outputs(session)
            segments = [Path("/dev/shm") / name for name in daemon.segments()]
            assert segments
            for segment in segments:
                assert mode(segment) == 0o600 and segment.stat().st_uid == os.getuid()
    finally:
        assert daemon.stop() == 0, daemon.log_text()
        assert not daemon.segments()
        shutil.rmtree(directory, ignore_errors=True)


class RawPeer:
    """A DEALER connection speaking the protocol by hand, for what the client never sends."""

    def __init__(self, context: zmq.Context[Any], socket: Path) -> None:
        self.sock = transport.make_socket(context, zmq.DEALER, endpoint(socket), bind=False)
        self.rid = 0

    def send_frames(self, frames: list[Any]) -> None:
        self.sock.send_multipart(frames)

    def request(self, message: Message, timeout_ms: int = 10000) -> Message:
        self.rid += 1
        transport.send(self.sock, message, self.rid)
        while True:
            assert self.sock.poll(timeout_ms), f"no answer to {message.OP}"
            envelope = transport.recv(self.sock)
            if envelope.request_id == self.rid:
                return envelope.message

    def notify(self, message: Message, wait_ms: int = 2000) -> Message | None:
        transport.send(self.sock, message, None)
        if self.sock.poll(wait_ms):
            return transport.recv(self.sock).message
        return None

    def drain(self, timeout_ms: int) -> int:
        count = 0
        while self.sock.poll(timeout_ms):
            self.sock.recv_multipart()
            count += 1
            timeout_ms = 0
        return count

    def close(self) -> None:
        self.sock.close(linger=0)


def trainer_hello(name: str = "raw") -> Hello:
    return Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER, name=name)


def test_a_job_cannot_release_another_jobs_regions(daemon: DaemonProcess) -> None:
    context: zmq.Context[Any] = zmq.Context()
    intruder = RawPeer(context, daemon.socket)
    try:
        with dalid.connect(socket=daemon.socket, autostart=False) as owner:
            proxy = owner.proxy(two_output_pipeline())
            loader = dalid.DataLoader(owner, ProxyDataset(proxy, 4 * BATCH), batch_size=BATCH)
            batches = iter(loader)
            (held, _), _ = next(batches)
            kept = held.clone()
            intruder.request(trainer_hello("intruder"))
            # Region ids are small integers: the intruder names every one the owner could hold.
            reply = intruder.notify(ReleaseRegions(tuple(range(1, 64))))
            assert reply is not None and reply.code is ErrorCode.UNKNOWN_REGION  # type: ignore[attr-defined]
            assert "not leased to job" in reply.message  # type: ignore[attr-defined]
            # Had the release gone through, the next batches would be written into the held
            # regions (first fit reuses the lowest free offset) and change `held`.
            later = [scaled.clone() for (scaled, _), _ in batches]
            assert len(later) == 3
            torch.testing.assert_close(held, kept)
            assert owner.live_regions >= 1  # `held` still views its region
            assert intruder.request(Ping()).OP == "pong"
    finally:
        intruder.close()
        context.term()


def test_a_region_released_twice_is_refused_the_second_time(daemon: DaemonProcess) -> None:
    context: zmq.Context[Any] = zmq.Context()
    peer = RawPeer(context, daemon.socket)
    try:
        welcome = peer.request(trainer_hello())
        assert isinstance(welcome, Welcome)
        registered = peer.request(
            RegisterPipeline(
                memoryview(two_output_pipeline().serialize()), ("data",), 2, BATCH, 1, 1
            )
        )
        assert isinstance(registered, PipelineRegistered)
        batch = InputBatch.of("data", [sample(i) for i in range(2)])
        batch_id = welcome.batch_id_base + 1
        assert isinstance(
            peer.request(SubmitBatch(registered.pipeline_id, (batch,), batch_id)), BatchAccepted
        )
        assert peer.sock.poll(10000)
        ready = transport.recv(peer.sock).message
        ids = tuple(output.region_id for output in ready.outputs)  # type: ignore[attr-defined]
        assert peer.notify(ReleaseRegions(ids), wait_ms=300) is None  # accepted: no answer
        again = peer.notify(ReleaseRegions(ids))
        assert again is not None and again.code is ErrorCode.UNKNOWN_REGION  # type: ignore[attr-defined]
        assert isinstance(peer.request(Goodbye()), Ok)
    finally:
        peer.close()
        context.term()


def test_a_peer_reusing_another_batchs_id_is_refused_and_nothing_else_breaks(
    daemon: DaemonProcess,
) -> None:
    context: zmq.Context[Any] = zmq.Context()
    with dalid.connect(socket=daemon.socket, autostart=False) as session:
        proxy = session.proxy(two_output_pipeline())
        target = proxy.target
        refs = [proxy(sample(i)) for i in range(2)]
        batch_ref = torch.utils.data.default_collate(refs)
        taken = batch_ref[0].pipe_run_ref.batch_id
        assert taken is not None
        # A peer of the same job (it has the token) names the batch the worker sent, then its
        # own ids out of order.
        peer = RawPeer(context, daemon.socket)
        try:
            welcome = peer.request(
                Hello(
                    PROTOCOL_VERSION,
                    os.getpid(),
                    Role.WORKER,
                    job_id=target.job_id,
                    job_token=target.job_token,
                )
            )
            assert isinstance(welcome, Welcome)
            inputs = (InputBatch.of("data", [sample(i) for i in range(2)]),)
            own = welcome.batch_id_base + 5
            for batch_id, answer in [
                (taken, "is not this connection's"),
                (own, None),
                (own, "was taken already"),
                (own - 1, "was taken already"),
            ]:
                reply = peer.request(SubmitBatch(target.pipeline_id, inputs, batch_id))
                if answer is None:
                    assert isinstance(reply, BatchAccepted), reply
                else:
                    assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_BATCH
                    assert answer in reply.message
        finally:
            peer.close()
        # The worker's batch is untouched: its own outputs, once.
        scaled, shifted = session.produce_data(batch_ref)
        (expected,) = run_in_process(two_output_pipeline(), [{"data": [sample(0), sample(1)]}])
        np.testing.assert_array_equal(scaled.numpy(), expected[0])
        np.testing.assert_array_equal(shifted.numpy(), expected[1])
        check_outputs(session)
    context.term()


# --- fuzzing ---------------------------------------------------------------------------------

# Not shutdown: a well-formed one (it has no fields, so any empty body makes one) stops the
# daemon, as it should for any client of the socket, which only the daemon's user can open.
_OPS = [cls.OP for cls in MESSAGE_TYPES if cls is not Shutdown]
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.sampled_from([0, 1, 2, 3, 4, 2**31, 2**40, -1])
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.sampled_from(["trainer", "worker", "int32", "uint8", "float64", *ErrorCode])
)
_values = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=16,
)


def _valid_messages(serialized: bytes, pipeline_id: int) -> list[Message]:
    samples = [sample(i) for i in range(2)]
    return [
        trainer_hello("fuzz"),
        Ping(),
        Goodbye(),
        RegisterPipeline(memoryview(serialized), ("data",), 2, BATCH, 1, 1),
        SubmitBatch(pipeline_id, (InputBatch.of("data", samples),), 1 << 32),
        SubmitBatch(pipeline_id, (InputBatch.of("data", samples[:1]),), 2, deferred=True),
        ScheduleBatch(1),
        ReleaseRegions((1, 2, 3)),
        ReleaseRegions((1, 1)),
    ]


def _mutate(data: st.DataObject, frames: list[bytes]) -> list[bytes]:
    how = data.draw(st.sampled_from(["field", "flip", "truncate", "frames", "version", "op"]))
    header = msgpack.unpackb(frames[0], raw=False)
    if how == "field" and header["body"]:
        name = data.draw(st.sampled_from(sorted(header["body"])))
        header["body"][name] = data.draw(_values)
    elif how == "version":
        header["v"] = data.draw(
            st.sampled_from([0, 1, 2, PROTOCOL_VERSION + 1, None, "3", 2**64 - 1])
        )
    elif how == "op":
        header["op"] = data.draw(st.sampled_from([*_OPS, "teleport", ""]) | st.text(max_size=8))
    elif how == "flip":
        raw = bytearray(frames[0])
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        return [bytes(raw), *frames[1:]]
    elif how == "truncate":
        return [frames[0][: data.draw(st.integers(0, len(frames[0]) - 1))], *frames[1:]]
    else:
        extra = data.draw(st.lists(st.binary(max_size=24), max_size=3))
        return [frames[0], *extra] if data.draw(st.booleans()) else [frames[0], *frames[1:], *extra]
    return [msgpack.packb(header, use_bin_type=True, strict_types=False), *frames[1:]]


def test_fuzzing_the_running_daemon_leaves_it_serving() -> None:
    directory = own_directory()
    daemon = start_daemon(directory)
    context: zmq.Context[Any] = zmq.Context()
    trainer = RawPeer(context, daemon.socket)
    replies = {"answered": 0, "silent": 0}
    try:
        trainer.request(trainer_hello("fuzz"))
        serialized = two_output_pipeline().serialize()
        registered = trainer.request(
            RegisterPipeline(memoryview(serialized), ("data",), 2, BATCH, 1, 1)
        )
        assert isinstance(registered, PipelineRegistered)
        valid = [
            [bytes(frame) for frame in encode(message, 7)]
            for message in _valid_messages(serialized, registered.pipeline_id)
        ]

        @settings(
            max_examples=150,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(data=st.data())
        def fuzz(data: st.DataObject) -> None:
            kind = data.draw(st.sampled_from(["random", "header", "mutated", "mutated"]))
            if kind == "random":
                frames = data.draw(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
            elif kind == "header":
                header = {
                    "v": data.draw(st.sampled_from([PROTOCOL_VERSION, 2, 99])),
                    "op": data.draw(st.sampled_from([*_OPS, "teleport"])),
                    "rid": data.draw(st.none() | st.integers(-5, 2**64 - 1)),
                    "body": data.draw(st.dictionaries(st.text(max_size=10), _values, max_size=5)),
                }
                frames = [msgpack.packb(header, use_bin_type=True)]
                frames += data.draw(st.lists(st.binary(max_size=32), max_size=3))
            else:
                frames = _mutate(data, data.draw(st.sampled_from(valid)))
            # The welcomed trainer (with a pipeline) or a connection the daemon never saw.
            if data.draw(st.booleans()):
                trainer.send_frames(frames)
                answered = trainer.drain(100)
            else:
                stranger = RawPeer(context, daemon.socket)
                try:
                    stranger.send_frames(frames)
                    answered = stranger.drain(100)
                finally:
                    stranger.close()
            replies["answered" if answered else "silent"] += 1
            assert daemon.process.poll() is None, daemon.log_text()

        fuzz()
        trainer.notify(Goodbye(), wait_ms=500)
        trainer.drain(200)
        assert daemon.process.poll() is None, daemon.log_text()
        pinger = RawPeer(context, daemon.socket)
        try:
            assert isinstance(pinger.request(Ping()), Pong)
        finally:
            pinger.close()
        with dalid.connect(socket=daemon.socket, autostart=False) as session:
            check_outputs(session)
        wait_for(lambda: not daemon.segments(), 10, "the daemon to free every job's segments")
    finally:
        trainer.close()
        context.term()
        code = daemon.stop()
        log = daemon.log_text()
        shutil.rmtree(directory, ignore_errors=True)
    assert code == 0, log
    assert not daemon.segments()
    # Most of the traffic got an answer; the rest was dropped with a line in the log.
    assert replies["answered"] > replies["silent"], replies
    assert "malformed message from" in log
    # Every bad message was refused on purpose, none by an exception the daemon did not expect.
    assert "internal error" not in log, log[-4000:]


def test_one_deeply_nested_message_is_refused_and_the_daemon_serves_on() -> None:
    # No hello needed: a stranger's register_named_pipeline whose parameters are 100,000
    # nested '[' (Python's JSON parser gives up with a RecursionError), and a header of 100,000
    # nested msgpack arrays. Each is refused as malformed; the daemon, its pid and the job
    # beside it carry on.
    directory = own_directory()
    daemon = start_daemon(directory)
    context: zmq.Context[Any] = zmq.Context()
    try:
        pid = daemon.daemon_pid()
        with dalid.connect(socket=daemon.socket, autostart=False, name="beside") as session:
            check_outputs(session)
            deep_json = encode(RegisterNamedPipeline(name="train"), 1)
            header = msgpack.unpackb(deep_json[0], raw=False)
            header["body"]["parameters"] = "[" * 100_000
            deep_msgpack = msgpack.packb(header, use_bin_type=True).replace(
                msgpack.packb("[" * 100_000), b"\x91" * 100_000 + b"\x00"
            )
            for frames in ([msgpack.packb(header, use_bin_type=True)], [deep_msgpack]):
                for _ in range(3):
                    stranger = RawPeer(context, daemon.socket)
                    try:
                        stranger.send_frames(frames)
                        assert stranger.sock.poll(10_000), "no answer to a nested message"
                        answer = transport.recv(stranger.sock).message
                        assert isinstance(answer, Error), answer
                        assert answer.code is ErrorCode.MALFORMED_MESSAGE, answer
                    finally:
                        stranger.close()
            assert daemon.process.poll() is None, daemon.log_text()
            assert daemon.daemon_pid() == pid
            check_outputs(session)
    finally:
        context.term()
        code = daemon.stop()
        log = daemon.log_text()
        shutil.rmtree(directory, ignore_errors=True)
    assert code == 0, log
    assert "parameters nest too deeply" in log, log[-4000:]
    assert "internal error" not in log, log[-4000:]
