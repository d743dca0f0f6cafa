"""An ImageNet-like ImageFolder of JPEGs cut from the two photographs scikit-learn ships.

Each image is a random crop of ``china.jpg`` or ``flower.jpg`` (427x640), rescaled to an
ImageNet-typical size (300-500 px wide, 400x350 on average), maybe flipped, and saved at a
random JPEG quality with 4:4:4 chroma so that files average about 110 KB like ImageNet's.
Image ``i`` depends only on ``(seed, i)``, so a dataset is the same on every machine with the
same Pillow, and it is cached under ``bench/data/`` by its parameters. Another range of widths
makes small images the same way (the small profile's: 40-100 px wide).

Most of ImageNet's own files are 4:2:0 chroma at quality 75 to 95, which decode about twice as
fast as these: :class:`JpegStyle` makes such files (``python -m bench --jpeg-subsampling 420
--jpeg-quality 75-95``), to hold a figure against DALI's published ones.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

# Bump when the recipe changes, so that caches made by an older recipe are not reused.
RECIPE_VERSION = 1
DATA_DIR = Path(__file__).resolve().parent / "data"
EXTENSION = ".JPEG"  # ImageNet's spelling; DALI's file reader matches it case-insensitively
_COMPLETE = "COMPLETE.json"
# Datasets of this many images or more are rendered by several processes, in this many parts
# (the GPU profile's 8192 images take minutes in one process).
PARALLEL_FROM = 1024
PARALLEL_CHUNKS = 16

# Tuned once on the sample photographs: 92-100 with 4:4:4 chroma gives ~108 KB on average.
QUALITY_RANGE = (92, 100)
# Pillow's subsampling codes by chroma name.
SUBSAMPLING = {"444": 0, "422": 1, "420": 2}


@dataclass(frozen=True)
class JpegStyle:
    """How the JPEGs are saved: chroma subsampling (``444``, ``422`` or ``420``) and the range
    their quality is drawn from. The default is the recipe's own."""

    subsampling: str = "444"
    quality: tuple[int, int] = QUALITY_RANGE

    def __post_init__(self) -> None:
        if self.subsampling not in SUBSAMPLING:
            raise ValueError(f"chroma subsampling must be one of {sorted(SUBSAMPLING)}")
        low, high = self.quality
        if not 1 <= low <= high <= 100:
            raise ValueError("JPEG quality must be a range within 1-100")

    @classmethod
    def parse(cls, subsampling: str, quality: str) -> JpegStyle:
        """From command-line text: ``420`` and ``75-95`` (or one number)."""
        low, _, high = quality.partition("-")
        return cls(subsampling, (int(low), int(high or low)))

    @property
    def suffix(self) -> str:
        """What a dataset's folder name adds for this style ("" for the default)."""
        if self == JpegStyle():
            return ""
        return f"-j{self.subsampling}-q{self.quality[0]}-{self.quality[1]}"


WIDTH_RANGE = (300, 500)
ASPECT_RANGE = (0.65, 1.1)  # height / width
SCALE_RANGE = (0.8, 1.25)  # source pixels per output pixel


@dataclass(frozen=True)
class ImageFolder:
    """A generated dataset: its root and its files in ImageFolder order, with labels."""

    root: Path
    paths: tuple[Path, ...]
    labels: tuple[int, ...]
    total_bytes: int

    @property
    def mean_bytes(self) -> float:
        return self.total_bytes / max(1, len(self.paths))


def _sources() -> list[Image.Image]:
    # Imported here, not at the top: trainers read datasets but never generate them, and
    # scikit-learn would add to the peak memory the benchmark measures in them.
    from sklearn.datasets import load_sample_images

    return [Image.fromarray(array) for array in load_sample_images().images]


def class_name(label: int) -> str:
    return f"n{label:08d}"  # shaped like an ImageNet WordNet id


def _render(
    sources: list[Image.Image],
    seed: int,
    index: int,
    style: JpegStyle = JpegStyle(),
    widths: tuple[int, int] = WIDTH_RANGE,
) -> bytes:
    """The JPEG bytes of image ``index``, ``widths`` pixels wide (a range); depends only on
    ``(seed, index)``, ``style`` and ``widths``."""
    rng = np.random.default_rng([seed, index])
    source = sources[int(rng.integers(len(sources)))]
    width = int(rng.integers(widths[0], widths[1] + 1))
    height = round(width * rng.uniform(*ASPECT_RANGE))
    scale = min(rng.uniform(*SCALE_RANGE), source.width / width, source.height / height)
    crop_w, crop_h = width * scale, height * scale
    x = rng.uniform(0, max(0.0, source.width - crop_w))
    y = rng.uniform(0, max(0.0, source.height - crop_h))
    image = source.resize((width, height), Image.Resampling.BICUBIC, (x, y, x + crop_w, y + crop_h))
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    quality = int(rng.integers(style.quality[0], style.quality[1] + 1))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality, subsampling=SUBSAMPLING[style.subsampling])
    return out.getvalue()


def _write_images(
    root: Path,
    num_classes: int,
    seed: int,
    indices: range,
    style: JpegStyle = JpegStyle(),
    *,
    widths: tuple[int, int] = WIDTH_RANGE,
) -> None:
    """Renders images ``indices`` into their class folders under ``root``."""
    sources = _sources()
    for index in indices:
        label = index % num_classes
        file = root / class_name(label) / f"{class_name(label)}_{index:06d}{EXTENSION}"
        file.write_bytes(_render(sources, seed, index, style, widths))


def _widths_suffix(widths: tuple[int, int]) -> str:
    """What a dataset's folder name adds for its widths ("" for the recipe's own)."""
    return "" if tuple(widths) == WIDTH_RANGE else f"-w{widths[0]}-{widths[1]}"


def dataset_dir(
    num_images: int,
    num_classes: int,
    seed: int,
    style: JpegStyle = JpegStyle(),
    widths: tuple[int, int] = WIDTH_RANGE,
) -> Path:
    """The cache folder of a dataset with these parameters."""
    name = f"imagefolder-v{RECIPE_VERSION}-n{num_images}-c{num_classes}-s{seed}{style.suffix}"
    return DATA_DIR / (name + _widths_suffix(widths))


def make_imagefolder(
    root: str | os.PathLike[str] | None = None,
    num_images: int = 512,
    num_classes: int = 8,
    seed: int = 0,
    style: JpegStyle = JpegStyle(),
    *,
    widths: tuple[int, int] = WIDTH_RANGE,
) -> ImageFolder:
    """Generates (or reuses) an ImageFolder of ``num_images`` JPEGs in ``num_classes`` classes,
    saved in ``style``, ``widths`` pixels wide (a range: the small profile's are 40-100).

    ``root`` defaults to a cache folder under ``bench/data/`` named by the parameters. A folder
    holding a complete dataset with the same parameters is reused as it is.
    """
    if num_images < 1 or num_classes < 1:
        raise ValueError("num_images and num_classes must be positive")
    if not 8 <= widths[0] <= widths[1]:
        raise ValueError(f"image widths must be a range of 8 pixels or more, not {widths}")
    widths = (int(widths[0]), int(widths[1]))
    path = (
        Path(root)
        if root is not None
        else dataset_dir(num_images, num_classes, seed, style, widths)
    )
    params: dict[str, object] = {
        "recipe": RECIPE_VERSION,
        "num_images": num_images,
        "num_classes": num_classes,
        "seed": seed,
    }
    if style != JpegStyle():  # datasets of the default style keep their old markers
        params["jpeg"] = {"subsampling": style.subsampling, "quality": list(style.quality)}
    if widths != WIDTH_RANGE:  # likewise datasets of the recipe's widths
        params["widths"] = list(widths)
    marker = path / _COMPLETE
    if marker.exists() and json.loads(marker.read_text()).get("params") == params:
        return read_imagefolder(path)
    # A partial or different dataset: start over so that no stale file joins the new one.
    if path.exists():
        shutil.rmtree(path)
    staging = path.with_name(path.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    for label in range(num_classes):
        (staging / class_name(label)).mkdir(parents=True)
    chunks = [range(start, num_images, PARALLEL_CHUNKS) for start in range(PARALLEL_CHUNKS)]
    if num_images < PARALLEL_FROM:
        _write_images(staging, num_classes, seed, range(num_images), style, widths=widths)
    else:
        # Image i depends on (seed, i) alone, so the processes may split the work any way.
        workers = min(PARALLEL_CHUNKS, os.cpu_count() or 1)
        with concurrent.futures.ProcessPoolExecutor(workers) as pool:
            done = [
                pool.submit(_write_images, staging, num_classes, seed, c, style, widths=widths)
                for c in chunks
            ]
            for future in done:
                future.result()
    (staging / _COMPLETE).write_text(json.dumps({"params": params}) + "\n")
    # Renamed into place only once complete, so an interrupted run leaves no half dataset.
    staging.rename(path)
    return read_imagefolder(path)


def read_imagefolder(root: str | os.PathLike[str]) -> ImageFolder:
    """The files of ``root`` in ImageFolder order: sorted classes, sorted files, label = index."""
    folder = Path(root)
    paths: list[Path] = []
    labels: list[int] = []
    classes = sorted(entry.name for entry in folder.iterdir() if entry.is_dir())
    for label, name in enumerate(classes):
        files = sorted((folder / name).glob(f"*{EXTENSION}"))
        paths.extend(files)
        labels.extend([label] * len(files))
    total = sum(path.stat().st_size for path in paths)
    return ImageFolder(folder, tuple(paths), tuple(labels), total)
