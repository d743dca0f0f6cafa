"""The bench's dataset: JPEGs in the style asked for, each style cached apart."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image, JpegImagePlugin

from bench.dataset import JpegStyle, dataset_dir, make_imagefolder


def test_the_qa_style_makes_4_2_0_files_in_its_quality_range(tmp_path: Path) -> None:
    default = make_imagefolder(tmp_path / "default", num_images=6, num_classes=2)
    qa = JpegStyle.parse("420", "75-95")
    small = make_imagefolder(tmp_path / "qa", num_images=6, num_classes=2, style=qa)
    for path in default.paths:
        with Image.open(path) as image:
            assert JpegImagePlugin.get_sampling(image) == 0  # 4:4:4
    for path in small.paths:
        with Image.open(path) as image:
            assert JpegImagePlugin.get_sampling(image) == 2  # 4:2:0
    # The same crops, coarser: smaller files.
    assert small.mean_bytes < default.mean_bytes
    # Each style has a cache folder of its own; the default's keeps its old name.
    assert dataset_dir(6, 2, 0) == dataset_dir(6, 2, 0, JpegStyle())
    assert dataset_dir(6, 2, 0, qa).name.endswith("-j420-q75-95")
    # A folder of another style is made again, not reused.
    again = make_imagefolder(tmp_path / "default", num_images=6, num_classes=2, style=qa)
    with Image.open(again.paths[0]) as image:
        assert JpegImagePlugin.get_sampling(image) == 2


@pytest.mark.parametrize(
    ("subsampling", "quality"), [("411", "90"), ("420", "0-90"), ("444", "95-90")]
)
def test_styles_out_of_range_are_refused(subsampling: str, quality: str) -> None:
    with pytest.raises(ValueError):
        JpegStyle.parse(subsampling, quality)
