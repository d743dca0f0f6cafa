"""One training job of the demo: an image classifier fed by a dalid daemon.

    ./dev run python -m examples.train_job --data DIR --socket PATH --name job-a

The DataLoader's workers read file paths; the daemon reads, decodes, crops, flips and
normalizes the images, and the job receives float CHW batches as torch tensors. Prints one
progress line per few batches and a JSON summary line at the end (for the demo to collect).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode
from nvidia.dali.pipeline import pipeline_def

import dalid.client as dalid
from examples.imagefolder import ImageFolder, classifier

CROP = 160


@pipeline_def
def training_pipeline(decoder_device: str = "cpu") -> DataNode:
    """Decode, random-resized-crop, flip and normalize, as an ImageNet training loader does."""
    # The ignores: DALI's stubs lack fn.io, and type resize's result as a union.
    paths = fn.external_source(name="paths", no_copy=True)
    jpegs = fn.io.file.read(paths)  # type: ignore[attr-defined]
    images = fn.decoders.image_random_crop(
        jpegs, device=decoder_device, output_type=types.DALIImageType.RGB, random_area=[0.25, 1.0]
    )
    images = fn.resize(images, size=[CROP, CROP])
    return fn.crop_mirror_normalize(
        images,  # type: ignore[arg-type]
        dtype=types.DALIDataType.FLOAT,
        output_layout="CHW",
        mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
        std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
        mirror=fn.random.coin_flip(probability=0.5),
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--name", default=f"job-{os.getpid()}")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    with dalid.connect(socket=args.socket, autostart=False, name=args.name) as session:
        pipeline = training_pipeline(
            batch_size=args.batch_size, num_threads=2, device_id=None, seed=args.seed
        )
        dataset = ImageFolder(args.data, transform=session.proxy(pipeline))
        loader = dalid.DataLoader(
            session,
            dataset,
            batch_size=args.batch_size,
            num_workers=args.workers,
            shuffle=True,
            drop_last=True,
            persistent_workers=args.workers > 0,
        )
        net = classifier(len(dataset.classes))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        started = time.perf_counter()
        waited = 0.0
        images = 0
        loss = torch.tensor(float("nan"))
        for epoch in range(1, args.epochs + 1):
            batches = iter(loader)
            for step in range(1, len(loader) + 1):
                before = time.perf_counter()
                inputs, labels = next(batches)
                waited += time.perf_counter() - before
                loss = torch.nn.functional.cross_entropy(net(inputs), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                images += len(labels)
                if step % 4 == 0 or step == len(loader):
                    rate = images / (time.perf_counter() - started)
                    print(
                        f"[{args.name}] epoch {epoch}/{args.epochs} batch {step:3d}/{len(loader)}"
                        f"  loss {loss.item():.3f}  {rate:6.1f} img/s",
                        flush=True,
                    )
        seconds = time.perf_counter() - started
    summary = {
        "name": args.name,
        "images": images,
        "seconds": round(seconds, 3),
        "images_per_s": round(images / seconds, 1),
        "data_wait_fraction": round(waited / seconds, 3),
        "final_loss": round(loss.item(), 4),
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    print("SUMMARY " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
