"""A batch the daemon refuses after its worker handed it on fails, for the trainer, at that batch.

DataLoader workers no longer wait for the daemon's acceptance (Note [Submitting without
waiting] in client/worker/submitter.py), so a refusal reaches the trainer as the batch's result.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import dalid.client as dalid
from dalid.protocol import ErrorCode

from ..daemons import DaemonProcess, own_directory, start_daemon
from .helpers import two_output_pipeline

# The job's share of batch inputs is half the daemon's --input-memory: 1 MiB. A batch of one
# BIG sample takes 0.6 MB: two held at once are over the share; a SMALL one fits beside one.
INPUT_MEMORY = "2M"
BIG = 150_000  # int32 values
SMALL = 1000


@pytest.fixture(scope="module")
def small_daemon() -> Iterator[DaemonProcess]:
    directory = own_directory()
    daemon = start_daemon(directory, "--input-memory", INPUT_MEMORY)
    try:
        yield daemon
    finally:
        assert daemon.stop() == 0
        assert not daemon.segments()
        shutil.rmtree(directory, ignore_errors=True)


class FirstIsBig(torch.utils.data.Dataset[Any]):
    def __init__(self, proxy: Any, length: int) -> None:
        self.proxy = proxy
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.proxy(np.full(BIG if index == 0 else SMALL, index, np.int32))


def test_a_batch_refused_after_its_worker_moved_on_fails_at_that_batch(
    small_daemon: DaemonProcess,
) -> None:
    with dalid.connect(socket=small_daemon.socket, autostart=False) as session:
        # A deferred batch of the job holds 0.6 MiB of the job's share until it is scheduled.
        deferred = session.proxy(two_output_pipeline(), deterministic=True)
        held = torch.utils.data.default_collate([deferred(np.full(BIG, -1, np.int32))])
        proxy = session.proxy(two_output_pipeline())
        loader = dalid.DataLoader(session, FirstIsBig(proxy, 3), batch_size=1, num_workers=1)
        batches = iter(loader)
        # The worker sent batch 0 and went on; the daemon refused it: over the job's share.
        with pytest.raises(dalid.BatchError) as raised:
            next(batches)
        error = raised.value
        # Code written for DALI's proxy catches what a batch raises as a RuntimeError.
        assert isinstance(error, RuntimeError)
        assert error.code is ErrorCode.RESOURCE_EXHAUSTED
        assert "--input-memory" in str(error) and f"batch {error.batch_id} " in str(error)
        assert error.step == 0
        # The worker went on, its next batches run, and so does the one that was in the way.
        for index, (_, shifted) in enumerate(batches, start=1):
            assert shifted.shape == (1, SMALL) and shifted[0, 0].item() == index + 7
        assert index == 2
        _, shifted = session.produce_data(held)
        assert shifted[0, 0].item() == 6
