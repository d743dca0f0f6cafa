"""Cohorts in a real daemon: jobs that submit batches of the same inputs get the outputs of one
run, a random augmentation included; a member whose inputs differ gets its own; a member's
death or stall costs the others nothing; another graph is refused; status shows it all."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import dalid.client as dalid
from dalid.protocol import CohortStatus, ErrorCode

from ..daemons import (
    DaemonProcess,
    kill_leftovers,
    module_daemon,
    own_directory,
    start_job,
)
from ..daemons import wait_for as wait_until
from .cohort_job import AHEAD, BATCH, augmenting, data, submit
from .helpers import run_in_process, two_output_pipeline

STATUS = (sys.executable, "-m", "dalid.server", "status", "--json")
# One batch's outputs: 8 float32 and 8 int32 samples of 96x96x1 (uint8 + 7 is int32 in DALI).
BATCH_BYTES = BATCH * 96 * 96 * 8


@pytest.fixture(scope="module")
def small_window() -> Iterator[DaemonProcess]:
    """A daemon whose cohorts hold 8 MiB of outputs, 4 MiB of them for trailing members."""
    with module_daemon("--cohort-memory", "8M") as running:
        yield running


@pytest.fixture(scope="module")
def no_room() -> Iterator[DaemonProcess]:
    """A daemon whose cohorts' memory holds no batch of these tests."""
    with module_daemon("--cohort-memory", "64K") as running:
        yield running


def test_a_run_the_cohorts_memory_cannot_hold_is_copied_to_each_member(
    no_room: DaemonProcess,
) -> None:
    batches = 4
    equal = 0
    with (
        dalid.connect(socket=no_room.socket, autostart=False, cohort="sweep-n") as first,
        dalid.connect(socket=no_room.socket, autostart=False, cohort="sweep-n") as second,
    ):
        proxies = [first.proxy(augmenting()), second.proxy(augmenting())]
        for number in range(batches):
            refs = [submit(proxy, 0, number) for proxy in proxies]
            produced = [s.produce_data(r) for s, r in zip((first, second), refs, strict=True)]
            equal += _digest(produced[0]) == _digest(produced[1])
            del produced
        cohort = _cohort(no_room, "sweep-n")
        assert cohort is not None
        # Nothing waits in the cohort's memory: a batch that arrives once its twin has run
        # runs again (other noise). One that arrived in time got a copy of the one run, noise
        # included: as many equal pairs as hits.
        assert equal >= 1 and cohort.hits == equal
        assert cohort.runs == 2 * batches - equal and cohort.copied == cohort.runs
        assert cohort.leased_bytes == 0


def _cohort(daemon: DaemonProcess, name: str) -> CohortStatus | None:
    return next((c for c in daemon.status().cohorts if c.name == name), None)


def _digest(outputs: Any) -> str:
    noisy, shifted = outputs
    return hashlib.sha256(noisy.numpy().tobytes() + shifted.numpy().tobytes()).hexdigest()


def test_members_get_the_outputs_of_one_run_random_augmentation_included(
    daemon: DaemonProcess,
) -> None:
    batches = 6
    with (
        dalid.connect(socket=daemon.socket, autostart=False, cohort="sweep-a") as first,
        dalid.connect(socket=daemon.socket, autostart=False, cohort="sweep-a") as second,
        dalid.connect(socket=daemon.socket, autostart=False) as outsider,
    ):
        proxies = [first.proxy(augmenting()), second.proxy(augmenting())]
        other = outsider.proxy(augmenting())
        outputs: list[list[str]] = [[], []]
        for number in range(batches):
            refs = [submit(proxy, 0, number) for proxy in proxies]
            for member, (session, ref) in enumerate(zip((first, second), refs, strict=True)):
                produced = session.produce_data(ref)
                outputs[member].append(_digest(produced))
                noisy, shifted = produced
                want = np.stack([data(0, number * BATCH + i) for i in range(BATCH)]) + 7
                np.testing.assert_array_equal(shifted.numpy(), want)
                del produced, noisy, shifted
            alone = outsider.produce_data(submit(other, 0, number))
            # The outsider ran the same inputs itself: other noise, so the members' equal
            # outputs came from one run, not from two runs that happened to agree.
            assert _digest(alone) != outputs[0][-1]
            del alone
        assert outputs[0] == outputs[1]
        assert len(set(outputs[0])) == batches
        cohort = _cohort(daemon, "sweep-a")
        assert cohort is not None
        assert cohort.jobs == tuple(sorted((first.job_id, second.job_id)))
        assert (cohort.runs, cohort.hits) == (batches, batches)
        assert cohort.hit_rate == pytest.approx(0.5)
        assert cohort.lag_batches == 0
        # Each member released every batch but its last one (its release goes with its next
        # message): the cohort's memory holds that one batch, for both.
        assert 0 < cohort.leased_bytes <= BATCH_BYTES
        report = json.loads(
            subprocess.run(
                [*STATUS, "--socket", str(daemon.socket)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        (shown,) = [c for c in report["cohorts"] if c["name"] == "sweep-a"]
        assert shown["hits"] == batches and shown["runs"] == batches
        assert sorted(shown["jobs"]) == sorted((first.job_id, second.job_id))
        assert {"lag_batches", "held_bytes", "window_bytes"} <= set(shown)
        text = subprocess.run(
            [STATUS[0], *STATUS[1:-1], "--socket", str(daemon.socket)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        text = " ".join(text.split())  # as wrapped for the terminal
        assert "cohort sweep-a: jobs" in text and "(50% hits); members 0 batches apart" in text
    wait_until(lambda: _cohort(daemon, "sweep-a") is None, 10, "the cohort to end")


def test_a_keeper_past_its_window_is_served_copies_of_the_cohorts_runs_not_runs_again(
    daemon: DaemonProcess,
) -> None:
    batches = 12
    with (
        dalid.connect(socket=daemon.socket, autostart=False, cohort="sweep-c") as leader,
        dalid.connect(socket=daemon.socket, autostart=False, cohort="sweep-c") as keeper,
    ):
        proxies = [leader.proxy(augmenting()), keeper.proxy(augmenting())]
        outputs: list[list[str]] = [[], []]
        kept = []
        for number in range(batches):
            for member, session in enumerate((leader, keeper)):
                produced = session.produce_data(submit(proxies[member], 0, number))
                outputs[member].append(_digest(produced))
                if session is keeper:
                    kept.append(produced)  # it keeps every output: its window fills for good
                del produced
        # Every batch ran once, for both: the keeper's batches past its window came as copies
        # of the leader's runs (the same noise), not as runs of their own.
        assert outputs[0] == outputs[1] and len(set(outputs[0])) == batches
        cohort = _cohort(daemon, "sweep-c")
        assert cohort is not None and (cohort.runs, cohort.hits) == (batches, batches)
        jobs = {job.job_id: job for job in daemon.status().jobs}
        copied = jobs[keeper.job_id].batches_copied
        assert 0 < copied < batches and jobs[leader.job_id].batches_copied == 0
        # It holds of the cohort's memory only the batches its window let it lease.
        assert cohort.leased_bytes <= (batches - copied + 1) * BATCH_BYTES
        # Each run is charged once, half to each: the keeper paid for no run of its own.
        assert jobs[keeper.job_id].run_seconds == pytest.approx(jobs[leader.job_id].run_seconds)
        del kept
    wait_until(lambda: _cohort(daemon, "sweep-c") is None, 10, "the cohort to end")


def test_a_member_whose_sampler_differs_gets_its_own_correct_outputs(
    daemon: DaemonProcess,
) -> None:
    with (
        dalid.connect(socket=daemon.socket, autostart=False, cohort="sweep-b") as first,
        dalid.connect(socket=daemon.socket, autostart=False, cohort="sweep-b") as second,
    ):
        proxies = [first.proxy(two_output_pipeline()), second.proxy(two_output_pipeline())]
        for number in range(4):
            for seed, (session, proxy) in enumerate(zip((first, second), proxies, strict=True)):
                batch = [data(seed + 1, number * BATCH + i).astype(np.int32) for i in range(BATCH)]
                ref = torch.utils.data.default_collate([proxy(sample) for sample in batch])
                scaled, shifted = session.produce_data(ref)
                want = run_in_process(two_output_pipeline(), [{"data": batch}])[0]
                np.testing.assert_allclose(scaled.numpy(), want[0], rtol=1e-6)
                np.testing.assert_array_equal(shifted.numpy(), want[1])
                del scaled, shifted
        cohort = _cohort(daemon, "sweep-b")
        assert cohort is not None and (cohort.runs, cohort.hits) == (8, 0)


def test_a_member_with_another_graph_is_refused_naming_the_cohort(daemon: DaemonProcess) -> None:
    with (
        dalid.connect(socket=daemon.socket, autostart=False, cohort="sweep-c") as first,
        dalid.connect(socket=daemon.socket, autostart=False, cohort="sweep-c") as second,
    ):
        first.proxy(augmenting())
        with pytest.raises(dalid.RequestError) as refused:
            second.proxy(two_output_pipeline())
        assert refused.value.code is ErrorCode.INVALID_PIPELINE
        assert "cohort 'sweep-c'" in str(refused.value) and "graph" in str(refused.value)
        # The same graph under another cohort name, or none, is served.
        second.proxy(two_output_pipeline(), cohort="sweep-d")
        cohort = _cohort(daemon, "sweep-c")
        assert cohort is not None and cohort.jobs == (first.job_id,)


def test_a_bad_sample_is_answered_by_each_members_own_policy(daemon: DaemonProcess) -> None:
    from .test_bad_samples import as_array, encode
    from .test_shared_pipelines import decoding

    indices = list(range(BATCH))
    jpegs = [encode(i) for i in indices]
    jpegs[2] = jpegs[2][: len(jpegs[2]) // 3]  # truncated: a bad sample
    with (
        dalid.connect(socket=daemon.socket, autostart=False, cohort="sweep-e") as skipping,
        dalid.connect(socket=daemon.socket, autostart=False, cohort="sweep-e") as raising,
    ):
        proxies = [skipping.proxy(decoding(), on_error="skip"), raising.proxy(decoding())]
        refs = [
            torch.utils.data.default_collate([proxy(as_array(jpeg)) for jpeg in jpegs])
            for proxy in proxies
        ]
        images = skipping.produce_data(refs[0])
        kept = [as_array(jpeg) for i, jpeg in enumerate(jpegs) if i != 2]
        np.testing.assert_array_equal(
            images.numpy(), run_in_process(decoding(), [{"jpegs": kept}])[0][0]
        )
        assert [bad.position for bad in skipping.last_bad_samples] == [2]
        with pytest.raises(dalid.BatchError) as failed:
            raising.produce_data(refs[1])
        assert failed.value.code is ErrorCode.BAD_SAMPLES
        del images
        # A clean batch after it is shared again.
        good = [as_array(encode(i)) for i in indices]
        refs = [
            torch.utils.data.default_collate([proxy(jpeg) for jpeg in good]) for proxy in proxies
        ]
        first, second = (s.produce_data(r) for s, r in zip((skipping, raising), refs, strict=True))
        np.testing.assert_array_equal(first.numpy(), second.numpy())
        del first, second
        cohort = _cohort(daemon, "sweep-e")
        assert cohort is not None and cohort.hits >= 1


def _lines(job: subprocess.Popen[str]) -> list[dict[str, Any]]:
    out, _ = job.communicate(timeout=120)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _start_together(daemon: DaemonProcess, *jobs_args: tuple[str, ...]) -> list[Any]:
    """Member processes that register, then start their first batch together."""
    directory = own_directory()
    go = directory / "go"
    jobs = [
        start_job("cohort_job", daemon.socket, *args, "--start-when", str(go)) for args in jobs_args
    ]
    try:
        for job in jobs:
            assert job.stdout is not None
            assert '"job"' in job.stdout.readline()
        go.touch()
    except BaseException:
        kill_leftovers(jobs)
        raise
    finally:
        pass
    return [jobs, directory]


def test_killing_a_member_mid_epoch_costs_the_others_nothing(daemon: DaemonProcess) -> None:
    batches = 12
    member = ("--cohort", "sweep-k", "--batches", str(batches))
    jobs, directory = _start_together(daemon, member, member, (*member, "--die-after", "4"))
    try:
        results = [_lines(job) for job in jobs]
        assert jobs[2].returncode == -9
        survivors = results[:2]
        for lines in results:
            assert not [line for line in lines if "wrong" in line]
        for lines in survivors:
            assert lines[-1] == {"done": batches}, lines
        digests = [[line["digest"] for line in lines if "digest" in line] for lines in survivors]
        assert len(digests[0]) == batches and digests[0] == digests[1]
        assert [line["digest"] for line in results[2] if "digest" in line] == digests[0][:5]
    finally:
        kill_leftovers(jobs)
        shutil.rmtree(directory, ignore_errors=True)
    # Every job is gone, the killed one's leases included: the cohort and its memory end.
    wait_until(lambda: _cohort(daemon, "sweep-k") is None, 15, "the cohort to end")
    assert not daemon.status().jobs


def _lines_until_done(job: subprocess.Popen[str]) -> list[dict[str, Any]]:
    assert job.stdout is not None
    lines: list[dict[str, Any]] = []
    while not lines or "done" not in lines[-1]:
        line = job.stdout.readline()
        assert line, f"the job ended before it was done: {lines}"
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def test_a_stalled_member_holds_no_more_than_its_bound_and_stalls_no_one(
    small_window: DaemonProcess,
) -> None:
    batches = 24
    end = own_directory() / "end"
    member = ("--cohort", "sweep-s", "--batches", str(batches), "--end-when", str(end))
    jobs, directory = _start_together(small_window, (*member, "--stall-after", "1"), member, member)
    try:
        results = [_lines_until_done(job) for job in jobs[1:]]
        digests = [[line["digest"] for line in lines if "digest" in line] for lines in results]
        assert len(digests[0]) == len(digests[1]) == batches
        assert not [line for lines in results for line in lines if "wrong" in line]
        # They shared runs (on a loaded machine one may fall a window behind the other now and
        # then, and run a batch alone: equal outputs are not promised batch by batch).
        assert sum(a == b for a, b in zip(*digests, strict=True)) >= batches // 2
        cohort = _cohort(small_window, "sweep-s")
        assert cohort is not None and len(cohort.jobs) == 3 and jobs[0].poll() is None
        assert cohort.window_bytes == 4 << 20
        # Outputs the stalled member has not had wait for it within the window only; the
        # oldest were dropped, and its batches past them will run for it alone.
        assert 0 < cohort.held_bytes <= cohort.window_bytes and cohort.dropped > 0
        # Leased: the batch the stalled member consumed last and the two it holds ahead, and
        # the last batch of each other member (released with its next message).
        assert cohort.leased_bytes <= 5 * BATCH_BYTES
        # It was served the batches it submitted before it stalled (AHEAD past its last).
        assert cohort.lag_batches == batches - (AHEAD + 1)
        end.touch()
        for job in jobs[1:]:
            job.communicate(timeout=30)
            assert job.returncode == 0
    finally:
        kill_leftovers(jobs)
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(end.parent, ignore_errors=True)
    wait_until(lambda: _cohort(small_window, "sweep-s") is None, 15, "the cohort to end")


def test_a_member_that_keeps_its_outputs_holds_no_more_than_its_window_of_the_cohorts(
    daemon: DaemonProcess,
) -> None:
    batches = 36
    end = own_directory() / "end"
    member = ("--cohort", "sweep-w", "--batches", str(batches), "--end-when", str(end))
    jobs, directory = _start_together(daemon, (*member, "--keep"), member)
    try:
        results = [_lines_until_done(job) for job in jobs]
        for lines in results:
            assert not [line for line in lines if "wrong" in line]
            assert len([line for line in lines if "digest" in line]) == batches
        cohort = _cohort(daemon, "sweep-w")
        assert cohort is not None and cohort.hits > 0
        # The keeper holds all its outputs, but of the cohort's memory no more than its window
        # of batches served from the others' runs and of its own runs (a few each), and the
        # other member's last: the rest came to it in its own memory.
        assert cohort.leased_bytes <= 16 * BATCH_BYTES < batches * BATCH_BYTES // 2
        end.touch()
        for job in jobs:
            job.communicate(timeout=30)
            assert job.returncode == 0
    finally:
        kill_leftovers(jobs)
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(end.parent, ignore_errors=True)
    wait_until(lambda: _cohort(daemon, "sweep-w") is None, 15, "the cohort to end")


def test_a_member_past_the_window_gets_every_batch_ranked_behind_and_frees_all_when_killed(
    small_window: DaemonProcess,
) -> None:
    batches = 24
    control = own_directory()
    end, resume = control / "end", control / "resume"
    member = ("--cohort", "sweep-b", "--batches", str(batches), "--end-when", str(end))
    trailing = (*member, "--pause-after", "1", "--resume-when", str(resume))
    jobs, directory = _start_together(small_window, trailing, member, member)
    try:
        leaders = [_lines_until_done(job) for job in jobs[1:]]
        digests = [line["digest"] for line in leaders[0] if "digest" in line]
        assert len(digests) == batches
        cohort = _cohort(small_window, "sweep-b")
        # The leaders went on: outputs the paused member had not had left the window unserved.
        assert cohort is not None and cohort.dropped > 0 and cohort.behind == ()
        resume.touch()
        lines = _lines_until_done(jobs[0])
        # Past the window it still gets every batch, each with its correct outputs.
        assert not [line for line in lines if "wrong" in line]
        own = [line["digest"] for line in lines if "digest" in line]
        assert len(own) == batches
        # Those served before it paused came from the leaders' runs.
        assert own[:2] == digests[:2]
        cohort = _cohort(small_window, "sweep-b")
        assert cohort is not None and len(cohort.jobs) == 3
        # Its batches whose entries had gone ran for it alone, ranked behind the others'; it
        # caught up with the leaders' newest outputs, still in the window, and is back in rank.
        assert cohort.behind_runs > 0 and cohort.behind == ()
        assert cohort.behind_runs <= batches - (AHEAD + 1)
        assert own[-1] == digests[-1]
        report = subprocess.run(
            [*STATUS[:-1], "--socket", str(small_window.socket)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        report = " ".join(report.split())  # as wrapped for the terminal
        assert f"{cohort.behind_runs} batches ran for members past the window" in report
        # kill -9 of it: it leaves the cohort, nothing of it stays ranked or leased.
        jobs[0].kill()
        jobs[0].communicate(timeout=30)
        wait_until(
            lambda: (c := _cohort(small_window, "sweep-b")) is not None and len(c.jobs) == 2,
            15,
            "the killed member to leave",
        )
        cohort = _cohort(small_window, "sweep-b")
        assert cohort is not None and cohort.behind == ()
        end.touch()
        for job in jobs[1:]:
            job.communicate(timeout=30)
            assert job.returncode == 0
    finally:
        kill_leftovers(jobs)
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(control, ignore_errors=True)
    wait_until(lambda: _cohort(small_window, "sweep-b") is None, 15, "the cohort to end")


def test_a_cohorts_pipeline_runs_one_batch_a_run(daemon: DaemonProcess) -> None:
    # Under --run-batches auto (the default), a pipeline a cohort member starts runs one batch
    # a run: its members' batches run once for all, so a run of several would only pack one
    # member's batches ahead, and DALI keeps buffers for the largest run it has seen.
    with (
        dalid.connect(socket=daemon.socket, autostart=False, cohort="sweep-r") as first,
        dalid.connect(socket=daemon.socket, autostart=False, cohort="sweep-r") as second,
    ):
        proxies = [first.proxy(augmenting()), second.proxy(augmenting())]
        # Each member's batches queued together, as a DataLoader's prefetching sends them.
        refs = [[submit(proxy, 0, number) for number in range(AHEAD)] for proxy in proxies]
        produced = [
            [_digest(session.produce_data(ref)) for ref in member_refs]
            for session, member_refs in zip((first, second), refs, strict=True)
        ]
        assert produced[0] == produced[1]
        members = {first.job_id, second.job_id}
        (pipeline,) = [p for p in daemon.status().pipelines if members & set(p.jobs)]
        assert pipeline.run_size == BATCH
        assert (pipeline.runs, pipeline.samples) == (AHEAD, AHEAD * BATCH)
    wait_until(lambda: _cohort(daemon, "sweep-r") is None, 10, "the cohort to end")
