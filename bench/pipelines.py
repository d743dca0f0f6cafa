"""The DALI pipelines of the DALI-based contenders and of the transport probes.

Every contender does the same work per image (see the augmentation in :mod:`bench.config`).
The DALI contenders differ only in how file bytes enter the pipeline: DALI's own file reader,
file paths fed through ``fn.external_source`` and read with ``fn.io.file.read``, which is
what the proxy APIs need (as in DALI's proxy documentation), or file bytes that DataLoader
workers read, fed through ``fn.external_source`` in the trainer. On a machine with a GPU the
decoder is ``mixed`` and the rest runs on the GPU.

Two augmentations (``Settings.pipeline``): ``rrc`` decodes whole images, then crops at random,
flips and normalizes into float32 CHW; ``train``, the GPU profile's, is an ImageNet-style
training pipeline as DALI's ResNet-50 examples and its QA decoder benchmark (hw_decoder_bench
``-p rn50``) have it: the decoder decodes a random crop, which is resized, flipped and
normalized into float16 NCHW.
"""

from __future__ import annotations

from typing import Any

import torch
from nvidia.dali import fn, types
from nvidia.dali.pipeline import pipeline_def

from .config import AREA, CROP, MEAN, RATIO, STD

PATH_INPUT = "paths"
TINY_INPUT = "data"


def _options(batch_size: int, num_threads: int, gpu: bool, **more: Any) -> dict[str, Any]:
    # device_id None makes a CPU-only pipeline, which needs no GPU or CUDA driver.
    return {
        "batch_size": batch_size,
        "num_threads": num_threads,
        "device_id": 0 if gpu else None,
        **more,
    }


def _augment(
    jpegs: Any, gpu: bool, pipeline: str, hw_decoder_load: float | None, crop: int = CROP
) -> Any:
    if pipeline == "train":
        return _train(jpegs, gpu, hw_decoder_load)
    images = fn.decoders.image(
        jpegs, device="mixed" if gpu else "cpu", output_type=types.DALIImageType.RGB
    )
    images = fn.random_resized_crop(
        images, size=[crop, crop], random_area=list(AREA), random_aspect_ratio=list(RATIO)
    )
    return fn.crop_mirror_normalize(
        images,
        dtype=types.DALIDataType.FLOAT,
        output_layout="CHW",
        mean=list(MEAN),
        std=list(STD),
        mirror=fn.random.coin_flip(probability=0.5),
    )


def _train(jpegs: Any, gpu: bool, hw_decoder_load: float | None) -> Any:
    decoder: dict[str, Any] = {}
    if gpu and hw_decoder_load is not None:
        decoder["hw_decoder_load"] = hw_decoder_load
    images = fn.decoders.image_random_crop(
        jpegs,
        device="mixed" if gpu else "cpu",
        output_type=types.DALIImageType.RGB,
        random_area=list(AREA),
        random_aspect_ratio=list(RATIO),
        **decoder,
    )
    # The ignore: DALI's stub types resize's result as a union that crop_mirror_normalize refuses.
    return fn.crop_mirror_normalize(
        fn.resize(images, resize_x=CROP, resize_y=CROP),  # type: ignore[arg-type]
        dtype=types.DALIDataType.FLOAT16,
        output_layout="CHW",
        crop=(CROP, CROP),
        mean=list(MEAN),
        std=list(STD),
        mirror=fn.random.coin_flip(probability=0.5),
    )


def reader_pipeline(
    root: str,
    batch_size: int,
    num_threads: int,
    gpu: bool,
    seed: int,
    *,
    pipeline: str = "rrc",
    hw_decoder_load: float | None = None,
    crop: int = CROP,
) -> Any:
    """DALI's file reader over an ImageFolder; outputs ``images`` and ``labels``."""

    @pipeline_def(**_options(batch_size, num_threads, gpu, seed=seed))
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(file_root=root, random_shuffle=True, name="Reader")
        return _augment(jpegs, gpu, pipeline, hw_decoder_load, crop), labels

    return pipe()


def fed_pipeline(
    source: Any,
    batch_size: int,
    num_threads: int,
    gpu: bool,
    seed: int,
    *,
    pipeline: str = "rrc",
    hw_decoder_load: float | None = None,
    crop: int = CROP,
) -> Any:
    """Batches of JPEG bytes and labels from ``source`` (an iterable of ``(jpegs, labels)``:
    a DataLoader's batches, each epoch a new iterator) through ``fn.external_source``;
    outputs ``images`` and ``labels``."""

    @pipeline_def(**_options(batch_size, num_threads, gpu, seed=seed))
    def pipe() -> Any:
        jpegs, labels = fn.external_source(source=source, num_outputs=2, batch=True)
        return _augment(jpegs, gpu, pipeline, hw_decoder_load, crop), labels

    return pipe()


def path_pipeline(
    batch_size: int,
    num_threads: int,
    gpu: bool,
    seed: int,
    *,
    pipeline: str = "rrc",
    hw_decoder_load: float | None = None,
    enable_checkpointing: bool = False,
    crop: int = CROP,
) -> Any:
    """File paths in (int8 arrays through ``external_source``), augmented images out."""

    options = _options(
        batch_size, num_threads, gpu, seed=seed, enable_checkpointing=enable_checkpointing
    )

    @pipeline_def(**options)
    def pipe() -> Any:
        paths = fn.external_source(name=PATH_INPUT, no_copy=True)
        jpegs = fn.io.file.read(paths)  # type: ignore[attr-defined]
        return _augment(jpegs, gpu, pipeline, hw_decoder_load, crop)

    return pipe()


def tiny_pipeline(batch_size: int, gpu: bool = False) -> Any:
    """An empty pipeline: its one output is its input (copied to the GPU with ``gpu``), so a
    run measures pure overhead: of the transport, and of delivering a GPU output."""

    # prefetch_queue_depth=1 so that the in-process baseline can use pipe.run(data=...).
    @pipeline_def(**_options(batch_size, 1, gpu, prefetch_queue_depth=1))
    def pipe() -> Any:
        data = fn.external_source(name=TINY_INPUT, no_copy=True)
        return data.gpu() if gpu else data

    return pipe()


def tiny_file_pipeline(batch_size: int) -> Any:
    """File paths in, each file's bytes out: what a file-path sample costs the daemon (its
    checks, its list of views) beside the tiny pipeline, with as little DALI work as can be."""

    @pipeline_def(**_options(batch_size, 1, False, prefetch_queue_depth=1))
    def pipe() -> Any:
        paths = fn.external_source(name=PATH_INPUT, no_copy=True)
        return fn.io.file.read(paths)  # type: ignore[attr-defined]

    return pipe()


def patch_nvtx_for_cpu_torch() -> None:
    """Lets DALI's proxy import on a CPU-only torch.

    The proxy calls ``torch.cuda.nvtx.range_push`` unconditionally, which raises "NVTX
    functions not installed" without CUDA; no-ops stand in (see shared/FACTS.md).
    """
    if torch.cuda.is_available():
        return

    def _noop(*_: object, **__: object) -> None:
        return None

    torch.cuda.nvtx.range_push = _noop
    torch.cuda.nvtx.range_pop = _noop
