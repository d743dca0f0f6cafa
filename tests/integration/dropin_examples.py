"""The three examples of DALI's ``DALIServer`` docstring, as functions of the proxy module.

Each example takes the proxy module as its ``dali_proxy`` argument, so the very same body runs
with DALI's ``nvidia.dali.plugin.pytorch.experimental.proxy`` and with ``dalid.client.proxy``:
the only difference between the two runs is which module the import line names. The bodies
follow the documentation line for line; the free names of the documentation (``jpeg``,
``batch_size``) are arguments, and each example returns what it consumed so tests can check it.
The documentation's lines that DALI's stubs type wrongly (``fn.io``, which they lack, constants
of ``types`` made at import, ``resize`` typed as returning a union) carry a ``type: ignore``.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode
from nvidia.dali.pipeline import Pipeline

from ..dali_typing import pipeline_def

# (data, target) batches, as the examples consume them.
Batches = list[tuple[torch.Tensor, torch.Tensor]]

# ------------------------------------------------------------------------------------------------
# A small JPEG image folder and an ImageFolder-like dataset (torchvision's wheel does not
# import beside the CPU build of torch that the tests use).


def make_image_folder(root: Path, classes: int = 3, per_class: int = 8, seed: int = 7) -> Path:
    """``root/class_k/img_i.jpg``: smooth colour images of varied sizes (64 to 200 px)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for label in range(classes):
        folder = root / f"class_{label}"
        folder.mkdir(parents=True)
        for index in range(per_class):
            height, width = (int(v) for v in rng.integers(64, 201, size=2))
            ys = np.linspace(0.0, 1.0, height)[:, None, None]
            xs = np.linspace(0.0, 1.0, width)[None, :, None]
            base = rng.uniform(0, 255, size=(1, 1, 3))
            image = base * ys + (255 - base) * xs * 0.5 + rng.normal(0, 8, (height, width, 3))
            pixels = np.clip(image, 0, 255).astype(np.uint8)
            Image.fromarray(pixels, "RGB").save(folder / f"img_{index}.jpg", quality=90)
    return root


class ImageFolder(torch.utils.data.Dataset[tuple[Any, Any]]):
    """The part of ``torchvision.datasets.ImageFolder`` the examples use.

    Classes are the sorted sub-folders; samples are ``(path, class_index)`` in sorted order;
    ``__getitem__`` returns ``(transform(loader(path)), class_index)``. The default loader is
    torchvision's: the file opened with PIL and converted to RGB.
    """

    def __init__(
        self,
        root: Any,
        transform: Any = None,
        target_transform: Any = None,
        loader: Callable[[str], Any] | None = None,
    ) -> None:
        self.root = os.fspath(root)
        self.transform = transform
        self.target_transform = target_transform
        self.loader = loader if loader is not None else pil_loader
        self.classes = sorted(entry.name for entry in os.scandir(self.root) if entry.is_dir())
        self.class_to_idx = {name: index for index, name in enumerate(self.classes)}
        self.samples = [
            (os.path.join(self.root, name, file), self.class_to_idx[name])
            for name in self.classes
            for file in sorted(os.listdir(os.path.join(self.root, name)))
            if file.lower().endswith((".jpg", ".jpeg"))
        ]
        self.targets = [target for _, target in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        path, target = self.samples[index]
        sample = self.loader(path)
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target


def pil_loader(path: str) -> Any:
    """torchvision's ``default_loader`` without accimage: a PIL image in RGB."""
    from PIL import Image

    with open(path, "rb") as file:
        image = Image.open(file)
        return image.convert("RGB")


def read_filepath(path: str) -> np.ndarray:
    return np.frombuffer(path.encode(), dtype=np.int8)


# ------------------------------------------------------------------------------------------------
# Example 1 - Full integration with PyTorch via DALI proxy DataLoader


@pipeline_def
def rn50_train_pipe(decoder_device: str = "mixed") -> DataNode:
    # The documentation's pipeline; ``decoder_device`` is "mixed" there, "cpu" for CPU runs.
    rng = fn.random.coin_flip(probability=0.5)
    filepaths = fn.external_source(name="images", no_copy=True)
    jpegs = fn.io.file.read(filepaths)  # type: ignore[attr-defined]
    images = fn.decoders.image_random_crop(
        jpegs,
        device=decoder_device,
        output_type=types.RGB,  # type: ignore[attr-defined]
        random_aspect_ratio=[0.75, 4.0 / 3.0],
        random_area=[0.08, 1.0],
    )
    images = fn.resize(  # type: ignore[assignment]
        images,
        size=[224, 224],
        interp_type=types.INTERP_LINEAR,  # type: ignore[attr-defined]
        antialias=False,
    )
    output = fn.crop_mirror_normalize(
        images,
        dtype=types.FLOAT,  # type: ignore[attr-defined]
        output_layout="CHW",
        crop=(224, 224),
        mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
        std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
        mirror=rng,
    )
    return output  # noqa: RET504 (as documented)


def example_1(
    dali_proxy: ModuleType,
    jpeg: Path,
    *,
    batch_size: int,
    device_id: int | None = 0,
    decoder_device: str = "mixed",
    nworkers: int = 8,
) -> Batches:
    """Example 1; the documentation's values are ``device_id=0``, "mixed" and 8 workers."""
    consumed: Batches = []
    pipe = rn50_train_pipe(
        batch_size=16,
        num_threads=3,
        device_id=device_id,
        prefetch_queue_depth=2 * nworkers,
        decoder_device=decoder_device,
    )

    # The scope makes sure the server starts and stops at enter/exit
    with dali_proxy.DALIServer(pipe) as dali_server:
        # DALI proxy instance can be used as a transform callable
        dataset = ImageFolder(jpeg, transform=dali_server.proxy, loader=read_filepath)

        # Same interface as torch DataLoader, but takes a dali_server as first argument
        loader = dali_proxy.DataLoader(
            dali_server,
            dataset,
            batch_size=batch_size,
            num_workers=nworkers,
            drop_last=True,
        )

        for data, target in loader:
            # consume it
            consumed.append((data.clone(), target.clone()))
    return consumed


# ------------------------------------------------------------------------------------------------
# Example 2 - Manual execution using DALI proxy / DALI server and PyTorch's default_collate


@pipeline_def
def my_pipe() -> tuple[DataNode, DataNode]:
    a = fn.external_source(name="a", no_copy=True)
    b = fn.external_source(name="b", no_copy=True)
    return a + b, a - b


def example_2(
    dali_proxy: ModuleType, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Example 2. The documentation calls ``my_pipe(device='cpu', ...)``, which DALI's own
    ``pipeline_def`` rejects ("Please double-check the `device` argument") before any proxy is
    involved, so ``device='cpu'`` is left out: the pipeline is a CPU one through
    ``device_id=None``."""
    with dali_proxy.DALIServer(
        my_pipe(batch_size=batch_size, num_threads=3, device_id=None)
    ) as dali_server:
        outs = []
        for _ in range(batch_size):
            a = np.array(np.random.rand(3, 3), dtype=np.float32)
            b = np.array(np.random.rand(3, 3), dtype=np.float32)
            out0, out1 = dali_server.proxy(a=a, b=b)
            outs.append((a, b, out0, out1))

        outs = torch.utils.data.dataloader.default_collate(outs)

        a, b, a_plus_b, a_minus_b = dali_server.produce_data(outs)
        return a.clone(), b.clone(), a_plus_b.clone(), a_minus_b.clone()


# ------------------------------------------------------------------------------------------------
# Example 3 - Full integration with PyTorch but using the original PyTorch DataLoader


def example_3(
    dali_proxy: ModuleType,
    jpeg: Path,
    *,
    batch_size: int,
    nworkers: int,
    device_id: int | None = 0,
    decoder_device: str = "mixed",
) -> Batches:
    """Example 3, with the pipeline of Example 1 (the documentation's ``rn50_train_pipe(...)``)."""
    consumed: Batches = []
    pipe = rn50_train_pipe(
        batch_size=16,
        num_threads=3,
        device_id=device_id,
        prefetch_queue_depth=2 * max(nworkers, 1),
        decoder_device=decoder_device,
    )
    with dali_proxy.DALIServer(pipe) as dali_server:
        dataset = ImageFolder(jpeg, transform=dali_server.proxy, loader=read_filepath)

        # Using PyTorch DataLoader directly
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=nworkers,
            drop_last=True,
        )

        for data, target in loader:
            # replaces the output reference with actual data
            data = dali_server.produce_data(data)  # noqa: PLW2901 (as documented)
            consumed.append((data.clone(), target.clone()))
    return consumed


# ------------------------------------------------------------------------------------------------
# A deterministic image pipeline (no random operators) to compare the two proxies exactly.


@pipeline_def(batch_size=8, num_threads=2, device_id=None, seed=5)
def eval_pipe() -> DataNode:
    filepaths = fn.external_source(name="images", no_copy=True)
    jpegs = fn.io.file.read(filepaths)  # type: ignore[attr-defined]
    images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)  # type: ignore[attr-defined]
    images = fn.resize(images, resize_shorter=72, interp_type=types.INTERP_LINEAR)  # type: ignore[assignment,attr-defined]
    return fn.crop_mirror_normalize(
        images,
        dtype=types.FLOAT,  # type: ignore[attr-defined]
        output_layout="CHW",
        crop=(64, 64),
        mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
        std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
    )


def run_image_folder(
    dali_proxy: ModuleType,
    pipe: Pipeline,
    jpeg: Path | str,
    *,
    batch_size: int,
    num_workers: int,
    deterministic: bool = False,
) -> Batches:
    """``(data, target)`` batches of ``jpeg`` through ``pipe``, as Examples 1 and 3 run them.

    With workers it uses the module's own DataLoader (Example 1); without, torch's DataLoader
    and ``produce_data`` (Example 3), since DALI's proxy DataLoader needs worker processes.
    """
    consumed: Batches = []
    with dali_proxy.DALIServer(pipe, deterministic=deterministic) as dali_server:
        dataset = ImageFolder(jpeg, transform=dali_server.proxy, loader=read_filepath)
        if num_workers:
            loader = dali_proxy.DataLoader(
                dali_server, dataset, batch_size=batch_size, num_workers=num_workers
            )
            batches: Iterator[Any] = iter(loader)
        else:
            loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
            batches = (dali_server.produce_data(batch) for batch in loader)
        for data, target in batches:
            consumed.append((data.clone(), target.clone()))
    return consumed


# ------------------------------------------------------------------------------------------------
# The examples of DALI's proxy tutorial (docs/plugins/pytorch_dali_proxy.rst), run as written
# there but on the CPU (device_id=None) and on the small image folder.


@pipeline_def
def my_dali_pipeline(size: int = 224) -> DataNode:
    # "DALI Proxy in a Nutshell": the images come decoded, from ImageFolder's default loader.
    images = fn.external_source(name="images", no_copy=True)
    images = fn.resize(images, size=[size, size])  # type: ignore[assignment]
    return fn.crop_mirror_normalize(
        images,
        dtype=types.FLOAT,  # type: ignore[attr-defined]
        output_layout="CHW",
        mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
        std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
    )


def nutshell(
    dali_proxy: ModuleType, root: Path, *, batch_size: int = 8, num_workers: int = 2
) -> Batches:
    """ "DALI Proxy in a Nutshell": ImageFolder with its default (PIL) loader."""
    consumed: Batches = []
    pipe = my_dali_pipeline(batch_size=batch_size, num_threads=3, device_id=None, size=96)
    with dali_proxy.DALIServer(pipe) as dali_server:
        dataset = ImageFolder(root, transform=dali_server.proxy)
        loader = dali_proxy.DataLoader(
            dali_server, dataset, batch_size=batch_size, num_workers=num_workers, drop_last=True
        )
        for data, target in loader:
            consumed.append((data.clone(), target.clone()))
    return consumed


@pipeline_def
def example_pipeline2(device: str = "cpu") -> tuple[DataNode, DataNode]:
    a = fn.external_source(name="a", no_copy=True)
    b = fn.external_source(name="b", no_copy=True)
    return a + b, b - a


def two_inputs(
    dali_proxy: ModuleType, *, batch_size: int = 10, seed: int = 3
) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[torch.Tensor]]:
    """Sections 2 and 3: two inputs by keyword (``proxy(b=b, a=a)``), collated and produced.

    Section 2 also shows ``proxy(a, b)``; DALI's proxy takes several inputs by keyword only
    and refuses that call with a ValueError (see ``positional_two_inputs``)."""
    rng = np.random.default_rng(seed)
    with dali_proxy.DALIServer(
        example_pipeline2(batch_size=batch_size, num_threads=3, device_id=None)
    ) as dali_server:
        inputs: list[tuple[np.ndarray, np.ndarray]] = []
        outs: Any = []
        for _ in range(batch_size):
            a = np.array(rng.random((3, 3)), dtype=np.float32)
            b = np.array(rng.random((3, 3)), dtype=np.float32)
            a_plus_b, b_minus_a = dali_server.proxy(b=b, a=a)
            inputs.append((a, b))
            outs.append((a_plus_b, b_minus_a))
        outs = torch.utils.data.dataloader.default_collate(outs)
        outs = dali_server.produce_data(outs)
        return inputs, [tensor.clone() for tensor in outs]


def positional_two_inputs(dali_proxy: ModuleType) -> Exception | None:
    """Section 2's ``proxy(a, b)``: what it raises, or None."""
    with dali_proxy.DALIServer(
        example_pipeline2(batch_size=2, num_threads=1, device_id=None)
    ) as dali_server:
        a = np.ones((3, 3), dtype=np.float32)
        try:
            dali_server.proxy(a, a)
        except Exception as error:
            return error
        return None


class Meta:
    """A custom object in a sample: produce_data replaces references in its attributes."""

    def __init__(self, image: Any, label: Any) -> None:
        self.image = image
        self.label = label


class NestedDataset(torch.utils.data.Dataset[dict[str, Any]]):
    """Section 4's CustomDataset, returning the processed sample inside nested structures."""

    def __init__(
        self, transform_fn: Callable[[np.ndarray], Any], data: list[tuple[str, int]]
    ) -> None:
        self.data = data
        self.transform_fn = transform_fn

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        filename, label = self.data[idx]
        image = self.transform_fn(read_filepath(filename))
        return {"sample": (image, [label, {"again": image}]), "label": label}


def files_and_labels(root: Path) -> list[tuple[str, int]]:
    return [(path, label) for path, label in ImageFolder(root).samples]


def nested_structures(
    dali_proxy: ModuleType, root: Path, *, batch_size: int = 5
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Section 4 and produce_data on nested structures: a dict of tuples of lists of dicts, a
    named tuple and an object's attributes, each holding batch references."""
    pipe = eval_pipe()
    with dali_proxy.DALIServer(pipe) as dali_server:
        dataset = NestedDataset(dali_server.proxy, files_and_labels(root))
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
        Pair = collections.namedtuple("Pair", ["image", "label"])
        consumed = []
        for batch in loader:
            image_ref = batch["sample"][0]
            wrapped = {
                "batch": batch,
                "pair": Pair(image_ref, batch["label"]),
                "meta": Meta(image_ref, batch["label"]),
            }
            produced = dali_server.produce_data(wrapped)
            image, (label, inner) = produced["batch"]["sample"]
            assert produced["pair"].image is image and produced["meta"].image is image
            assert inner["again"] is image
            consumed.append((image.clone(), label.clone(), produced["batch"]["label"].clone()))
        return consumed


def explicit_threads(
    dali_proxy: ModuleType, root: Path, *, batch_size: int = 8, num_workers: int = 2
) -> Batches:
    """The server started with ``start_thread()`` and stopped with ``stop_thread()``."""
    dali_server = dali_proxy.DALIServer(eval_pipe())
    dali_server.start_thread()
    try:
        dataset = ImageFolder(root, transform=dali_server.proxy, loader=read_filepath)
        loader = dali_proxy.DataLoader(
            dali_server, dataset, batch_size=batch_size, num_workers=num_workers
        )
        return [(data.clone(), target.clone()) for data, target in loader]
    finally:
        dali_server.stop_thread()


class ListCollateLoader(torch.utils.data.DataLoader[tuple[Any, int]]):
    """A custom DataLoader: batches as lists of [images, labels, dataset indices]."""

    def __init__(self, dataset: torch.utils.data.Dataset[tuple[Any, int]], **kwargs: Any) -> None:
        super().__init__(dataset, collate_fn=self.collate, **kwargs)

    @staticmethod
    def collate(samples: list[tuple[Any, int]]) -> list[Any]:
        images, labels = zip(*samples, strict=True)
        collated = torch.utils.data.default_collate(list(images))
        return [collated, torch.tensor(labels), len(samples)]


def custom_loader(
    dali_proxy: ModuleType, root: Path, *, batch_size: int = 8, num_workers: int = 2
) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Section 5: a custom DataLoader, with ``produce_data`` called explicitly."""
    with dali_proxy.DALIServer(eval_pipe()) as dali_server:
        dataset = ImageFolder(root, transform=dali_server.proxy, loader=read_filepath)
        loader = ListCollateLoader(dataset, batch_size=batch_size, num_workers=num_workers)
        consumed = []
        for data in loader:
            processed_data = dali_server.produce_data(data)
            images, labels, count = processed_data
            consumed.append((images.clone(), labels.clone(), count))
        return consumed
