"""GPU outputs for real: a daemon on GPU 0, trainers receiving CUDA tensors over CUDA IPC.

Skipped without CUDA. What is checked, beside values equal to the same pipeline run in-process:
the trainer consumes on a stream of its own and its host never synchronizes; tensors held
across many batches and freed out of order keep their values while the daemon reuses the
regions freed around them; reuse waits for the trainer's stream (release fences); slabs and
events are opened once; two trainer processes at once; a trainer that cannot see the GPU, or
dies holding tensors, or closes its session holding them. See Note [GPU output lifetime].
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from nvidia.dali.data_node import DataNode

import dalid.client as dalid

from ..daemons import DaemonProcess, kill_leftovers, own_directory, start_daemon, wait_for
from ..host_sync import host_syncs_raise
from .helpers import BATCH, ProxyDataset, gpu_pipeline, index_batches, run_in_process, sample

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
LENGTH = 37  # 4 full batches of 8 and a partial one of 5


def _start(*args: str) -> tuple[DaemonProcess, Path]:
    directory = own_directory()
    return start_daemon(directory, "--device", "0", *args), directory


def _stop(daemon: DaemonProcess, directory: Path) -> None:
    code = daemon.stop()
    log = daemon.log_text()
    segments = daemon.segments()
    shutil.rmtree(directory, ignore_errors=True)
    assert code == 0, f"daemon exited with {code}:\n{log}"
    assert not segments, f"daemon left shared memory: {segments}"


@pytest.fixture(scope="module")
def gpu_daemon() -> Iterator[DaemonProcess]:
    daemon, directory = _start()
    try:
        yield daemon
    finally:
        _stop(daemon, directory)


@pytest.fixture
def small_daemon() -> Iterator[DaemonProcess]:
    """A daemon whose pools hold a few batches only, so regions are reused all the time."""
    daemon, directory = _start("--pool-bytes", "8K", "--slab-bytes", "4K")
    try:
        yield daemon
    finally:
        _stop(daemon, directory)


def _session(daemon: DaemonProcess, name: str = "gpu") -> dalid.Session:
    return dalid.connect(socket=daemon.socket, autostart=False, name=name)


def _reference(length: int, offset: int = 0) -> list[list[np.ndarray]]:
    return run_in_process(
        gpu_pipeline(prefetch_queue_depth=1),
        [{"data": [sample(i, offset) for i in indices]} for indices in index_batches(length)],
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_outputs_equal_in_process_run_without_host_sync(
    gpu_daemon: DaemonProcess, num_workers: int
) -> None:
    reference = _reference(LENGTH)
    expected = [torch.as_tensor(batch[0], device="cuda") for batch in reference]
    side = torch.cuda.Stream()
    with _session(gpu_daemon) as session:
        proxy = session.proxy(gpu_pipeline())
        loader = dalid.DataLoader(
            session, ProxyDataset(proxy, LENGTH), batch_size=BATCH, num_workers=num_workers
        )
        differences = []
        seen = []
        torch.cuda.synchronize()
        with host_syncs_raise(), torch.cuda.stream(side):  # any host synchronization raises
            for ((scaled, shifted), indices), want in zip(
                loader, zip(reference, expected, strict=True), strict=True
            ):
                assert scaled.device == torch.device("cuda", torch.cuda.current_device())
                assert scaled.dtype == torch.float32 and scaled.shape == want[1].shape
                assert shifted.device.type == "cpu"  # a CPU output of a GPU pipeline
                np.testing.assert_array_equal(shifted.numpy(), want[0][1])
                differences.append((scaled - want[1]).abs().max())
                seen.extend(indices.tolist())
        side.synchronize()
        assert [float(d) for d in differences] == [0.0] * len(reference)
        assert seen == list(range(LENGTH))
        assert session.events_opened <= 32  # the daemon's ring, each event opened once


def test_decoded_images_equal_in_process_run(gpu_daemon: DaemonProcess) -> None:
    from nvidia.dali import fn, types

    from ..dali_typing import pipeline_def

    @pipeline_def(batch_size=4, num_threads=2, device_id=0, seed=7)
    def decode() -> DataNode:
        jpegs = fn.external_source(name="jpegs", no_copy=True)
        images = fn.decoders.image(jpegs, device="mixed", output_type=types.DALIImageType.RGB)
        return fn.crop_mirror_normalize(
            fn.resize(images, size=[64, 80]),  # type: ignore[arg-type]  # DALI's stub: a union
            dtype=types.DALIDataType.FLOAT,
            output_layout="CHW",
        )

    files = _jpegs(8)
    reference = run_in_process(
        decode(prefetch_queue_depth=1), [{"jpegs": files[:4]}, {"jpegs": files[4:]}]
    )
    with _session(gpu_daemon) as session:
        proxy = session.proxy(decode())
        loader = dalid.DataLoader(session, _Files(proxy, files), batch_size=4)
        for images, want in zip(loader, reference, strict=True):
            assert images.is_cuda and images.shape == (4, 3, 64, 80)
            torch.testing.assert_close(images.cpu(), torch.from_numpy(want[0]))


def test_held_tensors_keep_their_values_while_regions_around_them_are_reused(
    small_daemon: DaemonProcess,
) -> None:
    # Each batch leases a 512-byte GPU region and a 512-byte CPU one; the 8 KiB pools hold 16
    # batches. 240 batches get through only if regions come back, while the trainer holds up to
    # 12 batches at a time and drops them in random order.
    rng = random.Random(0)
    length = 240 * BATCH
    with _session(small_daemon) as session:
        proxy = session.proxy(gpu_pipeline())
        loader = dalid.DataLoader(session, ProxyDataset(proxy, length), batch_size=BATCH)
        held: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        batches = 0
        for (scaled, shifted), indices in loader:
            held.append((scaled, shifted, indices[0].item()))
            batches += 1
            if len(held) >= 12:
                for _ in range(rng.randint(1, 8)):
                    tensor, cpu, first = held.pop(rng.randrange(len(held)))
                    expected = sample(first)
                    np.testing.assert_array_equal(tensor[0].cpu().numpy(), expected * 0.5 + 1.0)
                    np.testing.assert_array_equal(cpu[0].numpy(), expected + 7)
        assert batches == 240
        for tensor, cpu, first in held:
            np.testing.assert_array_equal(tensor[0].cpu().numpy(), sample(first) * 0.5 + 1.0)
            np.testing.assert_array_equal(cpu[0].numpy(), sample(first) + 7)
        assert session.slabs_opened <= 4  # two 4 KiB slabs per pool, each opened once
        assert session.events_opened <= 32


def test_the_daemon_reuses_a_region_only_after_the_trainers_stream_used_it(
    small_daemon: DaemonProcess,
) -> None:
    # The trainer's stream reads each batch long after the host dropped it; the daemon gets the
    # region back at once and copies later batches into it. Without the release fence those
    # copies would land before the delayed reads.
    side = torch.cuda.Stream()
    length = 64 * BATCH
    reads = []
    with _session(small_daemon) as session, torch.cuda.stream(side):
        proxy = session.proxy(gpu_pipeline())
        loader = dalid.DataLoader(session, ProxyDataset(proxy, length), batch_size=BATCH)
        for (scaled, _), indices in loader:
            torch.cuda._sleep(5_000_000)  # a few milliseconds of GPU time before the read
            reads.append((scaled * 1, indices[0].item()))
            del scaled
    side.synchronize()
    assert len(reads) == 64
    for copy, first in reads:
        np.testing.assert_array_equal(copy[0].cpu().numpy(), sample(first) * 0.5 + 1.0)


def test_a_loop_that_keeps_every_output_gets_private_copies_that_stay_on_the_device(
    small_daemon: DaemonProcess,
) -> None:
    # The 8 KiB GPU pool holds 16 batches of the 40 of two epochs: the rest come as private
    # copies (Note [Private copies] in dalid.server.outputs.copies), which the trainer copies on
    # its GPU from the daemon's copy memory, on its stream, without a host synchronization.
    length = 20 * BATCH
    side = torch.cuda.Stream()
    with _session(small_daemon, "keeper") as session:
        proxy = session.proxy(gpu_pipeline())
        loader = dalid.DataLoader(session, ProxyDataset(proxy, length), batch_size=BATCH)
        kept: list[Any] = []
        torch.cuda.synchronize()
        with host_syncs_raise(), torch.cuda.stream(side):
            for _ in range(2):
                kept.extend(loader)
        side.synchronize()
        assert len(kept) == 40
        # Correct after the last batch: the copies are the trainer's own, and the later copies
        # through the same copy memory changed none of them.
        for (scaled, shifted), indices in kept:
            expected = np.stack([sample(index) for index in indices.tolist()])
            assert scaled.is_cuda
            np.testing.assert_array_equal(scaled.cpu().numpy(), expected * 0.5 + 1.0)
            np.testing.assert_array_equal(shifted.numpy(), expected + 7)
        (job,) = [job for job in small_daemon.status().jobs if job.job_id == session.job_id]
        assert 0 < job.batches_copied <= 40 - 16
        # Every copy's GPU output stayed on the device (none went through the host), through
        # copy memory of two batches (a page each here) at most.
        assert job.batches_copied_on_device == job.batches_copied
        assert 0 < job.copy_slab_bytes <= 2 * 4096
        del kept


def test_a_closed_session_keeps_the_tensors_it_handed_out(gpu_daemon: DaemonProcess) -> None:
    with _session(gpu_daemon) as session:
        proxy = session.proxy(gpu_pipeline())
        loader = dalid.DataLoader(session, ProxyDataset(proxy, 2 * BATCH), batch_size=BATCH)
        (kept, _), indices = next(iter(loader))
        first = indices[0].item()
    torch.cuda.synchronize()
    # The daemon keeps the slab until this process exits (Note [GPU output lifetime]).
    np.testing.assert_array_equal(kept[0].cpu().numpy(), sample(first) * 0.5 + 1.0)
    wait_for(lambda: "still maps until pid" in gpu_daemon.log_text(), 10, "the kept slab")


def _job(socket: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.gpu_job", "--socket", str(socket), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_two_trainer_processes_at_once(gpu_daemon: DaemonProcess) -> None:
    jobs = [_job(gpu_daemon.socket, "--offset", str(offset)) for offset in (0, 1000)]
    try:
        for job in jobs:
            out, _ = job.communicate(timeout=180)
            assert job.returncode == 0, out
            assert "ok 96" in out
    finally:
        kill_leftovers(jobs)


def test_a_trainer_without_the_gpu_is_told_why(gpu_daemon: DaemonProcess) -> None:
    job = _job(gpu_daemon.socket, "--workers", "0", env={"CUDA_VISIBLE_DEVICES": ""})
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 3, out
    assert "DeviceMismatch" in out and "GPU-" in out, out


@pytest.mark.slow
def test_a_killed_trainers_gpu_memory_is_freed_and_the_daemon_goes_on(
    gpu_daemon: DaemonProcess,
) -> None:
    job = _job(gpu_daemon.socket, "--hold")
    try:
        assert job.stdout is not None
        line = job.stdout.readline()
        assert "holding" in line, line + job.stdout.read()
        job.send_signal(signal.SIGKILL)
        job.wait(30)
        wait_for(
            lambda: f"trainer pid {job.pid} is gone" in gpu_daemon.log_text(),
            15,
            "the daemon to notice the dead trainer",
        )
    finally:
        if job.poll() is None:
            job.kill()
        job.communicate()
    # The daemon still serves GPU outputs.
    with _session(gpu_daemon, "after") as session:
        proxy = session.proxy(gpu_pipeline())
        loader = dalid.DataLoader(session, ProxyDataset(proxy, BATCH), batch_size=BATCH)
        (scaled, _), _ = next(iter(loader))
        np.testing.assert_array_equal(scaled[1].cpu().numpy(), sample(1) * 0.5 + 1.0)


def _jpegs(count: int) -> list[np.ndarray]:
    """JPEG files cut from scikit-learn's sample photographs, as byte arrays."""
    import io

    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    files = []
    for n in range(count):
        photo = photos[n % len(photos)]
        crop = photo[n * 20 : n * 20 + 200, n * 30 : n * 30 + 240]
        buffer = io.BytesIO()
        Image.fromarray(crop).save(buffer, format="JPEG", quality=90)
        files.append(np.frombuffer(buffer.getvalue(), dtype=np.uint8))
    return files


class _Files(torch.utils.data.Dataset[Any]):
    def __init__(self, proxy: dalid.Proxy, files: list[np.ndarray]) -> None:
        self.proxy = proxy
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> Any:
        return self.proxy(self.files[index])


def test_the_daemon_answers_on_a_link_named_by_its_gpu_uuid() -> None:
    daemon, directory = _start()
    try:
        with _session(daemon) as session:
            uuid = session._daemon.welcome.device_uuid
        link = directory / f"{uuid}.sock"
        assert link.is_symlink() and link.resolve() == daemon.socket.resolve()
        with dalid.connect(socket=link, autostart=False) as session:
            assert session.daemon_pid == daemon.pid
        assert daemon.stop() == 0
        assert not link.is_symlink(), "the daemon removes its link when it stops"
    finally:
        _stop(daemon, directory)


# The documented pipeline of DALI's proxy: the mixed decoder gives each run's first
# hw_decoder_load share of samples to the hardware JPEG decoder and the rest to the CUDA one,
# whose results differ slightly; a job's outputs equal its pipeline run on its own batches only
# if its runs are its batches.
DOCUMENTED_BATCH = 16


def _documented(**options: Any) -> Any:
    from nvidia.dali import fn, types

    from ..dali_typing import pipeline_def

    @pipeline_def(batch_size=DOCUMENTED_BATCH, num_threads=4, device_id=0, seed=5)
    def documented() -> DataNode:
        paths = fn.external_source(name="images", no_copy=True)
        images = fn.decoders.image(
            fn.io.file.read(paths),  # type: ignore[attr-defined]
            device="mixed",
            output_type=types.DALIImageType.RGB,
        )
        images = fn.resize(  # type: ignore[assignment]
            images, size=[224, 224], interp_type=types.DALIInterpType.INTERP_LINEAR, antialias=False
        )
        return fn.crop_mirror_normalize(
            images,
            dtype=types.DALIDataType.FLOAT,
            output_layout="CHW",
            crop=(224, 224),
            mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
            std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
        )

    return documented(**options)


class _Paths(torch.utils.data.Dataset[Any]):
    def __init__(self, proxy: Any, paths: list[str]) -> None:
        self.proxy = proxy
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Any:
        return self.proxy(np.frombuffer(self.paths[index].encode(), dtype=np.int8)), index


@pytest.mark.parametrize("beside", ["alone", "opted-out-beside-a-sharing-job"])
def test_mixed_decoding_equals_the_pipeline_run_on_the_same_batches(
    gpu_daemon: DaemonProcess, tmp_path: Path, beside: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.dataset import make_imagefolder
    from dalid.client import proxy as dali_proxy

    monkeypatch.setenv("DALID_SOCKET", str(gpu_daemon.socket))
    paths = [str(path) for path in make_imagefolder(tmp_path / "images", 96, 2, seed=3).paths]
    batches = [paths[i : i + DOCUMENTED_BATCH] for i in range(0, len(paths), DOCUMENTED_BATCH)]
    reference = run_in_process(
        _documented(prefetch_queue_depth=1),
        [{"images": [np.frombuffer(p.encode(), dtype=np.int8) for p in b]} for b in batches],
    )
    alone = beside == "alone"
    server = dali_proxy.DALIServer(_documented(prefetch_queue_depth=6), share_runs=alone)
    other = None if alone else dali_proxy.DALIServer(_documented(prefetch_queue_depth=6))
    loaders = [
        dali_proxy.DataLoader(
            each, _Paths(each.proxy, paths), batch_size=DOCUMENTED_BATCH, num_workers=4
        )
        for each in ([server] if other is None else [server, other])
    ]
    try:
        for number, batches_now in enumerate(zip(*loaders, strict=True)):
            images, indices = batches_now[0]
            assert indices.tolist() == list(range(number * 16, number * 16 + 16))
            want = torch.from_numpy(reference[number][0])
            torch.testing.assert_close(images.cpu(), want, rtol=0, atol=0)
        job = server.session.job_id
        (pipeline,) = [p for p in gpu_daemon.status().pipelines if job in p.jobs]
        # Its runs were its batches: on a shared pipeline (alone), or one of its own.
        assert (pipeline.runs, pipeline.mixed_runs) == (len(batches), 0)
        assert pipeline.shared == alone
        assert alone or "share_runs=False" in pipeline.private_reason
    finally:
        server.stop_thread()
        if other is not None:
            other.stop_thread()
