"""A loop that keeps every output, as validation loops do: it never hangs (Note [Private
copies] in dalid.server.outputs.copies).

With DALI's proxy each step's tensors are new, so keeping them all only costs memory. Through
dalid they view the job's output memory: once the trainer holds it all, later batches come as
private copies, said once in the daemon's log and counted in ``dalid status``.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np

import dalid.client as dalid

from ..daemons import start_daemon
from .helpers import BATCH, ProxyDataset, sample, two_output_pipeline

LENGTH = 20 * BATCH


def test_keeping_every_output_of_two_epochs(short_tmp: Path) -> None:
    # 8 KiB of output memory: room for 8 of the 40 batches of two epochs.
    daemon = start_daemon(short_tmp, "--pool-bytes", "8K", "--slab-bytes", "4K")
    try:
        with dalid.connect(socket=daemon.socket, autostart=False, name="keeper") as session:
            proxy = session.proxy(two_output_pipeline())
            loader = dalid.DataLoader(
                session, ProxyDataset(proxy, LENGTH), batch_size=BATCH, num_workers=2
            )
            kept: list[Any] = []
            for _ in range(2):
                kept.extend(loader)
            assert len(kept) == 40
            for (scaled, shifted), indices in kept:
                expected = np.stack([sample(index) for index in indices.tolist()])
                np.testing.assert_array_equal(shifted.numpy(), expected + 7)
                np.testing.assert_array_equal(scaled.numpy(), expected * 0.5 + 1.0)
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
