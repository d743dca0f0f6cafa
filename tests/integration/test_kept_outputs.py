"""A loop that keeps every output, as validation loops do: it never hangs (Note [Private
copies] in dalid.server.outputs.copies).

With DALI's proxy each step's tensors are new, so keeping them all only costs memory. Through
dalid they view the job's output memory: once the trainer holds it all, later batches come as
private copies, said once in the daemon's log and counted in ``dalid status``. On a GPU, the
copies of GPU outputs never leave the device: here on a simulated GPU (tests/simulated_gpu.py),
on a real one in tests/integration/test_gpu.py.
"""

from __future__ import annotations

import gc
import mmap
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from nvidia.dali import fn
from nvidia.dali.data_node import DataNode

import dalid.client as dalid
from dalid.client.outputs import cuda_device
from dalid.client.outputs import cuda_staged as staged
from dalid.server.outputs.copies import COPY_BATCHES

from ..daemons import own_directory, start_daemon, wait_for
from ..dali_typing import pipeline_def
from ..simulated_gpu import TO_HOST, SimulatedDevice, SimulatedDevices
from .helpers import BATCH, ProxyDataset, sample, two_output_pipeline

LENGTH = 20 * BATCH


def _keep_two_epochs(session: dalid.Session) -> tuple[dalid.DataLoader, list[Any]]:
    """A loop over two epochs of the two-output pipeline that keeps every batch (40), each
    checked against its samples; the loader, for more epochs, and what it kept."""
    proxy = session.proxy(two_output_pipeline())
    loader = dalid.DataLoader(session, ProxyDataset(proxy, LENGTH), batch_size=BATCH, num_workers=2)
    kept: list[Any] = []
    for _ in range(2):
        kept.extend(loader)
    assert len(kept) == 40
    for (scaled, shifted), indices in kept:
        expected = np.stack([sample(index) for index in indices.tolist()])
        np.testing.assert_array_equal(shifted.numpy(), expected + 7)
        np.testing.assert_array_equal(scaled.numpy(), expected * 0.5 + 1.0)
    return loader, kept


def test_keeping_every_output_of_two_epochs(short_tmp: Path) -> None:
    # 8 KiB of output memory: room for 8 of the 40 batches of two epochs.
    daemon = start_daemon(short_tmp, "--pool-bytes", "8K", "--slab-bytes", "4K")
    try:
        with dalid.connect(socket=daemon.socket, autostart=False, name="keeper") as session:
            loader, kept = _keep_two_epochs(session)
            (job,) = daemon.status().jobs
            copied = job.batches_copied
            assert 0 < copied <= 40 - 8
            assert job.regions_held <= 16  # the memory the job had, no more
            # Released, the memory serves batches in place again (the first few of the epoch
            # may still come as copies: they were made before the releases reached the daemon).
            del kept
            gc.collect()
            batches = 0
            for (_, shifted), indices in loader:
                np.testing.assert_array_equal(shifted[0].numpy(), sample(int(indices[0])) + 7)
                batches += 1
            assert batches == 20
            (job,) = daemon.status().jobs
            assert job.batches_copied - copied < 20
    finally:
        assert daemon.stop() == 0
    log = daemon.log_text()
    assert log.count("so batches that find no room come as private copies") == 1, log


def test_keeping_every_gpu_output_gets_copies_that_never_leave_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On a daemon whose GPU is simulated (tests/simulated_gpu.py: the first output stands for a
    # GPU output, the second is a CPU one), with 8 KiB of each kind of output memory: room for
    # 16 of the 40 batches' GPU outputs.
    devices = SimulatedDevices()
    monkeypatch.setattr(cuda_device, "DEVICES", devices)
    monkeypatch.setattr(staged, "_probed", {})
    directory = own_directory()
    daemon = start_daemon(
        directory,
        "--device",
        "0",
        "--pool-bytes",
        "8K",
        "--slab-bytes",
        "4K",
        module="tests.simulated_gpu",
    )
    try:
        with dalid.connect(socket=daemon.socket, autostart=False, name="keeper") as session:
            # Correct, and the copies are the trainer's own: the copy memory they came through
            # was written again by the later copies, and changed none of them.
            _, kept = _keep_two_epochs(session)
            (job,) = daemon.status().jobs
            copied = job.batches_copied
            assert 0 < copied <= 40 - 16
            # Every copy's GPU output stayed on the device: copied there by the trainer, never
            # uploaded from the host, never read back to the host by the daemon.
            assert job.batches_copied_on_device == copied
            opened = devices.opened
            assert sum(device.copies for device in opened) == copied
            assert sum(device.uploads for device in opened) == 0
            owned = sum(1 for (scaled, _), _ in kept if not _views_the_daemon(opened, scaled))
            assert owned == copied
            # The copy memory holds two batches (a page each, here) at most, and is counted.
            assert 0 < job.copy_slab_bytes <= COPY_BATCHES * mmap.PAGESIZE
            assert job.slab_bytes >= job.copy_slab_bytes
            assert job.regions_held <= 32  # the memory the job had: no copy region stays held
            job_id = session.job_id
            del kept
            gc.collect()
        wait_for(lambda: not daemon.job_segments(job_id), 10, "the job's memory to be freed")
    finally:
        code = daemon.stop()
        log = daemon.log_text()
        segments = daemon.segments()
        shutil.rmtree(directory, ignore_errors=True)
    assert code == 0, log
    assert not segments, f"daemon left shared memory: {segments}"
    assert TO_HOST not in log, log
    assert log.count("so batches that find no room come as private copies") == 1, log


def _views_the_daemon(devices: list[SimulatedDevice], tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` views the daemon's memory (mapped by one of ``devices``), rather than
    being the trainer's own."""
    for device in devices:
        try:
            device.region_of(tensor)
        except ValueError:
            continue
        return True
    return False


@pipeline_def(batch_size=BATCH, num_threads=2, device_id=None, seed=1)
def _doubling_pipeline() -> DataNode:
    return fn.external_source(name="data", no_copy=True) * 2.0


class _PlaneDataset(torch.utils.data.Dataset[Any]):
    """64x64 float32 samples (16 KiB) whose every value is the sample's index."""

    def __init__(self, proxy: Any, length: int) -> None:
        self.proxy = proxy
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.proxy(np.full((64, 64), index, np.float32)), index


def _rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no RssAnon for pid {pid}")


@pytest.mark.slow
def test_a_loop_keeping_1200_batches_runs_to_the_end_and_leaves_nothing_held(
    short_tmp: Path,
) -> None:
    # A job's share of batch inputs is 2 MiB (half of --input-memory): 16 batches of 128 KiB,
    # fewer than the 64 its 8 MiB of output memory holds in place. Delivered batches give their
    # samples back at once, kept or not, so a loop that keeps 1,200 runs on; its outputs come
    # as private copies once its output memory is all held.
    daemon = start_daemon(short_tmp, "--input-memory", "4M", "--pool-bytes", "8M")
    length = 1200 * BATCH
    try:
        before = _rss_anon(daemon.daemon_pid())
        with dalid.connect(socket=daemon.socket, autostart=False, name="keeper") as session:
            proxy = session.proxy(_doubling_pipeline())
            loader = dalid.DataLoader(
                session, _PlaneDataset(proxy, length), batch_size=BATCH, num_workers=2
            )
            kept = list(loader)
            assert len(kept) == 1200
            seen = torch.cat([indices for _, indices in kept])
            assert sorted(seen.tolist()) == list(range(length))
            for outputs, indices in kept[::97]:
                expected = indices.to(torch.float32).mul(2.0).reshape(-1, 1, 1)
                assert torch.equal(outputs, expected.expand(-1, 64, 64))
            (job,) = daemon.status().jobs
            assert job.batches_copied > 1000
            job_id = session.job_id
            del kept, loader
            gc.collect()
        wait_for(lambda: not daemon.job_segments(job_id), 10, "the keeping job's memory to go")
        # Three more jobs, one after the other, each served its epoch: nothing the first left
        # behind counts against them.
        for number in range(3):
            with dalid.connect(socket=daemon.socket, autostart=False, name=f"next{number}") as s:
                loader = dalid.DataLoader(
                    s, _PlaneDataset(s.proxy(_doubling_pipeline()), 64), batch_size=BATCH
                )
                indices = [int(i) for _, batch_indices in loader for i in batch_indices]
                assert indices == list(range(64))
        wait_for(lambda: not daemon.status().jobs, 10, "the jobs to end")
        # The daemon's own heap is back near where it was (the kept outputs were the
        # trainer's; the inputs went back as each batch was delivered).
        grown = _rss_anon(daemon.daemon_pid()) - before
        assert grown < 64 << 20, f"the daemon's heap grew {grown >> 20} MiB"
    finally:
        assert daemon.stop() == 0
