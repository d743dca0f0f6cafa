"""A training job run as its own process by the multi-process tests.

    python -m tests.integration.trainer_job --socket PATH --offset K [--hold]

Checks that every batch holds its own samples (offset K), prints one line per epoch, and with
--hold prints "holding" after the first batch and sleeps with its tensors alive, to be killed.
With --together N it starts loading only once the daemon serves N jobs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

import dalid.client as dalid

from ..daemons import daemon_status, wait_for
from .helpers import BATCH, ProxyDataset, job_arguments, sample, two_output_pipeline


def main() -> int:
    args = job_arguments(default_length=64)
    with dalid.connect(socket=args.socket, autostart=False, name=f"job{args.offset}") as session:
        proxy = session.proxy(two_output_pipeline())
        if args.together:
            wait_for(
                lambda: len(daemon_status(Path(args.socket)).jobs) >= args.together,
                120,
                f"{args.together} jobs on the daemon",
            )
        dataset = ProxyDataset(proxy, args.length, offset=args.offset)
        loader = dalid.DataLoader(session, dataset, batch_size=BATCH, num_workers=args.workers)
        held = []
        seen = 0
        for (scaled, shifted), indices in loader:
            for row, index in enumerate(indices.tolist()):
                expected = sample(index, args.offset)
                np.testing.assert_array_equal(shifted[row].numpy(), expected + 7)
                np.testing.assert_array_equal(scaled[row].numpy(), expected * 0.5 + 1.0)
            seen += len(indices)
            if args.hold:
                held.append((scaled, shifted))
                print("holding", flush=True)
                time.sleep(600)
        print(f"ok {seen}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
