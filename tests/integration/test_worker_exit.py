"""A DataLoader worker that exits right after it submitted a batch: the batch still reaches the
daemon, and the daemon learns at once that the worker left.

A worker sends a batch and hands its reference on without waiting (Note [Submitting without
waiting] in dalid.client.worker.submitter), and a forked worker ends in ``os._exit``: a batch the
socket had not written yet was lost with the process, and the trainer waited for it forever. A
batch of a MiB takes several writes, and the daemon reads each after the last: the batches here
are that size.
"""

from __future__ import annotations

import functools
import multiprocessing
from pathlib import Path
from typing import Any

import numpy as np
import torch

import dalid.client as dalid

from ..daemons import DaemonProcess, start_daemon, wait_for
from .helpers import BATCH, two_output_pipeline

WORKERS = 4
ROUNDS = 5  # each round's workers exit at once; before the fix, most rounds lost a batch


def sample(index: int) -> np.ndarray:
    """128 KiB whose values identify the sample."""
    return np.full((256, 128), index, dtype=np.int32)


def submit_and_exit(proxy: Any, first: int, refs: Any) -> None:
    """A worker's life in short: collate one batch (which submits it), hand it on, exit."""
    refs.put(torch.utils.data.default_collate([proxy(sample(first + i)) for i in range(BATCH)]))


def all_ran_and_left(daemon: DaemonProcess, batches: int) -> bool:
    return [(j.workers, j.batches_done) for j in daemon.status().jobs] == [(0, batches)]


def test_a_batch_sent_just_before_its_worker_exits_arrives(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    try:
        with dalid.connect(socket=daemon.socket, autostart=False, name="exits") as session:
            proxy = session.proxy(two_output_pipeline())
            context = multiprocessing.get_context("fork")
            for round_ in range(ROUNDS):
                refs = context.SimpleQueue()
                firsts = [(round_ * WORKERS + worker) * BATCH for worker in range(WORKERS)]
                workers = [
                    context.Process(target=submit_and_exit, args=(proxy, first, refs))
                    for first in firsts
                ]
                for worker in workers:
                    worker.start()
                collated = [refs.get() for _ in workers]
                for worker in workers:
                    worker.join(30)
                    assert worker.exitcode == 0
                # Every batch arrived, and every worker said goodbye on its way out, after it.
                wait_for(
                    functools.partial(all_ran_and_left, daemon, WORKERS * (round_ + 1)),
                    30,
                    f"round {round_}'s batches to run and its workers to leave",
                )
                seen = []
                for batch in collated:
                    scaled, shifted = session.produce_data(batch)
                    first = int(shifted[0, 0, 0]) - 7
                    expected = np.stack([sample(first + i) for i in range(BATCH)])
                    np.testing.assert_array_equal(shifted.numpy(), expected + 7)
                    np.testing.assert_array_equal(scaled.numpy(), expected * 0.5 + 1.0)
                    seen.append(first)
                assert sorted(seen) == firsts
    finally:
        assert daemon.stop() == 0, daemon.log_text()
