"""A job that loads the daemon, run as its own process by the multi-job tests.

    python -m tests.integration.load_job --socket PATH --name N [--weight W] [--batch B]
        [--workers K] [--batches N]

Runs a CPU-heavy pipeline (a wide blur) on small images whose values name their index, checks
every output, and prints "running" after its first batch. With --workers > 0 it keeps the
daemon busy (a flood: its DataLoader keeps batches queued); with --workers 0 it sends one
batch at a time and waits for it (a steady job). Stops after --batches batches (default: when
killed) and prints "ok N".
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import torch
from nvidia.dali import fn
from nvidia.dali.data_node import DataNode
from nvidia.dali.pipeline import Pipeline

import dalid.client as dalid

from ..dali_typing import pipeline_def
from . import helpers  # noqa: F401  (its warning filter)

SIDE = 96


def heavy_pipeline(batch: int, window: int = 15) -> Pipeline:
    # The daemon holds a job's prefetch_queue_depth batches and the one its trainer holds at
    # once (Note [A job's window] in dalid.server.runs.run_planner): a deep prefetch keeps a
    # job whose batches are cheap busy while another job's long runs hold the daemon's one slot.
    @pipeline_def(batch_size=batch, num_threads=1, device_id=None, seed=5, prefetch_queue_depth=4)
    def blur() -> tuple[DataNode, DataNode]:
        data = fn.external_source(name="data", no_copy=True, layout="HWC")
        return fn.gaussian_blur(data, window_size=window, sigma=window / 5), data

    return blur()


def image(index: int) -> np.ndarray:
    return np.full((SIDE, SIDE, 3), index % 251, dtype=np.uint8)


class Images(torch.utils.data.Dataset[tuple[Any, int]]):
    def __init__(self, proxy: dalid.Proxy, length: int) -> None:
        self.proxy = proxy
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.proxy(image(index)), index


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--weight", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--window", type=int, default=15)
    args = parser.parse_args()
    with dalid.connect(
        socket=args.socket, autostart=False, name=args.name, weight=args.weight
    ) as session:
        proxy = session.proxy(heavy_pipeline(args.batch, args.window))
        length = args.batch * (args.batches or 1_000_000)
        loader = dalid.DataLoader(
            session,
            Images(proxy, length),
            batch_size=args.batch,
            num_workers=args.workers,
            prefetch_factor=4 if args.workers else None,
        )
        done = 0
        for done, ((blurred, original), indices) in enumerate(loader, start=1):
            # A uniform image stays uniform under a blur: every pixel keeps the sample's value.
            expected = (indices % 251).to(torch.uint8).view(-1, 1, 1, 1)
            assert torch.equal(original, expected.expand_as(original)), "wrong input came back"
            assert torch.equal(blurred, expected.expand_as(blurred)), "wrong output came back"
            if done == 1:
                print("running", flush=True)
            if args.batches is not None and done >= args.batches:
                break
        print(f"ok {done}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
