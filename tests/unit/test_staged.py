"""Staged GPU outputs, the daemon's half (server/outputs/cuda_staged.py): the store that copies GPU
outputs into page-locked shared memory, and the handshake that chooses each job's output path.

Shared memory and the bytes in it are real; the CUDA calls are the fake of fake_cuda.py, whose
"GPU tensors" lie in host memory so that the copies move real bytes. A real daemon on this path
is tests/integration/test_staged.py; on a real GPU, tests/integration/test_gpu.py.
"""

from __future__ import annotations

import mmap
import os
import queue
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from nvidia.dali.tensors import TensorListCPU

from dalid.protocol import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Hello,
    IpcProbeResult,
    Limits,
    Message,
    OutputPath,
    ReleaseRegions,
    Role,
    Welcome,
    slabs,
)
from dalid.protocol.slabs import SHM_DIR
from dalid.server.handling.core import DaemonCore
from dalid.server.jobs.quotas import Quotas
from dalid.server.outputs.cuda import CudaBackend
from dalid.server.outputs.cuda_staged import OutputPaths, StagedStore
from dalid.server.outputs.cuda_store import CudaStore, device_outputs
from dalid.server.outputs.job_outputs import JobOutputs
from dalid.server.outputs.pool import PAGE
from dalid.server.outputs.run_output import RunOutput
from dalid.server.outputs.shm import SharedMemoryStore
from dalid.server.outputs.store import ReleaseRefused, region_ids

from .fake_cuda import DEVICE_UUID, FakeApi, TensorListGPU

LIMITS = Limits(
    max_batch_size=64, max_message_bytes=1 << 20, pool_bytes=16 * PAGE, slab_bytes=4 * PAGE
)
STREAM = 7  # the fake's stream for every job
TRAINER = b"trainer"
WORKER = b"worker"


@pytest.fixture
def prefix() -> str:
    return f"dalid-unittest-{os.getpid()}-{os.urandom(3).hex()}"


def _staged_outputs(prefix: str, api: FakeApi) -> JobOutputs:
    ids = region_ids()
    backend = CudaBackend(0, api=api)
    return JobOutputs(
        [SharedMemoryStore(prefix, LIMITS, ids), StagedStore(prefix, LIMITS, ids, backend)]
    )


def _write(outputs: JobOutputs, batch: tuple[Any, ...], rows: range | None = None) -> Any:
    run = [RunOutput(index, tensors) for index, tensors in enumerate(batch)]
    return outputs.write_batch(run, run[0].whole if rows is None else rows, source_stream=STREAM)


def _bytes(name: str, offset: int, nbytes: int) -> bytes:
    fd = os.open(SHM_DIR / name, os.O_RDONLY)
    try:
        with mmap.mmap(fd, offset + nbytes, prot=mmap.PROT_READ) as view:
            return view[offset : offset + nbytes]
    finally:
        os.close(fd)


def _images(count: int, offset: int = 0) -> list[np.ndarray]:
    image = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    return [image + 100 * (i + offset) for i in range(count)]


# --- the store ----------------------------------------------------------------------------------


def test_gpu_outputs_are_copied_into_page_locked_shared_memory_before_delivery(
    prefix: str,
) -> None:
    api = FakeApi(host_memory=True)
    outputs = _staged_outputs(prefix, api)
    try:
        images = _images(2)
        labels = np.array([3, 4], dtype=np.int64)
        descriptors, event = _write(outputs, (TensorListGPU(images, "CHW"), TensorListCPU(labels)))
        staged, cpu = descriptors
        assert (staged.device, cpu.device) == ("staged", "cpu")
        assert staged.ipc_handle == "" and event == ""  # no IPC handle, no event to wait on
        assert staged.shape == (2, 2, 3, 4) and staged.dtype == "float32"
        assert staged.layout == "CHW" and slabs.is_slab_name(staged.slab)
        named = {record.label for path, record in slabs.user_segments() if path.name == staged.slab}
        assert named == {f"{prefix}-staged-1"}  # the daemon's name for it, in its record
        assert _bytes(staged.slab, staged.offset, staged.nbytes) == np.stack(images).tobytes()
        assert _bytes(cpu.slab, cpu.offset, cpu.nbytes) == labels.tobytes()
        kinds = [call[0] for call in api.calls]
        # The slab is page-locked when made; the CPU output is read once the stream has run
        # (as with CUDA IPC); the copy runs on the job's stream, which the host waits for
        # before the batch may be delivered.
        assert kinds == ["register_host", "synchronize", "copy_to_host", "synchronize"]
        assert api.calls[2][-1] == STREAM and api.calls[3] == ("synchronize", STREAM)
        # A second batch reuses the page-locked slab.
        api.calls.clear()
        _write(outputs, (TensorListGPU(_images(2, 5)), TensorListCPU(labels)))
        assert "register_host" not in [call[0] for call in api.calls]
        # Releases take no fence: the trainer's upload is done when it releases.
        assert outputs.release([staged.region_id, cpu.region_id]) == []
        with pytest.raises(ReleaseRefused):
            outputs.release([], fence="ab" * 64)
    finally:
        assert outputs.close() is False  # shared memory never outlives the job in the daemon
        outputs.free()
    assert api.registered == {}  # unregistered before unmapped
    assert ("destroy_stream", STREAM) in api.calls
    assert not [path for path, record in slabs.user_segments() if record.label.startswith(prefix)]


def test_a_jobs_rows_of_a_shared_run_are_staged_alone(prefix: str) -> None:
    api = FakeApi(host_memory=True)
    outputs = _staged_outputs(prefix, api)
    try:
        run = _images(5)
        (rows,), _ = _write(outputs, (TensorListGPU(run),), range(1, 4))
        assert rows.shape == (3, 2, 3, 4)
        assert _bytes(rows.slab, rows.offset, rows.nbytes) == np.stack(run[1:4]).tobytes()
        # Another job's samples differ in shape, this job's do not: a copy a row.
        api.calls.clear()
        ragged = [np.ones((5,), np.int32), np.arange(2, dtype=np.int32), np.full(2, 7, np.int32)]
        (sample_rows,), _ = _write(outputs, (TensorListGPU(ragged),), range(1, 3))
        assert [call[0] for call in api.calls].count("copy_to_host") == 2
        assert _bytes(sample_rows.slab, sample_rows.offset, sample_rows.nbytes) == (
            np.concatenate(ragged[1:3]).tobytes()
        )
    finally:
        outputs.close()
        outputs.free()


def test_memory_that_cannot_be_page_locked_is_used_as_it_is(prefix: str) -> None:
    api = FakeApi(host_memory=True)
    api.fail_register = True
    outputs = _staged_outputs(prefix, api)
    try:
        images = _images(2)
        (staged,), _ = _write(outputs, (TensorListGPU(images),))
        assert _bytes(staged.slab, staged.offset, staged.nbytes) == np.stack(images).tobytes()
    finally:
        outputs.close()
        outputs.free()
    assert "unregister_host" not in [call[0] for call in api.calls]


# --- the handshake, in the daemon core ----------------------------------------------------------


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


def _core(api: FakeApi, mode: str) -> DaemonCore:
    pushed: queue.Queue[tuple[bytes, Message, int | None]] = queue.Queue()
    return DaemonCore(
        0,
        device_outputs(0, api=api),
        lambda peer, message, rid: pushed.put((peer, message, rid)),
        Quotas(max_batch_size=64, pool_bytes=4 * PAGE, slab_bytes=PAGE),
        instance=f"unittest-{uuid.uuid4().hex[:8]}",
        device_uuid=DEVICE_UUID,
        paths=OutputPaths(0, mode, api=api),
    )


@pytest.fixture(params=["auto"])
def core(request: pytest.FixtureRequest, api: FakeApi) -> Iterator[DaemonCore]:
    daemon = _core(api, request.param)
    yield daemon
    daemon.close()
    assert api.allocated == {}, "the probe or a job's memory was not freed"


def _hello(core: DaemonCore, identity: bytes = TRAINER) -> Welcome:
    reply = core.handle(identity, Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER), 1)
    assert isinstance(reply, Welcome)
    return reply


def _path(core: DaemonCore, result: IpcProbeResult, identity: bytes = TRAINER) -> Message:
    reply = core.handle(identity, result, 2)
    assert reply is not None
    return reply


def test_the_welcome_offers_a_probe_that_holds_its_own_handle(
    core: DaemonCore, api: FakeApi
) -> None:
    welcome = _hello(core)
    handle = bytes.fromhex(welcome.ipc_probe)
    (probe,) = [ptr for ptr, data in api.written.items() if data == handle]
    assert api.export_memory(probe) == handle
    assert _hello(core, b"other").ipc_probe == welcome.ipc_probe  # one probe for the daemon


def test_a_trainer_that_opened_the_probe_gets_cuda_ipc(core: DaemonCore) -> None:
    welcome = _hello(core)
    assert _path(core, IpcProbeResult(opened=True)) == OutputPath("cuda_ipc")
    job = core.jobs[welcome.job_id]
    assert isinstance(job.outputs.store("cuda"), CudaStore)
    (status,) = core.status().jobs
    assert status.output_path == "cuda_ipc"


def test_a_trainer_that_could_not_gets_its_gpu_outputs_staged(
    core: DaemonCore, api: FakeApi
) -> None:
    welcome = _hello(core)
    job = core.jobs[welcome.job_id]
    ipc_store = job.outputs.store("cuda")
    assert isinstance(ipc_store, CudaStore)
    reason = "cudaIpcOpenMemHandle failed: operation not supported"
    assert _path(core, IpcProbeResult(opened=False, reason=reason)) == OutputPath("staged", reason)
    staged = job.outputs.store("staged")
    assert isinstance(staged, StagedStore)
    with pytest.raises(KeyError):
        job.outputs.store("cuda")
    # The job's stream went to the staged store: made once, destroyed once, with the job.
    assert staged.backend is ipc_store.backend and staged.stream == STREAM
    assert ("destroy_stream", STREAM) not in api.calls
    (status,) = core.status().jobs
    assert status.output_path == "staged"
    # A second report finds the job staged already.
    again = _path(core, IpcProbeResult(opened=False, reason=reason))
    assert isinstance(again, Error) and again.code is ErrorCode.MALFORMED_MESSAGE
    assert core.handle(TRAINER, ReleaseRegions(()), None) is None
    core.close_job(job)
    assert api.calls.count(("destroy_stream", STREAM)) == 1


def test_a_daemon_that_stages_every_job_says_why(api: FakeApi) -> None:
    core = _core(api, "staged")
    try:
        _hello(core)
        path = _path(core, IpcProbeResult(opened=True))
        assert isinstance(path, OutputPath) and path.path == "staged"
        assert "--gpu-outputs staged" in path.reason
    finally:
        core.close()
    assert api.allocated == {}


def test_a_daemon_of_cuda_ipc_only_refuses_a_trainer_that_cannot_open_it(api: FakeApi) -> None:
    core = _core(api, "ipc")
    try:
        _hello(core)
        refusal = _path(core, IpcProbeResult(opened=False, reason="not the daemon's namespace"))
        assert isinstance(refusal, Error) and refusal.code is ErrorCode.DEVICE_MISMATCH
        assert "not the daemon's namespace" in refusal.message
        assert "--gpu-outputs auto" in refusal.message
        assert _path(core, IpcProbeResult(opened=True)) == OutputPath("cuda_ipc")
    finally:
        core.close()
    assert api.allocated == {}


def test_a_daemon_whose_gpu_cannot_export_ipc_memory_stages_every_job(api: FakeApi) -> None:
    api.fail_export = True  # a MIG instance
    core = _core(api, "auto")
    try:
        assert _hello(core).ipc_probe == ""
        path = _path(core, IpcProbeResult(opened=False, reason="no probe offered"))
        assert isinstance(path, OutputPath) and path.path == "staged"
        assert "cannot export CUDA IPC memory" in path.reason and "not supported" in path.reason
    finally:
        core.close()
    assert api.allocated == {}
    with pytest.raises(RuntimeError, match="not supported"):
        OutputPaths(0, "ipc", api=api)  # CUDA IPC only, and none: the daemon does not start


def test_only_a_trainer_answers_the_probe_and_before_its_registrations(core: DaemonCore) -> None:
    welcome = _hello(core)
    worker = Hello(
        PROTOCOL_VERSION,
        os.getpid(),
        Role.WORKER,
        job_id=welcome.job_id,
        job_token=welcome.job_token,
    )
    assert isinstance(core.handle(WORKER, worker, 1), Welcome)
    refusal = _path(core, IpcProbeResult(opened=False), WORKER)
    assert isinstance(refusal, Error) and refusal.code is ErrorCode.NOT_WELCOMED
    # A job with a registration keeps its path (its outputs may be on their way).
    core.jobs[welcome.job_id].pipelines[1] = object()  # type: ignore[assignment]
    late = _path(core, IpcProbeResult(opened=False))
    assert isinstance(late, Error) and "before the job registers" in late.message
    core.jobs[welcome.job_id].pipelines.clear()


def test_a_cpu_daemon_sends_no_probe_and_refuses_a_result() -> None:
    core = DaemonCore(
        "cpu",
        lambda prefix, limits: JobOutputs([SharedMemoryStore(prefix, limits)]),
        lambda *_: None,
        Quotas(max_batch_size=64, pool_bytes=4 * PAGE, slab_bytes=PAGE),
        instance=f"unittest-{uuid.uuid4().hex[:8]}",
    )
    try:
        assert _hello(core).ipc_probe == ""
        refusal = _path(core, IpcProbeResult(opened=True))
        assert isinstance(refusal, Error) and refusal.code is ErrorCode.MALFORMED_MESSAGE
        (status,) = core.status().jobs
        assert status.output_path == "shm"
    finally:
        core.close()
