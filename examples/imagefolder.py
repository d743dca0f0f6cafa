"""What the examples share: a torchvision-style ImageFolder, a small model, data on the fly.

``ImageFolder`` reads the ``root/<class>/<image>`` layout as ``torchvision.datasets.ImageFolder``
does (classes sorted, ``class_to_idx``, ``samples``, ``targets``, ``transform``), but hands the
transform the file path instead of a decoded image: with dalid, reading and decoding happen in
the daemon. (The torchvision wheel that ``pip install torchvision`` fetches is built against
CUDA torch and does not load with the CPU build of torch, so the layout reader is written here
rather than imported.)
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


def path_sample(path: str) -> np.ndarray:
    """A file path as a sample for ``fn.io.file.read`` (an int8 array of its bytes)."""
    return np.frombuffer(path.encode(), dtype=np.int8)


class ImageFolder(Dataset[tuple[Any, Any]]):
    """``root/<class>/<file>`` samples; ``transform`` receives the path as an int8 array."""

    def __init__(
        self,
        root: str | Path,
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
    ) -> None:
        self.root = Path(root)
        self.classes = sorted(entry.name for entry in self.root.iterdir() if entry.is_dir())
        if not self.classes:
            raise FileNotFoundError(f"no class folders in {self.root}")
        self.class_to_idx = {name: index for index, name in enumerate(self.classes)}
        self.samples = [
            (str(path), self.class_to_idx[name])
            for name in self.classes
            for path in sorted((self.root / name).iterdir())
            if path.suffix.lower() in IMAGE_EXTENSIONS
        ]
        self.targets = [label for _, label in self.samples]
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        path, label = self.samples[index]
        sample = path_sample(path)
        target: Any = label
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(label)
        return sample, target


def classifier(num_classes: int) -> torch.nn.Module:
    """A model small enough to train on a CPU in seconds."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, kernel_size=7, stride=4),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, num_classes),
    )


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, help="an ImageFolder (default: generate one)")
    parser.add_argument("--images", type=int, default=64, help="images to generate")
    parser.add_argument("--classes", type=int, default=4, help="classes to generate")
    parser.add_argument(
        "--socket", help="the daemon's socket (default: the daemon of this process's device)"
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)


@contextlib.contextmanager
def dataset_root(args: argparse.Namespace) -> Iterator[Path]:
    """``--data``, else a small ImageFolder of JPEGs generated into a temporary folder that is
    removed afterwards."""
    if args.data is not None:
        yield Path(args.data)
        return
    from bench.dataset import make_imagefolder

    with tempfile.TemporaryDirectory(prefix="dalid-example-") as folder:
        root = Path(folder) / "images"
        make_imagefolder(root, num_images=args.images, num_classes=args.classes, seed=0)
        yield root
