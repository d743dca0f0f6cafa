"""A training job that the restart tests run while they kill its daemon.

    python -m tests.integration.restart_job --socket PATH [--reconnect] [--pause-at K[,K2...]]
        [--epochs E] [--persistent-workers] [--step-seconds S] [--deterministic]
        [--reconnect-timeout T] [--start-method spawn|fork] [--say-started]

Trainer and DataLoader workers on a CPU pipeline. After batch K of the first epoch (and after
K2, ... counted the same way) it prints "paused" and waits for a line on stdin (the test kills
or replaces the daemon meanwhile, while the workers' next batches are in flight); then it
finishes its epochs, checking every batch's data and that
each epoch saw every sample exactly once. It prints, per epoch, how many batches the trainer
had to submit itself ("epoch 1 trainer-submitted S"), and at the end "ok N reconnects R" with N
the samples seen in all. It keeps the tensors of batch 1, which view the first daemon's shared
memory, and checks them again at the end. ``--step-seconds`` stands for the time a training
step takes, during which the DataLoader workers make the next batches.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import numpy as np
import torch

import dalid.client as dalid

from .helpers import BATCH, ProxyDataset, sample, two_output_pipeline


def check(scaled: torch.Tensor, shifted: torch.Tensor, indices: torch.Tensor) -> None:
    for row, index in enumerate(indices.tolist()):
        expected = sample(index)
        np.testing.assert_array_equal(shifted[row].numpy(), expected + 7)
        np.testing.assert_array_equal(scaled[row].numpy(), expected * 0.5 + 1.0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--length", type=int, default=160)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pause-at", default="3")
    parser.add_argument("--reconnect-timeout", type=float, default=60.0)
    parser.add_argument("--start-method", default=None)
    parser.add_argument("--say-started", action="store_true")
    parser.add_argument("--reconnect", action="store_true")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--persistent-workers", action="store_true")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--deterministic", action="store_true")
    args = parser.parse_args()
    pauses = {int(step) for step in args.pause_at.split(",")}
    with dalid.connect(
        socket=args.socket,
        autostart=False,
        name="restart job",
        reconnect=args.reconnect,
        reconnect_timeout=args.reconnect_timeout,
    ) as session:
        proxy = session.proxy(two_output_pipeline(), deterministic=args.deterministic)
        dataset = ProxyDataset(proxy, args.length)
        loader = dalid.DataLoader(
            session,
            dataset,
            batch_size=BATCH,
            num_workers=args.workers,
            persistent_workers=args.persistent_workers,
            multiprocessing_context=args.start_method,
        )
        if args.say_started:
            print("started", flush=True)
        first = None
        samples = 0
        for epoch in range(1, args.epochs + 1):
            seen: collections.Counter[int] = collections.Counter()
            submitted_before = session.submitted_by_trainer
            for step, ((scaled, shifted), indices) in enumerate(loader, start=1):
                check(scaled, shifted, indices)
                time.sleep(args.step_seconds)
                seen.update(indices.tolist())
                if first is None:
                    first = (scaled, shifted, indices)
                if epoch == 1 and step in pauses:
                    print("paused", flush=True)
                    sys.stdin.readline()
            repeated = sorted(index for index, count in seen.items() if count > 1)
            missing = sorted(set(range(args.length)) - set(seen))
            assert not repeated and not missing, f"repeated {repeated}, missing {missing}"
            samples += sum(seen.values())
            submitted = session.submitted_by_trainer - submitted_before
            print(f"epoch {epoch} trainer-submitted {submitted}", flush=True)
        assert first is not None
        check(*first)
        print(f"ok {samples} reconnects {session.reconnects}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
