"""The session's logic through in-process links to a real daemon core: no process, no socket.

Ordering of results, releases of regions, reconnection to a restarted daemon (a new core on the
same path), resubmission of undelivered batches and workers rejoining as an earlier job. The
same paths over real sockets and daemon processes are in tests/integration (test_restarts.py,
test_end_to_end.py).
"""

from __future__ import annotations

import gc
import logging
import pickle
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from nvidia.dali import fn

from dalid.client import DaemonUnavailable, JobEnded, Session
from dalid.client import delivery as delivery_module
from dalid.client.worker.worker import Proxy
from dalid.protocol import ReleaseRegions, TrainerProgress, WantBatch
from tests.inproc import ServedCore

from ..dali_typing import pipeline_def

BATCH = 2


@pipeline_def(batch_size=4, num_threads=1, device_id=None)
def doubling() -> Any:
    return fn.external_source(name="x") * 2


def _sample(value: int) -> np.ndarray:
    return np.full((3,), value, dtype=np.float32)


def _batch(proxy: Proxy, first: int) -> Any:
    """One worker batch of samples first, first + 1, ... collated as a DataLoader would."""
    return torch.utils.data.default_collate([proxy(_sample(first + i)) for i in range(BATCH)])


def _values(output: torch.Tensor) -> list[int]:
    return [int(row[0]) // 2 for row in output]


@pytest.fixture
def daemon() -> Iterator[ServedCore]:
    # Never created: an in-process daemon answers on the path without a socket file.
    with ServedCore(Path(f"/tmp/dalid-inproc-{uuid.uuid4().hex[:8]}.sock")) as served:
        yield served


def _session(daemon: ServedCore, **options: Any) -> Session:
    return Session("cpu", socket=daemon.path, autostart=False, connect_timeout=10, **options)


def test_results_are_delivered_in_the_order_asked(daemon: ServedCore) -> None:
    with _session(daemon) as session:
        proxy = session.proxy(doubling())
        batches = [_batch(proxy, 10 * n) for n in range(4)]
        # The last first: the others arrive while the session waits, and wait for their turn.
        for n in [3, 0, 2, 1]:
            assert _values(session.produce_data(batches[n])) == [10 * n, 10 * n + 1]
        assert session.submitted_by_trainer == 0


def test_regions_go_back_to_the_daemon_when_their_tensors_die(daemon: ServedCore) -> None:
    with _session(daemon) as session:
        proxy = session.proxy(doubling())
        first = session.produce_data(_batch(proxy, 0))
        view = first[1:]
        del first
        gc.collect()
        assert session.live_regions == 1  # a view keeps the region
        second = session.produce_data(_batch(proxy, 2))  # its wait sends what was released
        assert daemon.job(session.job_id).regions_held == 2
        del view
        gc.collect()
        assert session.live_regions == 1
        third = session.produce_data(_batch(proxy, 4))
        assert daemon.job(session.job_id).regions_held == 2  # the second's and the third's
        assert _values(second) == [2, 3] and _values(third) == [4, 5]
        assert session.slabs_opened == 1  # one slab, mapped once


def _wants(daemon: ServedCore, since: int) -> tuple[list[int], list[int]]:
    """The batches the daemon was told a trainer waits for after its ``since``-th message: in
    releases, and in ``want_batch`` messages of their own."""
    later = daemon.received[since:]
    carried = [
        m.want_batch for m in later if isinstance(m, ReleaseRegions) and m.want_batch is not None
    ]
    alone = [m.batch_id for m in later if isinstance(m, WantBatch)]
    return carried, alone


def _batch_ids(session: Session, batches: list[Any]) -> list[int]:
    ids = [batch.pipe_run_ref.batch_id for batch in batches]
    assert all(isinstance(batch_id, int) for batch_id in ids)
    return ids


def test_a_batch_waited_for_is_named_in_the_release_sent_before_it(daemon: ServedCore) -> None:
    with _session(daemon) as session:
        proxy = session.proxy(doubling())
        assert _values(session.produce_data(_batch(proxy, 0))) == [0, 1]
        since = len(daemon.received)
        batches = [_batch(proxy, 10 * n) for n in range(1, 7)]
        for n, batch in enumerate(batches, start=1):
            # The last batch's tensor died: its region goes back before this one is waited for.
            assert _values(session.produce_data(batch)) == [10 * n, 10 * n + 1]
        carried, alone = _wants(daemon, since)
        # A result that came while the trainer was busy is not waited for, nor wanted.
        assert carried, "no batch was waited for"
        assert set(carried) <= set(_batch_ids(session, batches))
        assert alone == [], "a want went alone although a release went just before it"


def test_an_older_daemon_is_told_of_a_batch_waited_for_on_its_own() -> None:
    path = Path(f"/tmp/dalid-inproc-{uuid.uuid4().hex[:8]}.sock")
    with ServedCore(path, older_welcome=True) as daemon, _session(daemon) as session:
        proxy = session.proxy(doubling())
        since = len(daemon.received)
        batches = [_batch(proxy, 10 * n) for n in range(6)]
        for n, batch in enumerate(batches):
            assert _values(session.produce_data(batch)) == [10 * n, 10 * n + 1]
        carried, alone = _wants(daemon, since)
        assert carried == []  # it would not read them
        assert alone, "no batch was waited for"
        assert set(alone) <= set(_batch_ids(session, batches))


def _reports(daemon: ServedCore, since: int) -> tuple[list[TrainerProgress], list[int], int]:
    """The trainer's progress reports after the daemon's ``since``-th message, in order; the
    positions of those carried in releases; and how many went on their own just after a
    release (where the release could have carried them)."""
    reports: list[TrainerProgress] = []
    carried: list[int] = []
    after_release = 0
    previous = None
    for message in daemon.received[since:]:
        if isinstance(message, ReleaseRegions) and message.progress is not None:
            carried.append(len(reports))
            reports.append(message.progress)
        elif isinstance(message, TrainerProgress):
            after_release += isinstance(previous, ReleaseRegions)
            reports.append(message)
        previous = message
    return reports, carried, after_release


@pytest.mark.parametrize("older", [False, True], ids=["this-daemon", "older-daemon"])
def test_progress_rides_in_a_release_to_a_daemon_that_reads_it_there(
    older: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A report due when releases go is carried in the last of them, one message fewer; to an
    older daemon, which would ignore it there, it goes on its own. The daemon shows it."""
    monkeypatch.setattr(delivery_module, "PROGRESS_INTERVAL_S", 0.0)  # a report at every batch
    path = Path(f"/tmp/dalid-inproc-{uuid.uuid4().hex[:8]}.sock")
    with ServedCore(path, older_welcome=older) as daemon, _session(daemon) as session:
        proxy = session.proxy(doubling())
        since = len(daemon.received)
        for n in range(6):
            assert _values(session.produce_data(_batch(proxy, 10 * n))) == [10 * n, 10 * n + 1]
        reports, carried, after_release = _reports(daemon, since)
        assert len(reports) >= 3  # one at each batch once the trainer has waited
        if older:
            assert carried == []  # it would not read them
        else:
            assert carried, "no report rode in a release"
            assert after_release == 0, "a report went alone just after a release"
        assert daemon.job(session.job_id).trainer_wait_seconds == reports[-1].waited_seconds


def test_a_wait_is_reported_while_it_lasts_only_once_it_is_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wait of a few seconds (common with many jobs on a busy daemon) is reported with the
    next batch, in its release; one that goes on is reported while it lasts."""
    monkeypatch.setattr(delivery_module, "PROGRESS_INTERVAL_S", 0.0)
    progress = delivery_module._Progress()
    progress.waited, progress.batches = 2.0, 3
    assert progress.during_wait(delivery_module.LONG_WAIT_REPORTED_S / 2) is None
    long = delivery_module.LONG_WAIT_REPORTED_S + 1
    assert progress.during_wait(long) == TrainerProgress(2.0 + long, 3)
    assert progress.due() == TrainerProgress(2.0, 3)  # with the next batch


def test_a_restarted_daemon_gets_the_undelivered_batches_again(
    daemon: ServedCore, caplog: pytest.LogCaptureFixture
) -> None:
    with _session(daemon, reconnect=True) as session:
        # Deterministic: a batch runs when produce_data asks for it, so the second cannot have
        # run before the restart.
        proxy = session.proxy(doubling(), deterministic=True)
        first, second = _batch(proxy, 0), _batch(proxy, 2)
        delivered = session.produce_data(first)
        daemon.restart()
        assert _values(session.produce_data(second)) == [2, 3]
        assert session.reconnects == 1 and session.submitted_by_trainer == 1
        # Delivered by the daemon that is gone, and still readable.
        assert _values(delivered) == [0, 1]
        del delivered
        gc.collect()
        # The proxy points at the new registration: no batch of its goes through the trainer.
        assert _values(session.produce_data(_batch(proxy, 4))) == [4, 5]
        assert session.submitted_by_trainer == 1
    # The released region of the daemon that is gone went nowhere: the new one, which has
    # regions of the same ids, would have answered with an error.
    assert not [r for r in caplog.records if r.getMessage().startswith("dalid daemon:")]


def test_a_batch_a_worker_could_not_send_is_submitted_by_the_trainer(
    daemon: ServedCore,
) -> None:
    with _session(daemon, reconnect=True) as session:
        proxy = session.proxy(doubling())
        assert _values(session.produce_data(_batch(proxy, 0))) == [0, 1]
        daemon.stop()
        # A worker sends without waiting (Note [Submitting without waiting]): this batch goes
        # to the dead daemon under its id, and the next finds the daemon gone when it waits
        # for that batch's acknowledgment: no error, no batch id.
        lost = _batch(proxy, 2)
        assert lost.pipe_run_ref.batch_id is not None
        unsent = _batch(proxy, 4)
        assert unsent.pipe_run_ref.batch_id is None
        daemon.start()
        assert _values(session.produce_data(lost)) == [2, 3]
        assert _values(session.produce_data(unsent)) == [4, 5]
        assert session.reconnects == 1 and session.submitted_by_trainer == 2


def test_a_worker_of_the_earlier_job_joins_the_new_one(daemon: ServedCore) -> None:
    with _session(daemon, reconnect=True) as session:
        proxy = session.proxy(doubling())
        # What a DataLoader worker started before the restart holds: the first job's proxy.
        worker_proxy = pickle.loads(pickle.dumps(proxy))
        assert _values(session.produce_data(_batch(worker_proxy, 0))) == [0, 1]
        daemon.restart()
        lost = _batch(worker_proxy, 2)  # before the trainer reconnected: left to the trainer
        assert _values(session.produce_data(lost)) == [2, 3]
        assert session.reconnects == 1 and session.submitted_by_trainer == 1
        # Now the new daemon knows the earlier job as the trainer's: the worker joins it.
        joined = _batch(worker_proxy, 4)
        assert joined.pipe_run_ref.batch_id is not None
        assert _values(session.produce_data(joined)) == [4, 5]
        assert session.submitted_by_trainer == 1
        assert daemon.job(session.job_id).workers == 1


def test_without_reconnect_a_restart_ends_the_session(daemon: ServedCore) -> None:
    with _session(daemon) as session:
        proxy = session.proxy(doubling(), deterministic=True)
        batch = _batch(proxy, 0)
        daemon.restart()
        with pytest.raises(DaemonUnavailable, match="is gone"):
            session.produce_data(batch)


def test_a_session_that_ends_lets_the_daemon_free_its_job(
    daemon: ServedCore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dalid.server")
    session = _session(daemon)
    proxy = session.proxy(doubling())
    kept = session.produce_data(_batch(proxy, 0))
    job_id = session.job_id
    session.close()
    assert job_id not in daemon.core.jobs
    assert any(f"job {job_id} said goodbye" in r.getMessage() for r in caplog.records)
    assert _values(kept) == [0, 1]  # the tensor outlives the job


@pytest.mark.parametrize("ran_a_batch", [False, True])
def test_a_job_the_daemon_ended_for_a_new_one_raises_why_at_its_next_batch(
    ran_a_batch: bool,
) -> None:
    """Its trainer's link, or the link its proxies submit on (made at its first batch, or
    made late and refused), says why, as the same JobEnded."""
    path = Path(f"/tmp/dalid-inproc-{uuid.uuid4().hex[:8]}.sock")
    with ServedCore(path, max_jobs=1, reclaim_idle_s=0.2) as daemon, _session(daemon) as idle:
        proxy = idle.proxy(doubling())
        if ran_a_batch:
            idle.produce_data(_batch(proxy, 0))
        time.sleep(0.3)
        with _session(daemon) as newcomer:
            assert [job.job_id for job in daemon.core.jobs.values()] == [newcomer.job_id]
            with pytest.raises(JobEnded) as raised:
                idle.produce_data(_batch(proxy, BATCH))
            assert re.search(r"job \d+ was ended after \d+ s idle, to make room", str(raised.value))
