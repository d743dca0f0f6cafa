"""The DataLoader workers a session counts for the daemon, and when the daemon is told."""

from __future__ import annotations

import pytest

from dalid.client.started_workers import StartedWorkers
from dalid.protocol import MAX_LOADER_WORKERS, LoaderWorkers


def test_a_job_is_told_each_new_count_once() -> None:
    counted = StartedWorkers()
    # Nothing started: a job is not told that none run (it shows the workers it sees).
    assert counted.due("job-1") is None
    first = counted.start(2)
    assert counted.count == 2 and counted.due("job-1") == 2
    counted.told("job-1", 2)
    assert counted.due("job-1") is None
    # A second loader's workers add to the first's; each iterator's stop takes its own away.
    second = counted.start(4)
    assert counted.due("job-1") == 6
    counted.told("job-1", 6)
    counted.stop(first)
    counted.stop(first)  # idempotent
    assert counted.count == 4 and counted.due("job-1") == 4
    counted.told("job-1", 4)
    counted.stop(second)
    assert counted.due("job-1") == 0  # told 4 before: it must hear that they stopped
    counted.told("job-1", 0)
    assert counted.due("job-1") is None


def test_a_new_job_after_a_reconnection_is_told_again() -> None:
    counted = StartedWorkers()
    counted.start(2)
    counted.told("job-1", 2)
    assert counted.due("job-2") == 2  # the new daemon's job never heard of them


def test_a_count_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"loader_workers\.workers"):
        LoaderWorkers(-1)
    with pytest.raises(ValueError, match=r"loader_workers\.workers"):
        LoaderWorkers(MAX_LOADER_WORKERS + 1)
