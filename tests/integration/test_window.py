"""A job's window (Note [A job's window] in dalid.server.runs.run_planner): the daemon holds a
few batches of a job at once, runs the one the trainer names first, and its output memory stays the
size of those few batches, with no private copies, whatever order the batches arrive in."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dalid.client as dalid
from dalid.protocol import ErrorCode, WantBatch
from dalid.server.runs.job_window import TRAINER_HOLDS

from ..daemons import DaemonProcess, start_daemon, wait_for
from .helpers import BATCH, run_in_process, two_output_pipeline

MiB = 1 << 20
PREFETCH = 1
WINDOW = PREFETCH + TRAINER_HOLDS
# Each output of a batch is 8 samples of 128 KiB: one MiB, and one slab (--slab-bytes 1M).
BATCH_BYTES = 2 * MiB
BATCHES = 10


def big_sample(index: int) -> np.ndarray:
    return np.full((256, 128), index, dtype=np.int32)


def submit(proxy: Any, first: int) -> Any:
    """One batch's references, submitted by this process (as a DataLoader worker does)."""
    return torch.utils.data.default_collate([proxy(big_sample(first + i)) for i in range(BATCH)])


def start(directory: Path) -> DaemonProcess:
    # One DALI instance: WINDOW is its prefetch and the batch the trainer holds.
    return start_daemon(directory, "--slab-bytes", "1M", "--instances", "1")


def test_batches_the_trainer_takes_in_the_reverse_order_arrive_without_copies(
    short_tmp: Path,
) -> None:
    daemon = start(short_tmp)
    try:
        with dalid.connect(socket=daemon.socket, autostart=False, name="reversed") as session:
            proxy = session.proxy(two_output_pipeline(prefetch_queue_depth=PREFETCH))
            batches = [submit(proxy, number * BATCH) for number in range(BATCHES)]
            # The first batches submitted are the last the trainer takes: they fill the window
            # while the batch the trainer waits for is still queued behind them.
            for number in reversed(range(BATCHES)):
                # produce_data fills the collated list in place: popped, it dies with the step.
                # The last step's tensors live on while the trainer waits, as in a loop.
                scaled, shifted = session.produce_data(batches.pop())
                first = number * BATCH
                expected = np.stack([big_sample(first + i) for i in range(BATCH)])
                np.testing.assert_array_equal(shifted.numpy(), expected + 7)
                np.testing.assert_array_equal(scaled.numpy(), expected * 0.5 + 1.0)
            del scaled, shifted
            (job,) = daemon.status().jobs
            assert job.batches_done == BATCHES
            assert job.batches_copied == 0
            # The window, the batch the trainer holds and the one it waits for (the memory a
            # window implies: docs/design/job-window.md); in
            # arrival order the daemon would have run all ten into its 1 GiB of output memory.
            assert job.peak_slab_bytes <= (WINDOW + TRAINER_HOLDS + 1) * BATCH_BYTES
            assert job.slab_bytes == job.peak_slab_bytes
    finally:
        assert daemon.stop() == 0, daemon.log_text()


@pytest.mark.parametrize(
    ("instances", "fits"), [(2, 4), (1, 3)], ids=["two-instances", "small-quota"]
)
def test_a_window_stays_within_what_the_jobs_memory_holds(
    short_tmp: Path, instances: int, fits: int
) -> None:
    # DALI instances prefetching two runs each make the pipeline's window 3 or 5; the job's
    # output memory holds 3 or 4 batches. Wider than that (a window no wider than the memory:
    # docs/design/job-window.md), the window let
    # in batches that filled the memory while the batch the trainer waits for was queued behind
    # them: the executor waited a second for a release that could not come, then sent a
    # private copy.
    daemon = start_daemon(
        short_tmp,
        "--slab-bytes",
        "1M",
        "--instances",
        str(instances),
        "--pool-bytes",
        f"{fits * BATCH_BYTES // MiB}M",
    )
    try:
        with dalid.connect(socket=daemon.socket, autostart=False, name="narrow") as session:
            proxy = session.proxy(two_output_pipeline(prefetch_queue_depth=2))
            wait_for(
                lambda: daemon.status().pipelines[0].instances == instances, 30, "the instances"
            )
            batches = [submit(proxy, number * BATCH) for number in range(BATCHES)]
            for number in reversed(range(BATCHES)):
                scaled, shifted = session.produce_data(batches.pop())
                expected = np.stack([big_sample(number * BATCH + i) for i in range(BATCH)])
                np.testing.assert_array_equal(shifted.numpy(), expected + 7)
            del scaled, shifted
            (job,) = daemon.status().jobs
            assert job.batches_done == BATCHES
            assert job.batches_copied == 0
            assert job.peak_slab_bytes <= fits * BATCH_BYTES
    finally:
        assert daemon.stop() == 0, daemon.log_text()


def test_a_dataloader_with_many_workers_gets_every_batch_without_copies(short_tmp: Path) -> None:
    daemon = start(short_tmp)
    try:
        with dalid.connect(socket=daemon.socket, autostart=False, name="workers") as session:
            proxy = session.proxy(two_output_pipeline(prefetch_queue_depth=PREFETCH))
            loader = dalid.DataLoader(
                session, BigDataset(proxy, 4 * BATCHES * BATCH), batch_size=BATCH, num_workers=4
            )
            assert checked_epoch(loader) == list(range(4 * BATCHES * BATCH))
            (job,) = daemon.status().jobs
            assert job.batches_copied == 0
            assert job.peak_slab_bytes <= (WINDOW + TRAINER_HOLDS + 1) * BATCH_BYTES
    finally:
        assert daemon.stop() == 0, daemon.log_text()


def test_loops_that_leave_their_epoch_early_do_not_fill_the_window(short_tmp: Path) -> None:
    # Each `for ... break` drops its iterator: its workers leave with batches submitted that the
    # trainer never asks for. Those the daemon had delivered waited unclaimed in the trainer; as
    # long as they counted in the window, a few such loops filled it, and the next loop's
    # first batch waited for good. Now they leave the window, and the trainer lets them go.
    daemon = start(short_tmp)
    try:
        with dalid.connect(socket=daemon.socket, autostart=False, name="breaks") as session:
            proxy = session.proxy(two_output_pipeline(prefetch_queue_depth=PREFETCH))
            loader = dalid.DataLoader(
                session, BigDataset(proxy, 4 * BATCHES * BATCH), batch_size=BATCH, num_workers=4
            )
            for _ in range(6):
                checked_epoch(loader, batches=1)
            assert checked_epoch(loader) == list(range(4 * BATCHES * BATCH))
            # The results the dropped iterators left unclaimed went back once their workers
            # left: the job holds the last batch or two, and its memory never held more than a
            # few loops' worth (kept, six loops left 48 batches and 92 regions behind).
            (job,) = daemon.status().jobs
            assert job.regions_held <= 2 * (WINDOW + TRAINER_HOLDS + 1), job
            left_per_loop = 4 * 2  # workers x prefetch_factor
            assert job.peak_slab_bytes <= (WINDOW + 2 + 3 * left_per_loop) * BATCH_BYTES, job
    finally:
        assert daemon.stop() == 0, daemon.log_text()


def test_the_batch_the_trainer_waits_for_passes_the_jobs_in_flight_limit(
    short_tmp: Path,
) -> None:
    daemon = start(short_tmp)
    try:
        with dalid.connect(
            socket=daemon.socket, autostart=False, name="limited", max_inflight_batches=1
        ) as session:
            proxy = session.proxy(two_output_pipeline(prefetch_queue_depth=PREFETCH))
            batches = [submit(proxy, number * BATCH) for number in range(WINDOW + 2)]
            # The first batches ran and fill the window, delivered; the next one waits in it
            # for a release, the job's one batch in flight; the last waits behind that limit.
            wait_for(
                lambda: (
                    [(j.batches_done, j.queued, j.waiting) for j in daemon.status().jobs]
                    == [(WINDOW, 1, 1)]
                ),
                60,
                "the window and the in-flight limit to fill",
            )
            # The trainer takes the last first: it passes the limit and the window.
            for number in reversed(range(WINDOW + 2)):
                _, shifted = session.produce_data(batches.pop())
                first = number * BATCH
                expected = np.stack([big_sample(first + i) for i in range(BATCH)])
                np.testing.assert_array_equal(shifted.numpy(), expected + 7)
            (job,) = daemon.status().jobs
            assert job.batches_copied == 0, job
    finally:
        assert daemon.stop() == 0, daemon.log_text()


def test_a_batch_asked_for_after_its_worker_left_and_its_result_was_let_go_fails(
    short_tmp: Path,
) -> None:
    daemon = start(short_tmp)
    try:
        with dalid.connect(socket=daemon.socket, autostart=False, name="late") as session:
            proxy = session.proxy(two_output_pipeline(prefetch_queue_depth=PREFETCH))
            # torch's own loader: its workers submit, and the references reach this process
            # as they are, unproduced.
            loader = torch.utils.data.DataLoader(
                BigDataset(proxy, 4 * BATCH), batch_size=BATCH, num_workers=2
            )
            iterator = iter(loader)
            refs = [next(iterator) for _ in range(4)]
            del iterator  # its workers leave, with no batch asked for yet
            wait_for(
                lambda: [(j.workers, j.batches_done) for j in daemon.status().jobs] == [(0, 4)],
                60,
                "the four batches to run and the workers to leave",
            )
            # A batch of the trainer's own, asked for last, so that everything the daemon sent
            # before has been read: the four results and that their workers left.
            session.produce_data(submit(proxy, 1000))
            (_, shifted), indices = session.produce_data(refs[1])
            np.testing.assert_array_equal(
                shifted.numpy(), np.stack([big_sample(int(i)) for i in indices]) + 7
            )
            # Asking for that batch let go of the others: their workers will not ask.
            with pytest.raises(dalid.BatchError, match="left before the trainer asked") as error:
                session.produce_data(refs[0])
            assert error.value.code is ErrorCode.UNKNOWN_BATCH
            # The releases travel on the trainer's link, the status on another: wait for them.
            wait_for(
                lambda: daemon.status().jobs[0].regions_held <= 2 * 2,  # the two batches above
                30,
                "the results let go of to be released",
            )
    finally:
        assert daemon.stop() == 0, daemon.log_text()


def checked_epoch(loader: Any, batches: int | None = None) -> list[int]:
    """The dataset indices of a loop over ``loader`` (left after ``batches``, if given), each
    batch's outputs checked against its samples."""
    seen: list[int] = []
    for step, ((_, shifted), indices) in enumerate(loader, start=1):
        expected = np.stack([big_sample(int(i)) for i in indices])
        np.testing.assert_array_equal(shifted.numpy(), expected + 7)
        seen.extend(indices.tolist())
        if step == batches:
            break
    return seen


class BigDataset(torch.utils.data.Dataset[tuple[Any, int]]):
    def __init__(self, proxy: Any, length: int) -> None:
        self.proxy = proxy
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.proxy(big_sample(index)), index


def test_wants_for_batches_the_job_does_not_hold_are_ignored(short_tmp: Path) -> None:
    daemon = start(short_tmp)
    try:
        with (
            dalid.connect(socket=daemon.socket, autostart=False, name="other") as other,
            dalid.connect(socket=daemon.socket, autostart=False, name="wanting") as session,
        ):
            theirs = submit(other.proxy(two_output_pipeline()), 0)
            proxy = session.proxy(two_output_pipeline(prefetch_queue_depth=PREFETCH))
            delivered = submit(proxy, 0)
            wanted = [
                theirs[0].pipe_run_ref.batch_id,  # another job's
                delivered[0].pipe_run_ref.batch_id,  # delivered already
                0,
                2**63 - 1,
            ]
            session.produce_data(delivered)
            del delivered
            link = session._daemon.link
            for batch_id in wanted:
                link.notify(WantBatch(batch_id))
            rss = daemon.rss_bytes()
            for batch_id in range(1, 20001):  # a flood of wants for batches it never sent
                link.notify(WantBatch(batch_id * 7919))
            gc.collect()
            # It serves on: the next batches come, in order, right.
            for number in range(3):
                scaled, shifted = session.produce_data(submit(proxy, number * BATCH))
                (expected,) = run_in_process(
                    two_output_pipeline(),
                    [{"data": [big_sample(number * BATCH + i) for i in range(BATCH)]}],
                )
                np.testing.assert_array_equal(scaled.numpy(), expected[0])
            assert daemon.rss_bytes() - rss < 32 * MiB  # nothing grew with the wants
            other.produce_data(theirs)
            del theirs, scaled, shifted
            status = {job.name: job for job in daemon.status().jobs}
            assert status["wanting"].batches_done == 4
            assert status["wanting"].batches_failed == 0
            assert status["other"].batches_done == 1
    finally:
        assert daemon.stop() == 0, daemon.log_text()
    assert "Traceback" not in daemon.log_text()
