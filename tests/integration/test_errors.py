"""Clear errors: in the caller before anything is sent, and from the daemon as data."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from nvidia.dali import fn
from nvidia.dali.data_node import DataNode

import dalid.client as dalid
from dalid.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Ping,
    Pong,
    decode,
    encode,
    endpoint,
    transport,
)

from ..daemons import DaemonProcess, wait_for
from ..dali_typing import pipeline_def
from .helpers import BATCH, ProxyDataset, sample, two_input_pipeline, two_output_pipeline


@pytest.fixture(scope="module")
def session(daemon: DaemonProcess) -> Iterator[dalid.Session]:
    with dalid.connect(socket=daemon.socket, autostart=False) as session:
        yield session


def test_not_a_pipeline(session: dalid.Session) -> None:
    with pytest.raises(dalid.InputError, match="expected an NVIDIA DALI pipeline"):
        session.proxy(lambda x: x)


def test_pipeline_without_external_source(session: dalid.Session) -> None:
    @pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def constant() -> DataNode:
        return fn.random.uniform(range=(0, 1), shape=[2])

    with pytest.raises(dalid.InputError, match="no external_source"):
        session.proxy(constant())


def test_a_reader_in_place_of_an_external_source_is_told_what_to_write_instead(
    session: dalid.Session, tmp_path: Path
) -> None:
    @pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def reads_files() -> tuple[DataNode, DataNode]:
        jpegs, labels = fn.readers.file(file_root=str(tmp_path))
        return fn.decoders.image(jpegs), labels

    with pytest.raises(dalid.InputError) as raised:
        session.proxy(reads_files())
    message = str(raised.value)
    assert "the pipeline has no external_source" in message
    assert "the daemon refuses fn.readers.file" in message
    assert 'fn.io.file.read(fn.external_source(name="paths"' in message


def test_a_reader_beside_an_external_source_is_refused_by_the_daemon(
    session: dalid.Session, tmp_path: Path
) -> None:
    # What docs/migration.md says of readers: the daemon refuses them, naming the operator.
    (tmp_path / "class0").mkdir()
    (tmp_path / "class0" / "a.jpg").write_bytes(b"not read")

    @pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def reads_files_too() -> tuple[DataNode, DataNode]:
        jpegs, _ = fn.readers.file(file_root=str(tmp_path))
        return fn.external_source(name="data"), jpegs

    with pytest.raises(dalid.PipelineError, match="operator 'readers__File' is refused: reads"):
        session.proxy(reads_files_too())


def test_misnamed_and_missing_inputs(session: dalid.Session) -> None:
    one = session.proxy(two_output_pipeline())
    with pytest.raises(dalid.InputError, match=r"no input named 'images'.* are 'data'"):
        one(images=sample(0))
    two = session.proxy(two_input_pipeline())
    with pytest.raises(dalid.InputError, match=r"by keyword only .*proxy\(a=\.\.\., b=\.\.\.\)"):
        two(sample(0), sample(1))
    with pytest.raises(dalid.InputError, match="missing a required argument: 'b'"):
        two(a=sample(0))


def test_no_daemon_listening_names_socket_and_command(short_tmp: Path) -> None:
    missing = short_tmp / "nobody.sock"
    with pytest.raises(dalid.DaemonUnavailable) as raised:
        dalid.connect(socket=missing, autostart=False)
    message = str(raised.value)
    assert str(missing) in message and "dalid serve" in message


def test_gpu_pipeline_on_cpu_daemon(session: dalid.Session) -> None:
    @pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def mixed_decode() -> DataNode:
        return fn.decoders.image(fn.external_source(name="jpegs"), device="mixed")

    with pytest.raises(dalid.PipelineError, match="dalid serve --device N") as raised:
        session.proxy(mixed_decode())
    assert raised.value.code is ErrorCode.DEVICE_MISMATCH


def test_a_gpu_pipeline_is_registered_without_cuda_in_the_trainer(session: dalid.Session) -> None:
    # DALI's Pipeline.serialize() would build the pipeline for GPU 0 here first, and fail on a
    # machine without CUDA: registration must reach the daemon, which says what is wrong.
    @pipeline_def(batch_size=2, num_threads=1, device_id=0)
    def mixed_decode() -> DataNode:
        return fn.decoders.image(fn.external_source(name="jpegs"), device="mixed")

    pipeline = mixed_decode()
    with pytest.raises(dalid.PipelineError, match="dalid serve --device N") as raised:
        session.proxy(pipeline)
    assert raised.value.code is ErrorCode.DEVICE_MISMATCH
    assert not pipeline._backend_prepared  # the trainer's object holds no backend for the GPU


def test_batch_error_names_batch_and_pipeline_recovers(
    daemon: DaemonProcess, session: dalid.Session
) -> None:
    @pipeline_def(batch_size=4, num_threads=1, device_id=None)
    def identity() -> DataNode:
        return fn.external_source(name="x") * 1

    # A pipeline of its own (one DALI instance): an instance's external_source refuses a change
    # of dimensionality, and on a shared pipeline's second instance (dali-instances.md) the
    # batch could run where no 2-D batch ran yet.
    proxy = session.proxy(identity(), share_runs=False)

    def batch_of(shape: tuple[int, ...]) -> Any:
        refs = [proxy(np.zeros(shape, np.int32)) for _ in range(2)]
        return torch_collate(refs)

    assert session.produce_data(batch_of((2, 3))).shape == (2, 2, 3)
    # external_source refuses a change of dimensionality: the pipeline object dies.
    with pytest.raises(
        dalid.BatchError, match=r"(?s)pipeline \d+ batch \d+ failed: .*[Dd]imensions of the data"
    ) as raised:
        session.produce_data(batch_of((2,)))
    assert raised.value.code is ErrorCode.PIPELINE_ERROR
    assert isinstance(raised.value, RuntimeError)  # as DALI's proxy raises it
    # The daemon's log names the batch as the trainer's error does.
    named = (
        f"job {session.job_id} pipeline {raised.value.pipeline_id} batch {raised.value.batch_id}"
    )
    wait_for(lambda: f"{named} failed" in daemon.log_text(), 10.0, f"{named!r} in the log")
    # The daemon rebuilt the pipeline: the next batch runs.
    assert session.produce_data(batch_of((2, 3))).shape == (2, 2, 3)


def torch_collate(refs: list[Any]) -> Any:
    import torch

    return torch.utils.data.default_collate(refs)


def test_refs_of_another_session_are_refused(daemon: DaemonProcess, session: dalid.Session) -> None:
    proxy = session.proxy(two_output_pipeline())
    batch = torch_collate([proxy(sample(0))])
    with (
        dalid.connect(socket=daemon.socket, autostart=False) as other,
        pytest.raises(dalid.InputError, match="belongs to job"),
    ):
        other.produce_data(batch)
    session.produce_data(batch)


def test_non_uniform_outputs_fail_with_a_clear_error(session: dalid.Session) -> None:
    @pipeline_def(batch_size=4, num_threads=1, device_id=None)
    def identity() -> DataNode:
        return fn.external_source(name="x") + 0

    proxy = session.proxy(identity())
    refs = [proxy(np.zeros((n, 3), np.int32)) for n in (2, 3)]
    with pytest.raises(dalid.BatchError, match="different shapes") as raised:
        session.produce_data(torch_collate(refs))
    assert raised.value.code is ErrorCode.INVALID_OUTPUT


def _raw_request(socket: Path, frames: Sequence[Any], timeout_ms: int = 5000) -> list[bytes]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = transport.make_socket(context, zmq.DEALER, endpoint(socket), bind=False)
    try:
        sock.send_multipart(frames)
        assert sock.poll(timeout_ms), "no reply"
        return sock.recv_multipart()
    finally:
        sock.close(linger=0)
        context.term()


def _error_of(reply: list[bytes]) -> dict[str, Any]:
    header: dict[str, Any] = msgpack.unpackb(reply[0])
    assert header["op"] == "error", header
    return header


def _header(op: str, rid: int, body: object) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "rid": rid, "body": body})


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b"\xc1garbage"], "malformed_message"),
        ([_header("teleport", 3, {})], "unknown_operation"),
        ([_header("submit_batch", 4, {"pipeline_id": "x"})], "malformed_message"),
        ([_header("submit_batch", 5, {"pipeline_id": 1, "inputs": []})], "malformed_message"),
        ([_header("schedule_batch", 6, {"batch_id": 1})], "not_welcomed"),
        ([_header("ping", 7, ["not", "a", "map"])], "malformed_message"),
    ],
)
def test_malformed_messages_get_error_replies(
    daemon: DaemonProcess, frames: list[bytes], code: str
) -> None:
    header = _error_of(_raw_request(daemon.socket, frames))
    assert header["body"]["code"] == code
    # The daemon is still there and answers.
    reply = _raw_request(daemon.socket, encode(Ping(), 9))
    assert isinstance(decode(reply).message, Pong)


def test_other_protocol_version_is_refused_naming_both(daemon: DaemonProcess) -> None:
    frames = [msgpack.packb({"v": 99, "op": "hello", "rid": 1, "body": {}})]
    header = _error_of(_raw_request(daemon.socket, frames))
    body = header["body"]
    assert body["code"] == "protocol_mismatch"
    assert "99" in body["message"] and str(PROTOCOL_VERSION) in body["message"]
    assert header["rid"] == 1


def test_client_raises_protocol_mismatch_from_another_daemon(short_tmp: Path) -> None:
    """A stand-in daemon of a future version answers every hello with its own version."""
    path = short_tmp / "future.sock"
    context = zmq.Context()
    router = transport.make_socket(context, zmq.ROUTER, endpoint(path), bind=True)
    import threading

    def answer_once() -> None:
        if router.poll(10000):
            identity, header, *_ = router.recv_multipart()
            rid = msgpack.unpackb(header)["rid"]
            reply = {"v": PROTOCOL_VERSION + 1, "op": "welcome", "rid": rid, "body": {}}
            router.send_multipart([identity, msgpack.packb(reply)])

    thread = threading.Thread(target=answer_once)
    thread.start()
    try:
        with pytest.raises(dalid.ProtocolMismatch, match=rf"version {PROTOCOL_VERSION + 1}\b"):
            dalid.connect(socket=path, autostart=False)
    finally:
        thread.join()
        router.close(linger=0)
        context.term()


def test_batch_larger_than_pipeline_max_is_refused_in_the_caller(session: dalid.Session) -> None:
    proxy = session.proxy(two_output_pipeline())
    held = [proxy(sample(index)) for index in range(BATCH)]  # as a DataLoader holds them
    with pytest.raises(dalid.InputError, match="max_batch_size"):
        proxy(sample(BATCH))
    assert len(held) == BATCH


def test_dataset_returning_str_gets_a_hint(session: dalid.Session) -> None:
    proxy = session.proxy(two_output_pipeline())
    loader = dalid.DataLoader(session, ProxyDataset(proxy, 2), batch_size=2)
    loader.dataset.__class__ = _StrDataset
    with pytest.raises(dalid.InputError, match=r"np\.frombuffer"):
        next(iter(loader))


class _StrDataset(ProxyDataset):
    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.proxy("/some/path.jpg"), index
