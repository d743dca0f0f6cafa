"""A pipeline with several inputs: each image comes with its own rotation angle and crop size.

    ./dev run python -m examples.multi_input [--data DIR] [--socket PATH]

Per-sample parameters chosen in Python (here, in ``Dataset.__getitem__``) travel to the daemon
as further external_source inputs, beside the image, and drive DALI operators sample by sample:
the proxy is called with one keyword per input. Prints the parameters and the output of a few
samples, and checks that each output matches the parameters it was given.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode
from nvidia.dali.pipeline import pipeline_def
from torch.utils.data import Dataset

import dalid.client as dalid
from examples.imagefolder import ImageFolder, add_data_arguments, dataset_root, path_sample

SIZE = 64


@pipeline_def
def rotate_and_crop() -> tuple[DataNode, DataNode]:
    """Inputs: ``paths`` (a file path), ``angles`` (degrees) and ``crops`` ((height, width))."""
    # The ignores: DALI's stubs lack fn.io, and type resize's result as a union.
    paths = fn.external_source(name="paths", no_copy=True)
    angles = fn.external_source(name="angles", no_copy=True)
    crops = fn.external_source(name="crops", no_copy=True)
    jpegs = fn.io.file.read(paths)  # type: ignore[attr-defined]
    images = fn.decoders.image(jpegs, output_type=types.DALIImageType.RGB)
    images = fn.rotate(images, angle=angles, fill_value=0)
    images = fn.crop(images, crop=crops, out_of_bounds_policy="pad")
    # Every sample of a batch has one shape: the crops, whatever their size, are resized.
    return fn.resize(images, size=[SIZE, SIZE]), crops  # type: ignore[return-value]


class AugmentedImages(Dataset[tuple[Any, Any, int, int]]):
    """Draws an angle and a crop size per sample and hands all three inputs to the proxy."""

    def __init__(self, folder: ImageFolder, proxy: dalid.Proxy, seed: int = 0) -> None:
        self.folder = folder
        self.proxy = proxy
        self.seed = seed

    def __len__(self) -> int:
        return len(self.folder)

    def parameters(self, index: int) -> tuple[np.float32, np.ndarray]:
        """The angle and the crop size (height, width) of sample ``index``."""
        rng = np.random.default_rng([self.seed, index])
        angle = np.float32(rng.uniform(-30, 30))
        crop = rng.integers(96, 256, size=2).astype(np.float32)
        return angle, crop

    def __getitem__(self, index: int) -> tuple[Any, Any, int, int]:
        path, label = self.folder.samples[index]
        angle, crop = self.parameters(index)
        image, crop_used = self.proxy(paths=path_sample(path), angles=angle, crops=crop)
        return image, crop_used, index, label


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_arguments(parser)
    args = parser.parse_args(argv)

    with dataset_root(args) as root, dalid.connect(socket=args.socket) as session:
        pipeline = rotate_and_crop(batch_size=args.batch_size, num_threads=2, device_id=None)
        proxy = session.proxy(pipeline)
        dataset = AugmentedImages(ImageFolder(root), proxy)
        loader = dalid.DataLoader(
            session, dataset, batch_size=args.batch_size, num_workers=args.workers
        )
        samples = 0
        for _ in range(args.epochs):
            for images, crops, indices, labels in loader:
                assert images.shape == (len(labels), SIZE, SIZE, 3) and images.dtype == torch.uint8
                for crop, index in zip(crops.numpy(), indices.tolist(), strict=True):
                    angle, expected = dataset.parameters(index)
                    # The daemon cropped each sample with the parameters drawn for it.
                    np.testing.assert_array_equal(crop, expected)
                    if samples < 3:
                        height, width = crop
                        print(
                            f"sample {index}: rotated {angle:5.1f} deg, cropped "
                            f"{height:.0f}x{width:.0f} px, resized to {SIZE}x{SIZE}"
                        )
                    samples += 1
        print(f"{samples} samples rotated and cropped, each with its own parameters", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
