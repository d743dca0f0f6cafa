"""Train an image classifier on an ImageFolder, with dalid decoding and augmenting the images.

    ./dev run python -m examples.imagefolder_train [--data DIR] [--epochs 1] [--socket PATH]
        [--named]

``--epochs 60`` trains for a minute or so on a small machine: long enough to watch it in
``dalid status`` from another terminal.

The training loop is that of a torchvision ImageFolder script; only the transform changes: the
dataset hands each file path to the dalid proxy, and the daemon reads, decodes, crops, flips
and normalizes the images. Without ``--data`` a small dataset is generated. Without
``--socket`` the script connects to the daemon of its device (starting one if none runs).
With ``--named`` it uses the pipeline ``train`` of the daemon's repository instead of its own
(a daemon started with ``./dev run dalid serve --pipelines examples/pipelines
--repository-operators PythonFunction``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode
from nvidia.dali.pipeline import Pipeline, pipeline_def

import dalid.client as dalid
from examples.imagefolder import ImageFolder, add_data_arguments, classifier, dataset_root

SIZE = 96
MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


@pipeline_def
def train_pipeline() -> DataNode:
    """RandomResizedCrop, RandomHorizontalFlip, ToTensor and Normalize, in DALI."""
    # The ignores: DALI's stubs lack fn.io, and type resize's result as a union.
    paths = fn.external_source(name="paths", no_copy=True)
    images = fn.decoders.image_random_crop(
        fn.io.file.read(paths),  # type: ignore[attr-defined]
        output_type=types.DALIImageType.RGB,
        random_area=[0.08, 1.0],
    )
    return fn.crop_mirror_normalize(
        fn.resize(images, size=[SIZE, SIZE]),  # type: ignore[arg-type]
        dtype=types.DALIDataType.FLOAT,
        output_layout="CHW",
        mean=MEAN,
        std=STD,
        mirror=fn.random.coin_flip(probability=0.5),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_arguments(parser)
    parser.add_argument(
        "--named", action="store_true", help="use the pipeline 'train' of the daemon's repository"
    )
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    with dataset_root(args) as root, dalid.connect(socket=args.socket) as session:
        pipeline: dalid.RepositoryPipeline | Pipeline
        if args.named:
            pipeline = dalid.named_pipeline(
                "train", batch_size=args.batch_size, num_threads=2, size=SIZE
            )
        else:
            pipeline = train_pipeline(batch_size=args.batch_size, num_threads=2, device_id=None)
        dataset = ImageFolder(root, transform=session.proxy(pipeline))
        loader = dalid.DataLoader(
            session,
            dataset,
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.workers,
            # The same workers every epoch: none started again, and `dalid status` counts
            # them throughout, not only while an epoch runs.
            persistent_workers=args.workers > 0,
            drop_last=True,
        )
        model = classifier(len(dataset.classes))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        seen = 0
        for epoch in range(1, args.epochs + 1):
            for images, labels in loader:
                assert images.shape[1:] == (3, SIZE, SIZE)
                loss = torch.nn.functional.cross_entropy(model(images), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                seen += len(labels)
            print(f"epoch {epoch}: loss {loss.item():.3f}", flush=True)
    print(f"trained on {seen} images in {len(dataset.classes)} classes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
