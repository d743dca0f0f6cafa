"""A training job that the restart tests run while they kill its daemon.

    python -m tests.integration.restart_job --socket PATH [--reconnect] [--pause-at K]

Trainer and DataLoader workers on a CPU pipeline. After batch K it prints "paused" and waits
for a line on stdin (the test kills the daemon meanwhile, while the workers' next batches are in
flight); then it finishes the epoch, checking every batch's data, and prints "ok N reconnects R"
once every sample has been seen exactly once. It keeps the tensors of batch 1, which view the
first daemon's shared memory, and checks them again at the end.
"""

from __future__ import annotations

import argparse
import collections
import sys

import numpy as np

import dalid.client as dalid

from .helpers import BATCH, ProxyDataset, sample, two_output_pipeline


def check(scaled, shifted, indices) -> None:
    for row, index in enumerate(indices.tolist()):
        expected = sample(index)
        np.testing.assert_array_equal(shifted[row].numpy(), expected + 7)
        np.testing.assert_array_equal(scaled[row].numpy(), expected * 0.5 + 1.0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--length", type=int, default=160)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pause-at", type=int, default=3)
    parser.add_argument("--reconnect", action="store_true")
    args = parser.parse_args()
    with dalid.connect(
        socket=args.socket, autostart=False, name="restart job", reconnect=args.reconnect
    ) as session:
        proxy = session.proxy(two_output_pipeline())
        dataset = ProxyDataset(proxy, args.length)
        loader = dalid.DataLoader(session, dataset, batch_size=BATCH, num_workers=args.workers)
        seen: collections.Counter[int] = collections.Counter()
        first = None
        for step, ((scaled, shifted), indices) in enumerate(loader, start=1):
            check(scaled, shifted, indices)
            seen.update(indices.tolist())
            if first is None:
                first = (scaled, shifted, indices)
            if step == args.pause_at:
                print("paused", flush=True)
                sys.stdin.readline()
        assert first is not None
        check(*first)
        repeated = sorted(index for index, count in seen.items() if count > 1)
        missing = sorted(set(range(args.length)) - set(seen))
        assert not repeated and not missing, f"repeated {repeated}, missing {missing}"
        print(f"ok {sum(seen.values())} reconnects {session.reconnects}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
