"""A member of a cohort, as its own process: submits ``--batches`` batches of the shared data a
few ahead of the one it consumes, as a DataLoader does, and prints one JSON line per batch with
a digest of its outputs.

``--start-when PATH``: registers, then waits for PATH to exist before its first batch (so that
jobs started one after another begin together). ``--die-after N``: kills itself (SIGKILL)
holding the outputs of batch N and the batches submitted ahead of it. ``--stall-after N``: stops
consuming after batch N, holding what it has and has submitted, until it is killed. ``--keep``:
keeps every output it consumes (as a loop that stores its outputs does). ``--pause-after N
--resume-when PATH``: after batch N, waits for PATH to exist (holding what it has), then goes on.
``--end-when PATH``: once done, stays in its cohort until PATH exists. ``--simulated-gpu``: the
daemon's GPU is simulated (tests/simulated_gpu.py), and so is this process's.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode

import dalid.client as dalid

from ..dali_typing import pipeline_def

BATCH = 8
AHEAD = 3


@pipeline_def(batch_size=BATCH, num_threads=1, device_id=None, seed=5)
def augmenting() -> tuple[DataNode, DataNode]:
    """A random augmentation: every run draws new noise, so equal outputs mean one run."""
    data = fn.external_source(name="data", no_copy=True)
    noise = fn.random.uniform(range=(0.0, 1.0), shape=[96, 96, 1])
    blurred = fn.gaussian_blur(
        fn.cast(data, dtype=types.DALIDataType.FLOAT), window_size=15, sigma=3.0
    )
    return blurred + noise, data + 7


def data(seed: int, index: int) -> np.ndarray:
    """Sample ``index`` of the dataset as a sampler of ``seed`` orders it."""
    order = np.random.default_rng(seed).permutation(4096)
    value = int(order[index % 4096])
    ramp = np.arange(96, dtype=np.uint8).reshape(96, 1, 1) % 50
    return np.broadcast_to(ramp + value % 200, (96, 96, 1)).copy()


def submit(proxy: dalid.Proxy, seed: int, number: int) -> Any:
    samples = [proxy(data(seed, number * BATCH + i)) for i in range(BATCH)]
    return torch.utils.data.default_collate(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--cohort", default="sweep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--die-after", type=int, default=-1)
    parser.add_argument("--stall-after", type=int, default=-1)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--pause-after", type=int, default=-1)
    parser.add_argument("--resume-when", type=Path)
    parser.add_argument("--start-when", type=Path)
    parser.add_argument("--end-when", type=Path)
    parser.add_argument("--simulated-gpu", action="store_true")
    args = parser.parse_args()
    if args.simulated_gpu:
        from ..simulated_gpu import install_trainer

        install_trainer()
    with dalid.connect(socket=args.socket, autostart=False, cohort=args.cohort) as session:
        proxy = session.proxy(augmenting())
        print(json.dumps({"job": session.job_id}), flush=True)
        while args.start_when is not None and not args.start_when.exists():
            time.sleep(0.01)
        pending: collections.deque[tuple[int, Any]] = collections.deque()
        kept: list[Any] = []
        submitted = 0
        for number in range(args.batches):
            while submitted < min(args.batches, number + AHEAD):
                pending.append((submitted, submit(proxy, args.seed, submitted)))
                submitted += 1
            _, ref = pending.popleft()
            noisy, shifted = session.produce_data(ref)
            want = np.stack([data(args.seed, number * BATCH + i) for i in range(BATCH)])
            if not np.array_equal(shifted.numpy(), want.astype(np.int32) + 7):
                print(json.dumps({"wrong": number}), flush=True)
            digest = hashlib.sha256(noisy.numpy().tobytes() + shifted.numpy().tobytes())
            print(json.dumps({"batch": number, "digest": digest.hexdigest()}), flush=True)
            if number == args.die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if number == args.stall_after:
                print(json.dumps({"stalled": number}), flush=True)
                time.sleep(3600)
            if number == args.pause_after and args.resume_when is not None:
                print(json.dumps({"paused": number}), flush=True)
                while not args.resume_when.exists():
                    time.sleep(0.01)
            if args.keep:
                kept.append((noisy, shifted))
            del noisy, shifted
        print(json.dumps({"done": args.batches}), flush=True)
        while args.end_when is not None and not args.end_when.exists():
            time.sleep(0.01)


if __name__ == "__main__":
    main()
