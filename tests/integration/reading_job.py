"""A job that reads image files through the daemon, checking every batch it gets.

    python -m tests.integration.reading_job --socket PATH --images DIR [--after N]

Runs ``read_pipeline`` (paths in, ``fn.io.file.read``, decode, resize to 32x32) over the JPEGs
of DIR, one batch at a time, and prints "running" after its first batch. A line on stdin makes
it finish: N more batches (5), then it prints "ok M", M the whole batches it got. Any failed
batch ends it with an error.
"""

from __future__ import annotations

import argparse
import select
import sys
from pathlib import Path

import numpy as np
import torch
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode

import dalid.client as dalid

from ..dali_typing import pipeline_def

BATCH = 4


@pipeline_def(batch_size=BATCH, num_threads=2, device_id=None)
def read_pipeline() -> DataNode:
    paths = fn.external_source(name="paths", no_copy=True)
    # DALI's stubs lack fn.io, and type resize's result as a union.
    images = fn.decoders.image(
        fn.io.file.read(paths),  # type: ignore[attr-defined]
        device="cpu",
        output_type=types.DALIImageType.RGB,
    )
    return fn.resize(images, resize_x=32, resize_y=32)  # type: ignore[return-value]


def path_sample(path: str | Path) -> np.ndarray:
    return np.frombuffer(str(path).encode(), dtype=np.int8)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--images", required=True)
    parser.add_argument("--after", type=int, default=5)
    args = parser.parse_args()
    files = sorted(Path(args.images).rglob("*.jpg"))
    with dalid.connect(socket=args.socket, autostart=False, name="reader") as session:
        proxy = session.proxy(read_pipeline())
        done, last = 0, None
        while last is None or done < last:
            chosen = [files[(done * BATCH + i) % len(files)] for i in range(BATCH)]
            batch = torch.utils.data.default_collate([proxy(path_sample(p)) for p in chosen])
            images = session.produce_data(batch)
            assert images.shape == (BATCH, 32, 32, 3), images.shape
            done += 1
            if done == 1:
                print("running", flush=True)
            if last is None and select.select([sys.stdin], [], [], 0)[0]:
                last = done + args.after
        print(f"ok {done}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
