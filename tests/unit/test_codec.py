"""The codec: every message round-trips, and every malformed input is a ProtocolError."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dalid.protocol import (
    PROTOCOL_VERSION,
    BadSample,
    BatchAccepted,
    BatchFailed,
    BatchReady,
    CheckpointPipeline,
    EarlierJob,
    EarlierPipeline,
    Envelope,
    Error,
    ErrorCode,
    Goodbye,
    Hello,
    InputBatch,
    IpcProbeResult,
    JobStatus,
    Limits,
    LoaderWorkers,
    Message,
    Ok,
    OnError,
    OutputDescriptor,
    OutputPath,
    Ping,
    PipelineCheckpoint,
    PipelineRegistered,
    Pong,
    ProtocolError,
    RegisterNamedPipeline,
    RegisterPipeline,
    ReleaseRegions,
    ReloadRepository,
    RepositoryFailure,
    RepositoryReport,
    RestorePipeline,
    Role,
    ScheduleBatch,
    Shutdown,
    StatusReport,
    StatusRequest,
    SubmitBatch,
    TrainerProgress,
    WantBatch,
    Welcome,
    WorkerLeft,
    codec,
    decode,
    encode,
    transport,
)
from dalid.protocol.codec import MAX_FRAMES, MAX_HEADER_BYTES
from dalid.protocol.messages import MESSAGE_TYPES

# --- Representative messages --------------------------------------------------------------------


def _submit_batch() -> SubmitBatch:
    images = [np.arange(6, dtype=np.float32).reshape(2, 3) + i for i in range(3)]
    paths = [np.frombuffer(text, np.uint8) for text in (b"abc", b"", b"hello")]
    return SubmitBatch(
        pipeline_id=4,
        inputs=(InputBatch.of("images", images), InputBatch.of("paths", paths)),
        # A worker's id: its connection's range (a multiple of 2**32) plus its counter.
        batch_id=(3 << 32) + 5,
        deferred=True,
    )


# CUDA IPC handles are 64 opaque bytes; zeros included, since a handle may hold them.
GPU_HANDLE = bytes(range(64)).hex()
GPU_EVENT = (b"\x00" * 8 + bytes(range(200, 256))).hex()


def _examples() -> list[tuple[Message, int | None]]:
    """Instances of every message type (several for some), each with a request id or None."""
    return [
        (Hello(PROTOCOL_VERSION, 1234, Role.TRAINER), 1),
        (
            Hello(
                protocol_version=PROTOCOL_VERSION,
                client_pid=99,
                role=Role.WORKER,
                pid_namespace=4026531836,
                name="worker 99",
                job_id=7,
                job_token="0123abcd",
            ),
            2,
        ),
        (
            Hello(
                PROTOCOL_VERSION,
                1234,
                Role.TRAINER,
                earlier_jobs=(EarlierJob(1, "0123abcd"), EarlierJob(1, "4567cdef")),
            ),
            3,
        ),
        (
            Welcome(
                protocol_version=PROTOCOL_VERSION,
                daemon_pid=42,
                device="gpu0",
                dali_version="2.4.0",
                job_id=7,
                job_token="0123abcd",
                limits=Limits(
                    max_batch_size=4096,
                    max_message_bytes=1 << 31,
                    pool_bytes=2 << 30,
                    slab_bytes=64 << 20,
                ),
            ),
            2,
        ),
        (
            Welcome(
                protocol_version=PROTOCOL_VERSION,
                daemon_pid=42,
                device="gpu1",
                dali_version="2.4.0",
                job_id=8,
                job_token="4567cdef",
                limits=Limits(4096, 1 << 31, 2 << 30, 64 << 20),
                device_uuid="GPU-00010203-0405-0607-0809-0a0b0c0d0e0f",
                ipc_probe=GPU_HANDLE,
            ),
            3,
        ),
        (IpcProbeResult(opened=True), 4),
        (IpcProbeResult(opened=False, reason="cudaIpcOpenMemHandle: operation not supported"), 4),
        (OutputPath("cuda_ipc"), 4),
        (OutputPath("staged", reason="the trainer cannot see the daemon's GPU"), 4),
        (
            Welcome(
                protocol_version=PROTOCOL_VERSION,
                daemon_pid=43,
                device="cpu",
                dali_version="2.4.0",
                job_id=9,
                job_token="89ab",
                limits=Limits(4096, 1 << 31, 2 << 30, 64 << 20, max_image_pixels=89_478_485),
                want_in_release=True,
            ),
            3,
        ),
        (Goodbye(), 3),
        (Goodbye(kept_slabs=("dalid-1-abc-j1-cuda-2",)), 4),
        (Ping(), 2**63 - 1),
        (Pong(daemon_pid=42), 0),
        (Shutdown(), None),
        (Ok(), 5),
        (
            RegisterPipeline(
                serialized=memoryview(b"\x00serialized pipeline\xff" * 10),
                input_names=("images", "labels"),
                num_outputs=2,
                max_batch_size=64,
                num_threads=4,
                prefetch_queue_depth=2,
                seed=1234,
                exec_dynamic=False,
                name="train",
                on_error=OnError.SKIP,
                earlier_ids=(EarlierPipeline("0123abcd", 2),),
            ),
            6,
        ),
        (
            RegisterPipeline(
                serialized=np.frombuffer(b"raw pipeline bytes", dtype=np.uint8).data,
                input_names=("x",),
                num_outputs=1,
                max_batch_size=1,
                num_threads=1,
                prefetch_queue_depth=1,
            ),
            7,
        ),
        (PipelineRegistered(pipeline_id=3), 6),
        (
            PipelineRegistered(
                pipeline_id=4, input_names=("images", "angles"), num_outputs=2, max_batch_size=32
            ),
            6,
        ),
        (RegisterNamedPipeline(name="train"), 10),
        (
            RegisterNamedPipeline(
                name="train",
                earlier_ids=(EarlierPipeline("0123abcd", 1), EarlierPipeline("4567cdef", 3)),
            ),
            12,
        ),
        (
            RegisterNamedPipeline(
                name="resnet_train",
                parameters='{"crop": 224, "mean": [0.5, 0.5, 0.5]}',
                batch_size=64,
                num_threads=4,
                prefetch_queue_depth=2,
                seed=7,
            ),
            11,
        ),
        (_submit_batch(), 8),
        (BatchAccepted(batch_id=11), 8),
        (ScheduleBatch(batch_id=11), 9),
        (CheckpointPipeline(pipeline_id=3), 9),
        (PipelineCheckpoint(pipeline_id=3, checkpoint=memoryview(b"state"), runs=2), 9),
        (PipelineCheckpoint(3, memoryview(b""), 0, "not made with enable_checkpointing"), 9),
        (RestorePipeline(pipeline_id=3, checkpoint=memoryview(b"state")), 9),
        (WantBatch(batch_id=11), None),
        (WorkerLeft(first_batch_id=1 << 32, end_batch_id=2 << 32), None),
        (
            BatchReady(
                batch_id=11,
                pipeline_id=3,
                outputs=(
                    OutputDescriptor(
                        region_id=1,
                        slab="dalid-1-abc-j1-1",
                        slab_size=1 << 20,
                        offset=0,
                        nbytes=4 * 3 * 2 * 3,
                        dtype="float32",
                        shape=(3, 2, 3),
                        layout="HWC",
                    ),
                    OutputDescriptor(
                        region_id=2,
                        slab="dalid-1-abc-j1-1",
                        slab_size=1 << 20,
                        offset=256,
                        nbytes=0,
                        dtype="int64",
                        shape=(0,),
                        device="cpu",
                    ),
                ),
            ),
            None,
        ),
        (
            BatchReady(
                batch_id=12,
                pipeline_id=3,
                outputs=(
                    OutputDescriptor(
                        region_id=3,
                        slab="dalid-1-abc-j1-cuda-1",
                        slab_size=1 << 26,
                        offset=512,
                        nbytes=2 * 3 * 4 * 2,
                        dtype="float16",
                        shape=(2, 3, 4),
                        layout="CHW",
                        device="cuda",
                        strides=(24, 8, 2),
                        ipc_handle=GPU_HANDLE,
                    ),
                    OutputDescriptor(
                        region_id=4,
                        slab="dalid-1-abc-j1-2",
                        slab_size=1 << 20,
                        offset=0,
                        nbytes=8,
                        dtype="int32",
                        shape=(2,),
                    ),
                ),
                retired_slabs=("dalid-1-abc-j1-cuda-0",),
                event=GPU_EVENT,
            ),
            None,
        ),
        (
            BatchReady(
                batch_id=14,
                pipeline_id=3,
                outputs=(
                    OutputDescriptor(
                        region_id=6,
                        slab="dalid-1-abc-j1-staged-1",
                        slab_size=1 << 20,
                        offset=0,
                        nbytes=2 * 3 * 4 * 2,
                        dtype="float16",
                        shape=(2, 3, 4),
                        layout="CHW",
                        device="staged",
                    ),
                ),
            ),
            None,
        ),
        (BatchFailed(11, 3, ErrorCode.PIPELINE_ERROR, "DALI said no"), None),
        (
            BatchFailed(
                12,
                3,
                ErrorCode.BAD_SAMPLES,
                "2 bad samples",
                (BadSample(0, "nvImageCodec failure: '#4'"), BadSample(5, "too large")),
            ),
            None,
        ),
        (
            BatchReady(
                batch_id=13,
                pipeline_id=3,
                outputs=(
                    OutputDescriptor(
                        region_id=5,
                        slab="dalid-1-abc-j1-1",
                        slab_size=1 << 20,
                        offset=0,
                        nbytes=8,
                        dtype="int32",
                        shape=(2,),
                    ),
                ),
                bad_samples=(BadSample(1, "corrupt", replaced_by=0),),
            ),
            None,
        ),
        (ReleaseRegions(region_ids=(1, 2, 3)), None),
        (ReleaseRegions(), None),
        (ReleaseRegions(region_ids=(3,), event=GPU_EVENT), None),
        (ReleaseRegions(closed_slabs=("dalid-1-abc-j1-cuda-0",)), None),
        (ReleaseRegions(region_ids=(4, 5), want_batch=(1 << 40) + 3), None),
        (
            Error(
                ErrorCode.INVALID_BATCH,
                "bad batch",
                traceback="Traceback (most recent call last):\n  ...",
                op="submit_batch",
            ),
            8,
        ),
        (Error(ErrorCode.NOT_WELCOMED, "send hello first"), None),
        (
            Hello(
                PROTOCOL_VERSION,
                77,
                Role.TRAINER,
                weight=2.5,
                memory_bytes=512 << 20,
                max_inflight_batches=4,
            ),
            9,
        ),
        (TrainerProgress(waited_seconds=1.25, batches_received=40), None),
        (LoaderWorkers(workers=2), 11),
        (StatusRequest(), 10),
        (
            StatusReport(
                daemon_pid=42,
                device="cpu",
                device_uuid="",
                dali_version="2.4.0",
                protocol_version=PROTOCOL_VERSION,
                uptime_seconds=12.5,
                max_jobs=64,
                concurrency=4,
                memory_limit=8 << 30,
                memory_reserved=2 << 30,
                jobs=(
                    JobStatus(
                        job_id=1,
                        name="resnet",
                        pid=1234,
                        weight=1.0,
                        workers=4,
                        pipelines=1,
                        batches_done=100,
                        samples_done=3200,
                        batches_failed=1,
                        batches_per_second=9.5,
                        samples_per_second=304.0,
                        queued=2,
                        running=2,
                        waiting=1,
                        deferred=0,
                        max_inflight_batches=16,
                        slot_wait_seconds=0.5,
                        passed_over=3,
                        run_seconds=4.5,
                        trainer_wait_seconds=2.0,
                        regions_held=6,
                        bytes_held=6 << 20,
                        slabs=1,
                        memory_bytes=1 << 30,
                        connected_seconds=11.0,
                    ),
                ),
            ),
            10,
        ),
        (ReloadRepository(), 11),
        (
            RepositoryReport(
                directory="/etc/dalid/pipelines",
                pipelines=("resnet_train", "resnet_val"),
                failures=(
                    RepositoryFailure(
                        "augment.py",
                        "SyntaxError: invalid syntax (augment.py, line 3)",
                        kept_pipelines=("augmented",),
                    ),
                    RepositoryFailure("new.py", "ImportError: No module named 'timm'"),
                ),
            ),
            11,
        ),
    ]


EXAMPLES = _examples()


def _first(cls: type[Message]) -> Message:
    """The first example of ``cls``."""
    return next(message for message, _ in EXAMPLES if type(message) is cls)


def _plain(value: Any) -> Any:
    """A comparable form of a message: buffers become bytes, dataclasses (type, fields)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (
            type(value),
            {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)},
        )
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, np.ndarray):
        return value.tobytes()
    if isinstance(value, memoryview | bytes | bytearray):
        return memoryview(value).tobytes()
    if isinstance(value, enum.Enum):
        return (type(value), value.value)
    if isinstance(value, float) and math.isnan(value):
        return "nan"  # a NaN equals no NaN, itself included
    return value


def _wire(frames: list[Any]) -> list[bytes]:
    """The frames as a ZeroMQ peer receives them: plain bytes."""
    return [memoryview(frame).tobytes() for frame in frames]


def _expect_error(
    frames: list[Any], code: ErrorCode = ErrorCode.MALFORMED_MESSAGE
) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        decode(frames)
    assert caught.value.code is code, caught.value.message
    return caught.value


def _header(**fields: Any) -> dict[str, Any]:
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": "ping", "rid": 1, "body": {}}
    header.update(fields)
    return header


def _pack(header: Any, *frames: bytes) -> list[bytes]:
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _encoded_header(
    message: Message, request_id: int | None = 1
) -> tuple[dict[str, Any], list[bytes]]:
    """The unpacked header of ``message`` and its raw frames, ready to be tampered with."""
    frames = _wire(encode(message, request_id))
    return msgpack.unpackb(frames[0], raw=False), frames[1:]


# --- Round trips --------------------------------------------------------------------------------


def test_examples_cover_every_message_type() -> None:
    assert {type(message) for message, _ in EXAMPLES} == set(MESSAGE_TYPES)
    assert len({cls.OP for cls in MESSAGE_TYPES}) == len(MESSAGE_TYPES)
    assert all(cls.OP for cls in MESSAGE_TYPES)


@pytest.mark.parametrize(
    ("message", "request_id"),
    EXAMPLES,
    ids=[f"{type(m).__name__}-{i}" for i, (m, _) in enumerate(EXAMPLES)],
)
def test_round_trip(message: Message, request_id: int | None) -> None:
    frames = encode(message, request_id)
    envelope = decode(_wire(frames))
    assert isinstance(envelope, Envelope)
    assert type(envelope.message) is type(message)
    assert envelope.request_id == request_id
    assert _plain(envelope.message) == _plain(message)
    # A decoded message re-encodes to the same frames.
    assert _wire(encode(envelope.message, envelope.request_id)) == _wire(frames)


@pytest.mark.parametrize(
    "kind", ["bytes", "memoryview", "zmq.Frame"], ids=["bytes", "memoryview", "zmq-frame"]
)
def test_decode_accepts_any_buffer_frames(kind: str) -> None:
    message = _submit_batch()
    frames: list[Any] = _wire(encode(message, 3))
    if kind == "memoryview":
        frames = [memoryview(frame) for frame in frames]
    elif kind == "zmq.Frame":
        frames = [zmq.Frame(frame) for frame in frames]
    envelope = decode(frames)
    assert _plain(envelope.message) == _plain(message)


def test_buffers_are_frames_without_copy() -> None:
    message = _submit_batch()
    frames = encode(message, 1)
    # Two frames per input, whatever its number of samples: its shapes and its samples' bytes.
    buffers = [buffer for batch in message.inputs for buffer in (batch.shapes, batch.data)]
    assert len(frames) == 1 + len(buffers)
    for frame, buffer in zip(frames[1:], buffers, strict=True):
        assert frame is buffer
    header = msgpack.unpackb(frames[0], raw=False)
    assert header["v"] == PROTOCOL_VERSION
    assert header["op"] == "submit_batch"
    assert header["rid"] == 1
    first, second = header["body"]["inputs"]
    assert (first["size"], first["ndim"], first["shapes"], first["data"]) == (3, 2, 1, 2)
    assert (second["size"], second["ndim"], second["shapes"], second["data"]) == (3, 1, 3, 4)


def test_decoded_values_have_their_annotated_types() -> None:
    worker = Hello(PROTOCOL_VERSION, 5, Role.WORKER, job_id=1, job_token="t")
    decoded = decode(_wire(encode(worker, 1))).message
    assert isinstance(decoded, Hello)
    assert decoded.role is Role.WORKER
    batch = decode(_wire(encode(_submit_batch(), 1))).message
    assert isinstance(batch, SubmitBatch)
    first, second = batch.inputs
    assert isinstance(first, InputBatch)
    assert isinstance(first.data, memoryview) and first.data.format == "B"
    assert first.extents().tolist() == [[2, 3]] * 3
    # Samples of one shape are one array, viewed in the frame.
    images = first.arrays()
    assert isinstance(images, np.ndarray) and images.shape == (3, 2, 3)
    np.testing.assert_array_equal(images[2], np.arange(6, dtype=np.float32).reshape(2, 3) + 2)
    paths = second.arrays()
    assert [bytes(path) for path in paths] == [b"abc", b"", b"hello"]
    assert second.sample_bytes().tolist() == [0, 3, 3, 8]
    failed = decode(_wire(encode(BatchFailed(1, 2, ErrorCode.PIPELINE_ERROR, "x")))).message
    assert isinstance(failed, BatchFailed)
    assert failed.code is ErrorCode.PIPELINE_ERROR


def test_optional_fields_decode_as_none() -> None:
    body = {"protocol_version": 1, "client_pid": 5, "role": "trainer", "job_id": None}
    hello = decode(_pack(_header(op="hello", body=body))).message
    assert hello == Hello(1, 5, Role.TRAINER)
    assert isinstance(hello, Hello)
    assert hello.job_id is None
    assert hello.job_token is None


def test_a_want_in_a_release_is_left_out_by_an_older_trainer_and_daemon() -> None:
    """An older trainer's release names no batch (it sends ``want_batch``); an older daemon's
    welcome does not say it reads one, so a trainer sends ``want_batch`` to it."""
    header, frames = _encoded_header(ReleaseRegions(region_ids=(1,), want_batch=7))
    del header["body"]["want_batch"]
    assert decode(_pack(header, *frames)).message == ReleaseRegions(region_ids=(1,))
    newer = _first(Welcome)
    assert isinstance(newer, Welcome)
    header, frames = _encoded_header(dataclasses.replace(newer, want_in_release=True))
    del header["body"]["want_in_release"]
    welcome = decode(_pack(header, *frames)).message
    assert isinstance(welcome, Welcome)
    assert welcome.want_in_release is False


def test_progress_in_a_release_is_left_out_by_an_older_trainer_and_daemon() -> None:
    """An older trainer's release carries no progress (it sends ``trainer_progress``); an older
    daemon's welcome does not say it reads one, so a trainer sends ``trainer_progress`` to it;
    and a bad figure in a release is refused as in a report of its own."""
    carried = ReleaseRegions(region_ids=(1,), progress=TrainerProgress(1.5, 3))
    assert decode(encode(carried)).message == carried
    header, frames = _encoded_header(carried)
    del header["body"]["progress"]
    assert decode(_pack(header, *frames)).message == ReleaseRegions(region_ids=(1,))
    newer = _first(Welcome)
    assert isinstance(newer, Welcome)
    header, frames = _encoded_header(dataclasses.replace(newer, progress_in_release=True))
    del header["body"]["progress_in_release"]
    welcome = decode(_pack(header, *frames)).message
    assert isinstance(welcome, Welcome)
    assert welcome.progress_in_release is False
    header, frames = _encoded_header(carried)
    header["body"]["progress"]["waited_seconds"] = float("nan")
    with pytest.raises(ProtocolError, match="waited_seconds must be a finite number"):
        decode(_pack(header, *frames))


# --- Malformed input ----------------------------------------------------------------------------


def test_empty_frame_list() -> None:
    _expect_error([])


def test_too_many_frames() -> None:
    frames = _pack(_header()) + [b""] * MAX_FRAMES
    _expect_error(frames)


@pytest.mark.parametrize(
    "raw",
    [b"", b"\xc1", b"\x92\x01", b"\x81\xa1v", msgpack.packb(_header()) + b"\x00", b"\xff" * 64],
    ids=["empty", "never-used-byte", "truncated-array", "truncated-map", "extra-data", "junk"],
)
def test_header_not_msgpack(raw: bytes) -> None:
    _expect_error([raw])


@pytest.mark.parametrize("header", [[1, 2], "ping", 5, None, b"bin"], ids=repr)
def test_header_not_a_map(header: Any) -> None:
    _expect_error(_pack(header))


def test_header_with_non_string_keys() -> None:
    _expect_error([msgpack.packb({1: 2, "op": "ping"})])


def test_oversized_header() -> None:
    _expect_error([b"\x80" + b"\x00" * MAX_HEADER_BYTES])
    huge = _header(op="error", body={"code": "internal_error", "message": "x" * MAX_HEADER_BYTES})
    _expect_error(_pack(huge))


def test_wrong_version() -> None:
    other = PROTOCOL_VERSION + 1
    error = _expect_error(_pack(_header(v=other, op="ping", rid=17)), ErrorCode.PROTOCOL_MISMATCH)
    assert f"version {other}" in error.message
    assert f"version {PROTOCOL_VERSION}" in error.message
    assert error.request_id == 17
    assert error.op == "ping"


def test_wrong_version_wins_over_unknown_op_and_bad_body() -> None:
    # A future peer may send ops and bodies this side does not know: the answer must still be
    # protocol_mismatch, addressed to the request.
    header = _header(v=PROTOCOL_VERSION + 1, op="future_op", rid=3, body=[1, 2])
    error = _expect_error(_pack(header), ErrorCode.PROTOCOL_MISMATCH)
    assert error.request_id == 3
    assert error.op == "future_op"


@pytest.mark.parametrize("version", [None, "1", 0, -1, [1]], ids=repr)
def test_unusable_versions_are_a_mismatch(version: Any) -> None:
    _expect_error(_pack(_header(v=version)), ErrorCode.PROTOCOL_MISMATCH)


@pytest.mark.parametrize("version", [True, float(PROTOCOL_VERSION)], ids=repr)
def test_version_must_be_an_int(version: Any) -> None:
    _expect_error(_pack(_header(v=version)), ErrorCode.PROTOCOL_MISMATCH)


def test_missing_op() -> None:
    header = _header(rid=21)
    del header["op"]
    error = _expect_error(_pack(header))
    assert error.request_id == 21


@pytest.mark.parametrize("op", [5, None, ["ping"], True], ids=repr)
def test_non_string_op(op: Any) -> None:
    error = _expect_error(_pack(_header(op=op, rid=22)))
    assert error.request_id == 22


def test_unknown_op() -> None:
    error = _expect_error(_pack(_header(op="frobnicate", rid=23)), ErrorCode.UNKNOWN_OPERATION)
    assert error.request_id == 23
    assert error.op == "frobnicate"
    assert "frobnicate" in error.message


@pytest.mark.parametrize("rid", ["7", 1.5, True, [1]], ids=repr)
def test_bad_request_id(rid: Any) -> None:
    _expect_error(_pack(_header(rid=rid)))


def test_missing_request_id_is_a_notification() -> None:
    header = _header()
    del header["rid"]
    assert decode(_pack(header)).request_id is None


@pytest.mark.parametrize("body", [None, [], "body", 3], ids=repr)
def test_body_not_a_map(body: Any) -> None:
    error = _expect_error(_pack(_header(op="ping", rid=24, body=body)))
    assert error.request_id == 24
    assert error.op == "ping"


def test_missing_body() -> None:
    header = _header()
    del header["body"]
    _expect_error(_pack(header))


def test_missing_field() -> None:
    error = _expect_error(_pack(_header(op="pong", rid=25, body={})))
    assert "daemon_pid" in error.message
    assert error.request_id == 25
    assert error.op == "pong"


def test_missing_nested_field() -> None:
    header, frames = _encoded_header(_first(Welcome))
    del header["body"]["limits"]["slab_bytes"]
    error = _expect_error(_pack(header, *frames))
    assert "slab_bytes" in error.message


def test_a_field_from_a_later_version_is_ignored() -> None:
    """Forward compatibility: a peer of a later release may add fields (SPEC.md, Versions)."""
    envelope = decode(_pack(_header(op="pong", body={"daemon_pid": 1, "colour": "red"})))
    assert envelope.message == Pong(1)


def test_a_nested_field_from_a_later_version_is_ignored() -> None:
    welcome = _first(Welcome)
    header, frames = _encoded_header(welcome)
    header["body"]["limits"]["extra"] = {"any": ["msgpack", 1, None]}
    header["body"]["future"] = 3
    assert decode(_pack(header, *frames)).message == welcome


def test_a_field_a_peer_of_an_earlier_version_leaves_out_takes_its_default() -> None:
    header, frames = _encoded_header(Hello(PROTOCOL_VERSION, 42, Role.TRAINER, name="job"))
    del header["body"]["earlier_jobs"]
    del header["body"]["weight"]
    hello = decode(_pack(header, *frames)).message
    assert hello == Hello(PROTOCOL_VERSION, 42, Role.TRAINER, name="job")


@pytest.mark.parametrize(
    ("op", "body"),
    [
        ("pong", {"daemon_pid": "42"}),  # str for int
        ("pong", {"daemon_pid": True}),  # bool for int
        ("pong", {"daemon_pid": 4.0}),  # float for int
        ("pong", {"daemon_pid": None}),  # nil for a non-optional int
        ("batch_accepted", {"batch_id": [1]}),
        ("error", {"code": "internal_error", "message": 5}),  # int for str
        ("error", {"code": "no_such_code", "message": "m"}),  # enum value out of range
        ("error", {"code": 3, "message": "m"}),
        ("hello", {"protocol_version": 1, "client_pid": 1, "role": "boss"}),
        ("hello", {"protocol_version": 1, "client_pid": 1, "role": "trainer", "job_id": "1"}),
        ("release_regions", {"region_ids": 5}),  # scalar for array
        ("release_regions", {"region_ids": [1, "2"]}),
        ("release_regions", {"region_ids": {"a": 1}}),
        ("release_regions", {"region_ids": [1], "want_batch": "7"}),
        (
            "welcome",
            {
                **dict.fromkeys(("protocol_version", "daemon_pid", "job_id"), 1),
                "device": "cpu",
                "dali_version": "x",
                "job_token": "t",
                "limits": [1, 2, 3, 4],
            },
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_wrong_field_types(op: str, body: dict[str, Any]) -> None:
    error = _expect_error(_pack(_header(op=op, rid=26, body=body)))
    assert error.request_id == 26
    assert error.op == op


@pytest.mark.parametrize("value", [1, 0, "yes", None], ids=repr)
def test_int_for_bool(value: Any) -> None:
    header, frames = _encoded_header(_submit_batch())
    header["body"]["deferred"] = value
    _expect_error(_pack(header, *frames))
    header, frames = _encoded_header(_first(RegisterPipeline))
    header["body"]["exec_dynamic"] = value
    _expect_error(_pack(header, *frames))


@pytest.mark.parametrize("index", [0, 2, -1, 99, True, "1", 1.0], ids=repr)
def test_frame_index_out_of_range(index: Any) -> None:
    header, frames = _encoded_header(_first(RegisterPipeline))
    assert header["body"]["serialized"] == 1
    header["body"]["serialized"] = index
    error = _expect_error(_pack(header, *frames))
    assert error.op == "register_pipeline"


def test_frame_referenced_twice() -> None:
    header, frames = _encoded_header(_submit_batch())
    header["body"]["inputs"][0]["data"] = 1  # its shapes' frame
    error = _expect_error(_pack(header, *frames))
    assert "twice" in error.message


def test_frames_only_a_later_version_references_are_dropped() -> None:
    assert decode(_pack(_header(op="ping", rid=27), b"stray")).message == Ping()
    message = _first(RegisterPipeline)
    header, frames = _encoded_header(message)
    header["body"]["future_blob"] = len(frames) + 1
    assert _plain(decode(_pack(header, *frames, b"one more")).message) == _plain(message)


def test_fewer_frames_than_referenced() -> None:
    header, frames = _encoded_header(_submit_batch())
    _expect_error(_pack(header, *frames[:-1]))


# --- Checks of the messages themselves (``__post_init__``), on both sides -----------------------


FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _shapes(*rows: Sequence[int]) -> bytes:
    """A shapes frame: little-endian uint64 extents, row after row."""
    return np.array(rows, "<u8").tobytes()


TWO_SHAPES = _shapes([2], [2])


def _input_batch_body(**fields: Any) -> dict[str, Any]:
    body = {"name": "x", "dtype": "uint8", "size": 2, "ndim": 1, "shapes": 1, "data": 2}
    body.update(fields)
    return body


def _submit_frames(*inputs: dict[str, Any], frames: Sequence[bytes] = ()) -> list[bytes]:
    body = {"pipeline_id": 1, "inputs": list(inputs)}
    return _pack(_header(op="submit_batch", rid=30, body=body), *frames)


def test_valid_hand_built_submit_batch() -> None:
    message = decode(_submit_frames(_input_batch_body(), frames=[TWO_SHAPES, b"abcd"])).message
    assert isinstance(message, SubmitBatch)
    assert message.batch_size == 2
    assert [bytes(sample) for sample in message.inputs[0].arrays()] == [b"ab", b"cd"]


@pytest.mark.parametrize(
    ("fields", "frames"),
    [
        ({"size": 3}, [TWO_SHAPES, b"abcd"]),
        ({"size": 1}, [TWO_SHAPES, b"abcd"]),
        ({"size": -1}, [b"", b""]),
        ({"size": 65537}, [_shapes(*[[0]] * 65537), b""]),
        ({"ndim": 2}, [TWO_SHAPES, b"abcd"]),
        ({"ndim": 0}, [TWO_SHAPES, b"abcd"]),
        ({"ndim": 17, "size": 1}, [_shapes([1] * 17), b"a"]),
        ({"ndim": -1}, [b"", b"abcd"]),
        ({}, [TWO_SHAPES[:-1], b"abcd"]),
        ({}, [TWO_SHAPES + b"\0", b"abcd"]),
        ({}, [TWO_SHAPES, b"abc"]),
        ({}, [TWO_SHAPES, b"abcde"]),
        ({}, [_shapes([2], [2**64 - 1]), b"abcd"]),
        ({}, [_shapes([2], [2**48 + 1]), b"abcd"]),
        ({"ndim": 16, "size": 1}, [_shapes([2**40] * 16), b"abcd"]),
        ({"ndim": 2}, [_shapes([2**32, 2**32], [1, 1]), b"abcd"]),
        ({"dtype": "float32"}, [_shapes([1], [1]), b"abcdefg"]),
        ({"dtype": "complex64"}, [TWO_SHAPES, b"abcd"]),
        ({"dtype": "object"}, [TWO_SHAPES, b"abcd"]),
        ({"dtype": "U8"}, [TWO_SHAPES, b"abcd"]),
        ({"name": ""}, [TWO_SHAPES, b"abcd"]),
        ({"name": "n" * 257}, [TWO_SHAPES, b"abcd"]),
        ({"shapes": 2, "data": 2}, [TWO_SHAPES, b"abcd"]),
        ({"data": 3}, [TWO_SHAPES, b"abcd"]),
        ({"shapes": [[2], [2]]}, [TWO_SHAPES, b"abcd"]),
        ({"size": True}, [TWO_SHAPES, b"abcd"]),
    ],
    ids=[
        "more-samples-than-shapes",
        "fewer-samples-than-shapes",
        "negative-size",
        "over-max-batch-size",
        "ndim-over-the-shapes",
        "ndim-0-with-shapes",
        "17-dims",
        "negative-ndim",
        "shapes-frame-cut",
        "shapes-frame-too-long",
        "data-too-short",
        "data-too-long",
        "extent-2**64-1",
        "extent-over-max",
        "product-overflows-64-bits",
        "product-over-the-data",
        "not-whole-items",
        "complex64",
        "object",
        "unicode",
        "empty-name",
        "long-name",
        "one-frame-twice",
        "no-such-frame",
        "shapes-as-a-list",
        "bool-size",
    ],
)
def test_input_batch_checks(fields: dict[str, Any], frames: list[bytes]) -> None:
    error = _expect_error(_submit_frames(_input_batch_body(**fields), frames=frames))
    assert error.request_id == 30
    assert error.op == "submit_batch"


def test_odd_shapes_that_hold_their_bytes_are_taken() -> None:
    """A sample with a zero extent holds no bytes, whatever its other extents; a 0-d sample one
    item."""
    empty = _input_batch_body(ndim=2)
    message = decode(_submit_frames(empty, frames=[_shapes([2**48, 0], [2, 1]), b"ab"])).message
    assert isinstance(message, SubmitBatch)
    samples = message.inputs[0].arrays()
    assert [sample.shape for sample in samples] == [(2**48, 0), (2, 1)]
    scalars = _input_batch_body(ndim=0, dtype="int16")
    message = decode(_submit_frames(scalars, frames=[b"", b"\x01\x00\x02\x00"])).message
    assert isinstance(message, SubmitBatch)
    assert np.asarray(message.inputs[0].arrays()).tolist() == [1, 2]


def test_input_batch_checks_run_on_the_sender() -> None:
    shapes = memoryview(TWO_SHAPES)
    with pytest.raises(ValueError, match="need 24 bytes"):
        InputBatch("x", "uint8", 3, 1, shapes, memoryview(b"abcd"))
    with pytest.raises(ValueError, match="unsupported dtype"):
        InputBatch("x", "complex64", 2, 1, shapes, memoryview(b"abcd"))
    with pytest.raises(ValueError, match="the frame has 3"):
        InputBatch("x", "uint8", 2, 1, shapes, memoryview(b"abc"))
    with pytest.raises(ValueError, match="ndim must be"):
        InputBatch("x", "uint8", 1, 17, memoryview(_shapes([1] * 17)), memoryview(b"a"))
    with pytest.raises(ValueError, match="one dtype and one number of dimensions"):
        InputBatch.of("x", [np.zeros(2, np.uint8), np.zeros((1, 2), np.uint8)])
    with pytest.raises(ValueError, match="one dtype"):
        InputBatch.of("x", [np.zeros(2, np.uint8), np.zeros(2, np.int8)])


_DTYPES = st.sampled_from(["uint8", "int16", "float32", "float64", "bool", "int64"])


@FUZZ
@given(
    dtype=_DTYPES,
    ndim=st.integers(min_value=0, max_value=3),
    data=st.data(),
)
def test_input_batches_round_trip_whatever_their_shapes(
    dtype: str, ndim: int, data: st.DataObject
) -> None:
    shape = st.tuples(*[st.integers(min_value=0, max_value=4)] * ndim)
    shapes = data.draw(st.lists(shape, min_size=1, max_size=12))
    rng = np.random.default_rng(len(shapes))
    samples = [(rng.random(s) * 100).astype(dtype) for s in shapes]
    message = SubmitBatch(1, (InputBatch.of("x", samples),))
    received = decode(_wire(encode(message, 2))).message
    assert isinstance(received, SubmitBatch)
    (batch,) = received.inputs
    assert batch.size == len(samples) and batch.ndim == ndim
    got = batch.arrays()
    assert len(got) == len(samples)
    for sample, view in zip(samples, got, strict=True):
        assert view.dtype == sample.dtype and view.shape == sample.shape
        np.testing.assert_array_equal(view, sample)


@FUZZ
@given(
    size=st.integers(min_value=0, max_value=6),
    ndim=st.integers(min_value=0, max_value=3),
    extents=st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=20),
    data=st.binary(max_size=64),
    dtype=_DTYPES,
)
def test_fuzz_input_batch_frames(
    size: int, ndim: int, extents: list[int], data: bytes, dtype: str
) -> None:
    """Any shapes and bytes: refused as ProtocolError, or views that tile the frame exactly."""
    body = _input_batch_body(size=size, ndim=ndim, dtype=dtype)
    frames = _submit_frames(body, frames=[np.array(extents, "<u8").tobytes(), data])
    try:
        message = decode(frames).message
    except ProtocolError as error:
        assert error.code is ErrorCode.MALFORMED_MESSAGE
        return
    assert isinstance(message, SubmitBatch)
    (batch,) = message.inputs
    bounds = batch.sample_bytes()
    assert bounds[0] == 0 and bounds[-1] == len(data) and (np.diff(bounds) >= 0).all()
    views = batch.arrays()
    assert sum(view.nbytes for view in views) == len(data)


def test_submit_batch_inputs_of_different_batch_sizes() -> None:
    one = InputBatch.of("a", [np.frombuffer(b"ab", np.uint8), np.frombuffer(b"cd", np.uint8)])
    other = InputBatch.of("b", [np.frombuffer(b"ef", np.uint8)])
    with pytest.raises(ValueError, match="same number of samples"):
        SubmitBatch(1, (one, other))
    frames = _submit_frames(
        _input_batch_body(name="a"),
        _input_batch_body(name="b", size=1, shapes=3, data=4),
        frames=[TWO_SHAPES, b"abcd", _shapes([2]), b"ef"],
    )
    _expect_error(frames)


def test_submit_batch_without_inputs_or_samples() -> None:
    with pytest.raises(ValueError):
        SubmitBatch(1, ())
    with pytest.raises(ValueError):
        SubmitBatch(1, (InputBatch("a", "uint8", 0, 1, memoryview(b""), memoryview(b"")),))
    with pytest.raises(ValueError, match="no samples"):
        InputBatch.of("a", [])
    _expect_error(_submit_frames())
    _expect_error(_submit_frames(_input_batch_body(size=0), frames=[b"", b""]))


@pytest.mark.parametrize("waited", [math.inf, -math.inf, math.nan, -1.0])
def test_trainer_progress_must_be_finite(waited: float) -> None:
    with pytest.raises(ValueError, match="waited_seconds"):
        TrainerProgress(waited_seconds=waited, batches_received=1)
    # msgpack carries IEEE infinities and NaN as they are: the receiver refuses them.
    _expect_error(
        _pack(
            _header(op="trainer_progress", body={"waited_seconds": waited, "batches_received": 1})
        )
    )


@pytest.mark.parametrize(
    ("op", "body"),
    [
        ("hello", {"protocol_version": 1, "client_pid": 1, "role": "worker"}),  # no job/token
        ("hello", {"protocol_version": 1, "client_pid": 1, "role": "worker", "job_id": 1}),
        ("hello", {"protocol_version": 1, "client_pid": 1, "role": "trainer", "name": "n" * 257}),
        ("release_regions", {"region_ids": [1, None]}),
        (
            "hello",
            {
                "protocol_version": 1,
                "client_pid": 1,
                "role": "worker",
                "job_id": 1,
                "job_token": "ab",
                "earlier_jobs": [{"job_id": 1, "job_token": "cd"}],
            },
        ),
        (
            "hello",
            {
                "protocol_version": 1,
                "client_pid": 1,
                "role": "trainer",
                "earlier_jobs": [{"job_id": 1, "job_token": "cd"}] * 2,
            },
        ),
        (
            "hello",
            {
                "protocol_version": 1,
                "client_pid": 1,
                "role": "trainer",
                "earlier_jobs": [{"job_id": n, "job_token": "cd"} for n in range(257)],
            },
        ),
        (
            "hello",
            {
                "protocol_version": 1,
                "client_pid": 1,
                "role": "trainer",
                "earlier_jobs": [{"job_id": 1, "job_token": ""}],
            },
        ),
    ],
    ids=[
        "worker-without-job",
        "worker-without-token",
        "long-name",
        "nil-region",
        "worker-with-earlier-jobs",
        "earlier-job-twice",
        "too-many-earlier-jobs",
        "earlier-job-without-token",
    ],
)
def test_message_checks(op: str, body: dict[str, Any]) -> None:
    _expect_error(_pack(_header(op=op, body=body)))


@pytest.mark.parametrize(
    "fields",
    [
        {"input_names": []},
        {"input_names": ["a", "a"]},
        {"input_names": [""]},
        {"input_names": [f"i{n}" for n in range(65)]},
        {"num_outputs": 0},
        {"num_outputs": 65},
        {"max_batch_size": 0},
        {"max_batch_size": 65537},
        {"num_threads": 0},
        {"prefetch_queue_depth": 0},
        {"name": "n" * 257},
        {
            "earlier_ids": [
                {"job_token": "ab", "pipeline_id": 1},
                {"job_token": "ab", "pipeline_id": 2},
            ]
        },
        {"earlier_ids": [{"job_token": "", "pipeline_id": 1}]},
        {"earlier_ids": [{"job_token": "ab"}]},
    ],
    ids="-".join,
)
def test_register_pipeline_checks(fields: dict[str, Any]) -> None:
    header, frames = _encoded_header(_first(RegisterPipeline))
    header["body"].update(fields)
    _expect_error(_pack(header, *frames))


@pytest.mark.parametrize(
    "fields",
    [
        {"name": ""},
        {"parameters": "[1, 2]"},
        {"parameters": "{not json"},
        {"parameters": '{"device_id": 3}'},
        {"parameters": '{"batch_size": 3}'},
        {"batch_size": 0},
        {"num_threads": 2000},
        {"prefetch_queue_depth": 0},
        {"earlier_ids": [{"job_token": f"t{n}", "pipeline_id": 1} for n in range(257)]},
    ],
    ids=[
        "name",
        "array",
        "not-json",
        "device-id",
        "batch-size-param",
        "batch",
        "threads",
        "depth",
        "too-many-earlier-ids",
    ],
)
def test_register_named_pipeline_checks(fields: dict[str, Any]) -> None:
    header, frames = _encoded_header(_first(RegisterNamedPipeline))
    header["body"].update(fields)
    _expect_error(_pack(header, *frames))


@pytest.mark.parametrize(
    "fields",
    [
        {"offset": -1},
        {"offset": 1 << 20},  # past the end of the slab
        {"nbytes": (1 << 20) + 1},
        {"dtype": "complex128"},
        {"shape": [1] * 17},
        {"shape": [-3]},
    ],
    ids=["negative-offset", "offset-past-end", "too-many-bytes", "dtype", "17-dims", "negative"],
)
def test_output_descriptor_checks(fields: dict[str, Any]) -> None:
    header, frames = _encoded_header(_first(BatchReady))
    header["body"]["outputs"][0].update(fields)
    _expect_error(_pack(header, *frames))


def _gpu_batch_ready() -> BatchReady:
    return next(
        message for message, _ in EXAMPLES if isinstance(message, BatchReady) and message.event
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"ipc_handle": ""},
        {"ipc_handle": "ab" * 63},  # 63 bytes
        {"ipc_handle": "zz" * 64},
        {"device": "gpu0"},
        {"strides": [24, 8]},  # fewer strides than dimensions
        {"strides": [24, -8, 2]},
        {"strides": [48, 8, 2]},  # reaches past the region's bytes
    ],
    ids=["no-handle", "short-handle", "not-hex", "device", "strides-ndim", "negative", "reach"],
)
def test_gpu_output_descriptor_checks(fields: dict[str, Any]) -> None:
    header, frames = _encoded_header(_gpu_batch_ready())
    header["body"]["outputs"][0].update(fields)
    _expect_error(_pack(header, *frames))


def test_a_cpu_output_has_no_ipc_handle() -> None:
    header, frames = _encoded_header(_first(BatchReady))
    header["body"]["outputs"][0]["ipc_handle"] = GPU_HANDLE
    _expect_error(_pack(header, *frames))


@pytest.mark.parametrize("event", ["", "00" * 63, GPU_EVENT.upper()[:-2] + "xy"])
def test_gpu_outputs_need_their_batch_event(event: str) -> None:
    header, frames = _encoded_header(_gpu_batch_ready())
    header["body"]["event"] = event
    _expect_error(_pack(header, *frames))


def test_a_batch_event_without_gpu_outputs_is_refused() -> None:
    header, frames = _encoded_header(_first(BatchReady))
    header["body"]["event"] = GPU_EVENT
    _expect_error(_pack(header, *frames))


@pytest.mark.parametrize(
    "body",
    [{"event": "12"}, {"closed_slabs": [""]}, {"closed_slabs": ["n" * 257]}],
    ids=["short-event", "empty-name", "long-name"],
)
def test_release_regions_gpu_checks(body: dict[str, Any]) -> None:
    _expect_error(_pack(_header(op="release_regions", body=body)))


def test_goodbye_kept_slab_names_are_checked() -> None:
    _expect_error(_pack(_header(op="goodbye", body={"kept_slabs": [""]})))


# --- Fuzzing ------------------------------------------------------------------------------------


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.sampled_from(["trainer", "worker", "uint8", "float32", "x", *ErrorCode])
    | st.integers(min_value=-2, max_value=8)
)
_values = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=25,
)
_ops = st.sampled_from([cls.OP for cls in MESSAGE_TYPES])
_frames = st.lists(st.binary(max_size=32), max_size=6)


def _field_names(op: str) -> list[str]:
    cls = next(cls for cls in MESSAGE_TYPES if op == cls.OP)
    # Every message class is a dataclass; Message, their base, is not one.
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    return [*names, "name", "dtype", "size", "ndim", "shapes", "data", "slab", "offset", "nbytes",
            "shape"]  # fmt: skip


def _fast_decoder_agrees(frames: list[bytes]) -> None:
    """What the compiled fast decoder takes, the checking decoder takes too and reads alike."""
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        cls = next(cls for cls in MESSAGE_TYPES if header["op"] == cls.OP)
        body = header["body"]
    except Exception:
        return
    try:
        fast = codec._plan(cls).decode(body, frames, [False] * len(frames))
    except Exception:
        return  # refused: decode asks the checking decoder, which says why
    checked = codec._decode_dataclass(cls, body, frames, [False] * len(frames), cls.OP)
    assert _plain(fast) == _plain(checked)


def _check_decode(frames: list[bytes]) -> None:
    """``decode`` returns a message that re-encodes, or raises ProtocolError; nothing else."""
    _fast_decoder_agrees(frames)
    try:
        envelope = decode(frames)
    except ProtocolError as error:
        assert isinstance(error.code, ErrorCode)
        assert error.request_id is None or isinstance(error.request_id, int)
        assert isinstance(error.op, str)
        return
    assert isinstance(envelope.message, Message)
    again = decode(_wire(encode(envelope.message, envelope.request_id)))
    assert _plain(again.message) == _plain(envelope.message)


@FUZZ
@given(frames=st.lists(st.binary(max_size=64), max_size=5))
def test_fuzz_random_frames(frames: list[bytes]) -> None:
    _check_decode(frames)


@FUZZ
@given(header=_values, frames=_frames)
def test_fuzz_random_headers(header: Any, frames: list[bytes]) -> None:
    _check_decode([msgpack.packb(header, use_bin_type=True), *frames])


@FUZZ
@given(data=st.data(), op=_ops, frames=_frames)
def test_fuzz_plausible_headers(data: st.DataObject, op: str, frames: list[bytes]) -> None:
    names = _field_names(op)
    body = data.draw(st.dictionaries(st.sampled_from(names), _values, max_size=len(names)))
    header = {
        "v": data.draw(st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, None])),
        "op": op,
        "rid": data.draw(st.none() | st.integers(min_value=-5, max_value=2**64 - 1)),
        "body": body,
    }
    _check_decode([msgpack.packb(header, use_bin_type=True), *frames])


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside nested maps and arrays."""
    paths = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            paths += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            paths += _paths(item, (*prefix, index))
    return paths


@FUZZ
@given(
    data=st.data(),
    example=st.sampled_from(range(len(EXAMPLES))),
    mutation=st.sampled_from(["replace", "delete", "flip", "drop-frame", "add-frame"]),
)
def test_fuzz_mutated_messages(data: st.DataObject, example: int, mutation: str) -> None:
    message, request_id = EXAMPLES[example]
    frames = _wire(encode(message, request_id))
    header = msgpack.unpackb(frames[0], raw=False)
    paths = [path for path in _paths(header) if path]
    if mutation in ("replace", "delete"):
        path = data.draw(st.sampled_from(paths))
        parent = header
        for key in path[:-1]:
            parent = parent[key]
        if mutation == "replace":
            parent[path[-1]] = data.draw(_values)
        elif isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
        frames[0] = msgpack.packb(header, use_bin_type=True)
    elif mutation == "flip":
        raw = bytearray(frames[0])
        for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
            position = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
            raw[position] = data.draw(st.integers(min_value=0, max_value=255))
        frames[0] = bytes(raw)
    elif mutation == "drop-frame":
        if len(frames) > 1:
            del frames[data.draw(st.integers(min_value=1, max_value=len(frames) - 1))]
    else:
        frames.insert(
            data.draw(st.integers(min_value=1, max_value=len(frames))),
            data.draw(st.binary(max_size=16)),
        )
    _check_decode(frames)


def _nested(depth: int, leaf: Any = 0) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


# What a hostile peer puts in a field: nesting as deep as msgpack lets through, JSON text that
# nests deeper than Python's parser goes, integers at and past 64 bits, long and odd strings,
# values of every wrong type.
_hostile = st.one_of(
    st.integers(min_value=1, max_value=500).map(_nested),
    st.integers(min_value=1, max_value=200_000).map(lambda n: "[" * n),
    st.integers(min_value=1, max_value=50_000).map(lambda n: '{"a":' * n + "1" + "}" * n),
    st.sampled_from([2**64 - 1, -(2**63), 2**63, -1, 0, float("nan"), float("inf"), -0.0]),
    st.text(min_size=1000, max_size=5000),
    st.binary(max_size=64),
    st.sampled_from(["\x00", "\ud7ff", "../../etc/passwd", "", True, None]),
    _values,
)


def _paths_in(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside nested maps and arrays, the value itself first."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths_in(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:8]):
            found += _paths_in(item, (*prefix, index))
    return found


# Stands for 100,000 nested arrays of one, written by hand (``_pack_hostile``): msgpack's own
# packer stops at 512 levels.
_DEEP = "@100000-deep@"


def _pack_hostile(header: Any) -> bytes:
    return msgpack.packb(header, use_bin_type=True).replace(
        msgpack.packb(_DEEP), b"\x91" * 100_000 + b"\x00"
    )


_HOSTILE_VALUES = [
    _DEEP,
    _nested(500),
    "[" * 100_000,
    '{"a":' * 50_000 + "1" + "}" * 50_000,
    2**64 - 1,
    -(2**63),
    float("nan"),
    "x" * 5000,
    b"\xff" * 64,
    "../../etc/passwd",
    None,
    [None] * 100,
    {"": {"": [1, "a", b"b"]}},
]


@pytest.mark.parametrize("message_type", MESSAGE_TYPES, ids=lambda cls: cls.OP)
def test_every_field_of_every_message_type_refuses_hostile_values(
    message_type: type[Message],
) -> None:
    # Each field at the top of the body and one level down, given each hostile value in turn.
    header, frames = _encoded_header(_first(message_type))
    paths = [path for path in _paths_in(header["body"]) if 0 < len(path) <= 2]
    for path in paths or [("extra",)]:
        for value in _HOSTILE_VALUES:
            tampered = msgpack.unpackb(msgpack.packb(header, use_bin_type=True), raw=False)
            parent = tampered["body"]
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = value
            _check_decode([_pack_hostile(tampered), *frames])


@settings(FUZZ, max_examples=400)
@given(
    data=st.data(),
    message_type=st.sampled_from(MESSAGE_TYPES),
    value=_hostile,
)
def test_every_message_type_refuses_hostile_fields(
    data: st.DataObject, message_type: type[Message], value: Any
) -> None:
    # Every field of every message type, and every value nested in one, given a hostile value:
    # the message decodes or is refused as malformed, and nothing else escapes the decoder.
    header, frames = _encoded_header(_first(message_type))
    paths = [path for path in _paths_in(header["body"]) if path]
    if paths:
        path = data.draw(st.sampled_from(paths))
        parent = header["body"]
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value
    else:
        header["body"]["extra"] = value
    try:
        packed = [msgpack.packb(header, use_bin_type=True), *frames]
    except (ValueError, OverflowError, TypeError):
        return  # msgpack cannot even write it: no peer can send it
    _check_decode(packed)


def test_deeply_nested_pipeline_parameters_are_refused() -> None:
    header, frames = _encoded_header(_first(RegisterNamedPipeline))
    header["body"]["parameters"] = "[" * 100_000
    error = _expect_error(_pack(header, *frames))
    assert "parameters nest too deeply" in error.message


def test_nesting_deeper_than_msgpack_allows_is_refused() -> None:
    header, frames = _encoded_header(_first(RegisterNamedPipeline))
    header["body"]["parameters"] = _DEEP
    _expect_error([_pack_hostile(header), *frames])


def test_bad_sample_fields_are_checked_on_both_sides() -> None:
    with pytest.raises(ValueError, match="position is out of range"):
        BadSample(-1, "x")
    with pytest.raises(ValueError, match="replaced_by is out of range"):
        BadSample(0, "x", replaced_by=-2)
    frames = _wire(encode(BatchFailed(1, 2, ErrorCode.BAD_SAMPLES, "x", (BadSample(3, "y"),))))
    header = msgpack.unpackb(frames[0], raw=False)
    header["body"]["bad_samples"][0]["position"] = -4
    with pytest.raises(ProtocolError, match="position is out of range"):
        decode([msgpack.packb(header), *frames[1:]])
    header["body"]["bad_samples"] = [{"position": 1, "message": "y", "replaced_by": "0"}]
    with pytest.raises(ProtocolError, match="must be an int"):
        decode([msgpack.packb(header), *frames[1:]])


def test_an_unknown_on_error_policy_is_malformed() -> None:
    request = RegisterPipeline(memoryview(b"p"), ("x",), 1, 1, 1, 1, on_error=OnError.REPLACE)
    frames = _wire(encode(request, 1))
    header = msgpack.unpackb(frames[0], raw=False)
    assert header["body"]["on_error"] == "replace"
    header["body"]["on_error"] = "ignore"
    with pytest.raises(ProtocolError, match="'ignore' is not one of"):
        decode([msgpack.packb(header), *frames[1:]])


def test_messages_cross_a_socket_whatever_their_samples_shapes_and_sizes() -> None:
    """transport.send_frames copies small frames and hands large ones over, by their bytes."""
    samples: list[np.ndarray] = [np.asarray(3, dtype=np.int64), np.zeros((2, 3), np.float32),
                                 np.arange(1 << 17, dtype=np.uint8)]  # fmt: skip
    message = SubmitBatch(
        1,
        tuple(InputBatch.of(f"in{i}", [sample]) for i, sample in enumerate(samples)),
    )
    context: zmq.Context[Any] = zmq.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        receiver.bind("inproc://codec-transport")
        sender.connect("inproc://codec-transport")
        transport.send(sender, message, 9)
        envelope = transport.recv(receiver)
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
        context.term()
    assert envelope.request_id == 9
    received = envelope.message
    assert isinstance(received, SubmitBatch)
    for batch, sample in zip(received.inputs, samples, strict=True):
        assert bytes(batch.data) == sample.tobytes()
        assert batch.extents().tolist() == [list(sample.shape)]
