"""A training job that the checkpoint tests kill with SIGKILL and resume from its saved state.

    python -m tests.integration.resume_job --socket PATH --record FILE --state FILE
        [--mode deterministic|shared] [--workers N] [--epochs 3] [--save-every S]
        [--kill-at STEP] [--resume] [--proxy]

Runs ``--epochs`` epochs of a shuffled dataset through a pipeline with random crop, flip and
noise (``random_augment``), deterministic (a pipeline of its own, made with
``enable_checkpointing=True``) or shared. After each batch it appends one line to ``--record``:
the run's step (counted over all epochs), the epoch, the batch's dataset indices and a digest of
its outputs; every ``--save-every`` steps it saves ``{"loader": loader.state_dict(), "step",
"epoch"}`` to ``--state`` with ``torch.save`` (written aside, then renamed). At step
``--kill-at`` it kills itself with SIGKILL, its workers and batches in flight with it. With
``--resume`` it loads ``--state`` into a new loader first and carries on from the step after it.
``--proxy`` uses the DALI-proxy API (``DALIServer`` and its ``DataLoader``) instead of a session.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode

import dalid.client as dalid
from dalid.client import proxy as dali_proxy

from ..dali_typing import pipeline_def

BATCH = 4

warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)


@pipeline_def(batch_size=BATCH, num_threads=1, device_id=None, seed=4321, enable_checkpointing=True)
def random_augment() -> tuple[DataNode, DataNode]:
    """A random crop and a random horizontal flip of each image, and a random draw beside it."""
    image = fn.external_source(name="image", no_copy=True, layout="HWC")
    cropped = fn.crop(
        image,
        crop=(6, 6),
        crop_pos_x=fn.random.uniform(range=(0.0, 1.0)),
        crop_pos_y=fn.random.uniform(range=(0.0, 1.0)),
    )
    flipped = fn.flip(cropped, horizontal=fn.random.coin_flip())
    draws = fn.random.uniform(range=(0.0, 1000.0), shape=[2], dtype=types.DALIDataType.FLOAT)
    return flipped, draws


def image(index: int) -> np.ndarray:
    """A 10x10 RGB image whose every value tells its index and position."""
    return (np.arange(300, dtype=np.int64).reshape(10, 10, 3) * 7 + index * 13).astype(np.uint8)


class Images(torch.utils.data.Dataset[tuple[Any, int]]):
    def __init__(self, proxy: Any, length: int) -> None:
        self.proxy = proxy
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.proxy(image(index)), index


def digest(tensors: tuple[torch.Tensor, ...]) -> str:
    hashed = hashlib.sha256()
    for tensor in tensors:
        hashed.update(tensor.contiguous().numpy().tobytes())
    return hashed.hexdigest()[:16]


@contextlib.contextmanager
def producer(args: argparse.Namespace) -> Iterator[tuple[Any, Any]]:
    """The session (or DALIServer) and the proxy of the job's pipeline."""
    deterministic = args.mode == "deterministic"
    if args.proxy:
        with dali_proxy.DALIServer(
            random_augment(), deterministic, socket=args.socket, autostart=False
        ) as server:
            yield server, server.proxy
        return
    with dalid.connect(socket=args.socket, autostart=False, name="resume job") as session:
        yield session, session.proxy(random_augment(), deterministic=deterministic)


def save(path: Path, state: dict[str, Any]) -> None:
    aside = path.with_suffix(".tmp")
    torch.save(state, aside)
    os.replace(aside, path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--mode", choices=("deterministic", "shared"), default="deterministic")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--length", type=int, default=22)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--proxy", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(5)  # the sampler's generator; a resume takes it from the state
    with producer(args) as (source, proxy):
        loader_type = dali_proxy.DataLoader if args.proxy else dalid.DataLoader
        loader = loader_type(
            source, Images(proxy, args.length), batch_size=BATCH, shuffle=True,
            num_workers=args.workers,
        )  # fmt: skip
        step, epoch = 0, 0
        if args.resume:
            saved = torch.load(args.state, weights_only=True)
            loader.load_state_dict(saved["loader"])
            step, epoch = saved["step"], saved["epoch"]
        with args.record.open("a") as record:
            while epoch < args.epochs:
                for outputs in loader:
                    tensors, indices = outputs
                    step += 1
                    record.write(f"{step} {epoch} {indices.tolist()} {digest(tuple(tensors))}\n")
                    record.flush()
                    del tensors, outputs
                    if step % args.save_every == 0:
                        save(
                            args.state,
                            {"loader": loader.state_dict(), "step": step, "epoch": epoch},
                        )
                    if step == args.kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                epoch += 1
    print("ok", step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
