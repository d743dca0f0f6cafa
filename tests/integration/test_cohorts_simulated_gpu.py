"""A cohort's GPU outputs on a real daemon whose GPU is simulated (tests/simulated_gpu.py): the
members' batches of the same inputs run once, and every member maps the same region of the
cohort's device memory by its IPC handle, with no copy (Note [Cohort outputs] in cohorts.py).

The daemon process, its sockets, executors, DALI and shared memory are real; only the CUDA calls
are simulated, on both sides ("device memory" is shared-memory segments, an "IPC handle" their
name), so a tensor tells which segment and offset it views. The same on a real GPU:
tests/integration/test_cohorts_gpu.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import dalid.client as dalid
from dalid.client.outputs import cuda_device
from dalid.client.outputs import cuda_staged as staged
from dalid.protocol import CohortStatus

from ..daemons import DaemonProcess, kill_leftovers, own_directory, start_daemon, wait_for
from ..simulated_gpu import TO_HOST, SimulatedDevices
from .cohort_job import augmenting
from .cohort_job import submit as cohort_submit
from .helpers import BATCH, run_in_process, sample, two_output_pipeline
from .test_cohorts import BATCH_BYTES as COHORT_JOB_BATCH_BYTES
from .test_cohorts import _digest, _lines, _lines_until_done, _start_together
from .test_many_jobs import _free_port

# One batch's outputs: 8 samples of 4x3 float32 (the simulated GPU output) and 4x3 int32.
OUTPUT_BYTES = BATCH * 12 * 4


def _simulated_daemon(*args: str) -> Iterator[DaemonProcess]:
    directory = own_directory()
    running = start_daemon(directory, "--device", "0", *args, module="tests.simulated_gpu")
    try:
        yield running
    finally:
        code = running.stop()
        log = running.log_text()
        segments = running.segments()  # its shared memory and its simulated GPU memory
        shutil.rmtree(directory, ignore_errors=True)
        assert code == 0, f"daemon exited with {code}:\n{log}"
        assert not segments, f"daemon left shared memory: {segments}"


METRICS_PORT = _free_port()


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    """A simulated GPU daemon whose cohorts hold 8 KiB of each kind of output memory: some 16
    regions of these tests' outputs, so that their regions are reused within a test."""
    yield from _simulated_daemon(
        "--pool-bytes",
        "16K",
        "--slab-bytes",
        "4K",
        "--cohort-memory",
        "8K",
        "--metrics-port",
        str(METRICS_PORT),
    )


@pytest.fixture(scope="module")
def roomy() -> Iterator[DaemonProcess]:
    """A simulated GPU daemon of the default memory: room for the cohort jobs' larger outputs."""
    yield from _simulated_daemon()


@pytest.fixture
def trainer_gpu(monkeypatch: pytest.MonkeyPatch) -> SimulatedDevices:
    """This process's GPUs: the simulated daemon's, CUDA IPC working."""
    devices = SimulatedDevices()
    monkeypatch.setattr(cuda_device, "DEVICES", devices)
    monkeypatch.setattr(staged, "_probed", {})
    return devices


def _member(daemon: DaemonProcess, cohort: str) -> dalid.Session:
    return dalid.connect(socket=daemon.socket, autostart=False, cohort=cohort)


def _cohort(daemon: DaemonProcess, name: str) -> CohortStatus | None:
    return next((c for c in daemon.status().cohorts if c.name == name), None)


def _reference(batches: int) -> list[list[np.ndarray]]:
    return run_in_process(
        two_output_pipeline(prefetch_queue_depth=1),
        [{"data": [sample(n * BATCH + i) for i in range(BATCH)]} for n in range(batches)],
    )


def _submit(proxy: dalid.Proxy, number: int) -> Any:
    return torch.utils.data.default_collate(
        [proxy(sample(number * BATCH + i)) for i in range(BATCH)]
    )


def _region(devices: SimulatedDevices, tensor: torch.Tensor) -> tuple[str, int]:
    """The daemon's device region ``tensor`` views (slab handle, offset), in whichever of this
    process's trainers mapped it; fails for a tensor that is a copy."""
    for device in devices.opened:
        try:
            return device.region_of(tensor)
        except ValueError:
            continue
    raise AssertionError("the GPU output is a copy, not a view of the daemon's memory")


def _scrape() -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5) as reply:
        body: bytes = reply.read()
        return body.decode()


def _gpu_segments(daemon: DaemonProcess) -> set[str]:
    return {name for name in daemon.segments() if "simgpu" in name}


def test_every_member_maps_the_same_gpu_region_of_one_run_and_nothing_is_copied(
    daemon: DaemonProcess, trainer_gpu: SimulatedDevices
) -> None:
    batches = 6
    reference = _reference(batches)
    before = _gpu_segments(daemon)
    with _member(daemon, "gpu-a") as first, _member(daemon, "gpu-a") as second:
        sessions = (first, second)
        proxies = [session.proxy(two_output_pipeline()) for session in sessions]
        handles = set()
        for number, want in enumerate(reference):
            refs = [_submit(proxy, number) for proxy in proxies]
            outputs = [
                session.produce_data(ref) for session, ref in zip(sessions, refs, strict=True)
            ]
            regions = []
            for scaled, shifted in outputs:
                np.testing.assert_array_equal(scaled.numpy(), want[0])  # as a solo run
                np.testing.assert_array_equal(shifted.numpy(), want[1])
                regions.append(_region(trainer_gpu, scaled))
            # One run, one region of the cohort's GPU memory, viewed by both members.
            assert regions[0] == regions[1]
            handles.add(regions[0][0])
            del outputs, scaled, shifted, refs  # a ref holds its batch's outputs
        cohort = _cohort(daemon, "gpu-a")
        assert cohort is not None
        assert (cohort.runs, cohort.hits, cohort.copied) == (batches, batches, 0)
        assert cohort.device_bytes > 0
        jobs = {job.job_id: job for job in daemon.status().jobs}
        for session in sessions:
            assert jobs[session.job_id].output_path == "cuda_ipc"
            assert jobs[session.job_id].batches_copied == 0
        assert all(device.uploads == 0 for device in trainer_gpu.opened)
        # The metrics say so too (a snapshot the daemon refreshes every second).
        labels = 'cohort="gpu-a",device="gpu0"'
        wait_for(
            lambda: f"dalid_cohort_hits_total{{{labels}}} {float(batches)}" in _scrape(),
            10,
            "the cohort's hits in the metrics",
        )
        text = _scrape()
        assert f"dalid_cohort_copied_total{{{labels}}} 0.0" in text
        assert f"dalid_cohort_device_bytes{{{labels}}} {float(cohort.device_bytes)}" in text
        shown = subprocess.run(
            [sys.executable, "-m", "dalid.server", "status", "--socket", str(daemon.socket)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "of GPU memory of at most 8.0K, mapped by every member" in " ".join(shown.split())
        # Each member opened each of the cohort's slabs once, whatever the batches.
        assert first.slabs_opened == second.slabs_opened
    wait_for(lambda: _cohort(daemon, "gpu-a") is None, 10, "the cohort to end")
    # Both trainers said goodbye having unmapped its slabs (this process lives on): the
    # cohort's GPU memory is freed at once, not when this process exits.
    wait_for(lambda: _gpu_segments(daemon) <= before, 10, "the cohort's GPU memory to be freed")


def test_a_gpu_region_returns_to_the_cohorts_pool_only_once_the_last_member_released_it(
    daemon: DaemonProcess, trainer_gpu: SimulatedDevices
) -> None:
    batches = 24  # the cohort's pool holds 16 of them: its regions are reused
    reference = _reference(batches)
    with _member(daemon, "gpu-b") as first, _member(daemon, "gpu-b") as second:
        proxies = [first.proxy(two_output_pipeline()), second.proxy(two_output_pipeline())]
        refs = [_submit(proxy, 0) for proxy in proxies]
        held, _ = first.produce_data(refs[0])  # the first member keeps batch 0
        region = _region(trainer_gpu, held)
        produced = second.produce_data(refs[1])
        assert _region(trainer_gpu, produced[0]) == region
        del produced  # the second member releases it (with its next message)
        later = []
        for number in range(1, batches):
            refs = [_submit(proxy, number) for proxy in proxies]
            for session, ref in zip((first, second), refs, strict=True):
                scaled, _ = session.produce_data(ref)
                later.append(_region(trainer_gpu, scaled))
                del scaled
            if number == 2:
                # Both members' later batches came back, the held one did not: it stays
                # leased, its bytes counted, for the member that still holds it.
                cohort = _cohort(daemon, "gpu-b")
                assert cohort is not None and cohort.leased_bytes >= OUTPUT_BYTES
        # Never handed out again while the first member held it, nor overwritten.
        assert region not in later
        np.testing.assert_array_equal(held.numpy(), reference[0][0])
        del held
        for number in range(batches, batches + 16):
            refs = [_submit(proxy, number) for proxy in proxies]
            for session, ref in zip((first, second), refs, strict=True):
                scaled, _ = session.produce_data(ref)
                later.append(_region(trainer_gpu, scaled))
                del scaled
        # Released by both, it went back to the pool, which gave it to a later run.
        assert region in later[2 * (batches - 1) :]
    wait_for(lambda: _cohort(daemon, "gpu-b") is None, 10, "the cohort to end")


def test_a_member_that_cannot_map_the_daemons_gpu_memory_gets_its_own_correct_outputs(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = 6
    reference = _reference(batches)
    sharing = SimulatedDevices()
    monkeypatch.setattr(cuda_device, "DEVICES", sharing)
    monkeypatch.setattr(staged, "_probed", {})
    with _member(daemon, "gpu-c") as first, _member(daemon, "gpu-c") as second:
        # As a trainer in a container without IPC: CUDA refuses the daemon's handles.
        monkeypatch.setattr(cuda_device, "DEVICES", SimulatedDevices(ipc=False))
        monkeypatch.setattr(staged, "_probed", {})
        with _member(daemon, "gpu-c") as third:
            sessions = (first, second, third)
            jobs = {job.job_id: job for job in daemon.status().jobs}
            assert jobs[third.job_id].output_path == "staged"
            proxies = [session.proxy(two_output_pipeline()) for session in sessions]
            for number, want in enumerate(reference):
                refs = [_submit(proxy, number) for proxy in proxies]
                outputs = [s.produce_data(r) for s, r in zip(sessions, refs, strict=True)]
                for scaled, shifted in outputs:
                    np.testing.assert_array_equal(scaled.numpy(), want[0])
                    np.testing.assert_array_equal(shifted.numpy(), want[1])
                # The others still map one region of one run.
                assert _region(sharing, outputs[0][0]) == _region(sharing, outputs[1][0])
                with pytest.raises(AssertionError, match="a copy"):
                    _region(sharing, outputs[2][0])  # uploaded from its own staged memory
                del outputs
            cohort = _cohort(daemon, "gpu-c")
            assert cohort is not None
            # Every batch ran once for the two that share; the third was written its own copy
            # of that run where it waited for it (a hit, ``copied``), or ran the batch alone
            # where it came later: each of its batches one or the other, never both.
            assert cohort.runs == batches and cohort.hits == batches + cohort.copied
            (pipeline,) = [p for p in daemon.status().pipelines if first.job_id in p.jobs]
            alone = batches - cohort.copied
            assert pipeline.samples == (cohort.runs + alone) * BATCH
    wait_for(lambda: _cohort(daemon, "gpu-c") is None, 10, "the cohort to end")


def test_killing_a_member_mid_epoch_frees_its_leases_and_the_others_finish(
    roomy: DaemonProcess,
) -> None:
    daemon = roomy
    before = _gpu_segments(daemon)
    batches = 12
    directory = own_directory()
    end = directory / "end"
    member = ("--cohort", "gpu-k", "--batches", str(batches), "--simulated-gpu")
    survivor = (*member, "--end-when", str(end))
    jobs, started = _start_together(daemon, survivor, survivor, (*member, "--die-after", "4"))
    try:
        survivors = [_lines_until_done(job) for job in jobs[:2]]
        killed = _lines(jobs[2])
        assert jobs[2].returncode == -9
        for lines in [*survivors, killed]:
            assert not [line for line in lines if "wrong" in line], lines
        digests = [[line["digest"] for line in lines if "digest" in line] for lines in survivors]
        assert len(digests[0]) == batches and digests[0] == digests[1]
        assert [line["digest"] for line in killed if "digest" in line] == digests[0][:5]

        def settled() -> bool:
            cohort = _cohort(daemon, "gpu-k")
            # The killed member's leases (the batch it held and those it had submitted ahead)
            # ended with its process; the others hold at most their last batch, one region.
            return (
                cohort is not None
                and len(cohort.jobs) == 2
                and cohort.leased_bytes <= COHORT_JOB_BATCH_BYTES
            )

        wait_for(settled, 15, "the killed member's leases to end")
        cohort = _cohort(daemon, "gpu-k")
        assert cohort is not None and cohort.copied == 0 and cohort.hits >= batches
        end.touch()
        for job in jobs[:2]:
            job.communicate(timeout=60)
            assert job.returncode == 0
    finally:
        kill_leftovers(jobs)
        shutil.rmtree(started, ignore_errors=True)
        shutil.rmtree(directory, ignore_errors=True)
    # Every member is gone: the cohort ends and its GPU memory is freed (what the killed
    # process mapped went with it).
    wait_for(lambda: _cohort(daemon, "gpu-k") is None, 15, "the cohort to end")
    wait_for(lambda: _gpu_segments(daemon) <= before, 10, "the cohort's GPU memory to be freed")
    assert not daemon.status().jobs


def test_a_keeper_past_its_window_is_served_copies_read_from_the_cohorts_gpu_memory(
    roomy: DaemonProcess, trainer_gpu: SimulatedDevices
) -> None:
    daemon = roomy
    batches = 12
    read_back = daemon.log_text().count(TO_HOST)
    with _member(daemon, "gpu-w") as leader, _member(daemon, "gpu-w") as keeper:
        proxies = [leader.proxy(augmenting()), keeper.proxy(augmenting())]
        outputs: list[list[str]] = [[], []]
        kept = []
        for number in range(batches):
            for member, session in enumerate((leader, keeper)):
                ref = cohort_submit(proxies[member], 0, number)
                produced = session.produce_data(ref)
                outputs[member].append(_digest(produced))
                if session is keeper:
                    kept.append(produced)  # it keeps every output: its window fills for good
                del produced, ref
        # One run of each batch (its random noise) for both: past its window the keeper got
        # copies of the leader's runs, its GPU output copied from the cohort's GPU memory; the
        # copies are its own, which the later runs into that memory did not change.
        assert outputs[0] == outputs[1] and len(set(outputs[0])) == batches
        assert [_digest(produced) for produced in kept] == outputs[1]
        cohort = _cohort(daemon, "gpu-w")
        assert cohort is not None and (cohort.runs, cohort.hits, cohort.copied) == (
            batches,
            batches,
            0,
        )
        jobs = {job.job_id: job for job in daemon.status().jobs}
        copied = jobs[keeper.job_id].batches_copied
        assert 0 < copied < batches and jobs[leader.job_id].batches_copied == 0
        # Each copy's GPU output stayed on the device: copied there by the keeper into a tensor
        # of its own, neither read back to the host by the daemon nor uploaded by the keeper.
        assert jobs[keeper.job_id].batches_copied_on_device == copied
        assert sum(device.copies for device in trainer_gpu.opened) == copied
        assert sum(device.uploads for device in trainer_gpu.opened) == 0
        assert daemon.log_text().count(TO_HOST) == read_back
        del kept
    wait_for(lambda: _cohort(daemon, "gpu-w") is None, 10, "the cohort to end")
