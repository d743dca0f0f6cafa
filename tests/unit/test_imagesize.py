"""Declared image sizes: real files written by Pillow, and headers made by hand."""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np
import pytest
from PIL import Image, features

from dalid.server.samples.imagesize import DEFAULT_MAX_IMAGE_PIXELS, image_size, pixels

SIZE = (37, 23)  # width, height: odd and different, so a swap shows


def encoded(fmt: str, mode: str = "RGB", size: tuple[int, int] = SIZE, **options: object) -> bytes:
    rng = np.random.default_rng(0)
    channels = {"RGB": 3, "L": 1, "CMYK": 4, "RGBA": 4}[mode]
    pixels_ = rng.integers(0, 255, (size[1], size[0], channels), dtype=np.uint8)
    image = Image.fromarray(pixels_.squeeze(-1) if channels == 1 else pixels_, mode=mode)
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


@pytest.mark.parametrize(
    ("fmt", "mode", "options"),
    [
        ("JPEG", "RGB", {}),
        ("JPEG", "L", {}),
        ("JPEG", "CMYK", {}),
        ("JPEG", "RGB", {"progressive": True}),
        ("JPEG", "RGB", {"exif": b"Exif\x00\x00" + bytes(200)}),
        ("PNG", "RGB", {}),
        ("PNG", "RGBA", {}),
        ("GIF", "L", {}),
        ("BMP", "RGB", {}),
        ("TIFF", "RGB", {}),
        ("TIFF", "RGB", {"compression": "tiff_lzw"}),
    ],
)
def test_sizes_of_files_written_by_pillow(fmt: str, mode: str, options: dict[str, Any]) -> None:
    data = encoded(fmt, mode, **options)
    assert image_size(data) == SIZE
    assert image_size(memoryview(data)) == SIZE
    assert Image.open(io.BytesIO(data)).size == SIZE


def test_big_endian_tiff() -> None:
    tiff = b"MM\x00*" + struct.pack(">I", 8) + struct.pack(">H", 2)
    tiff += struct.pack(">HHI4s", 257, 4, 1, struct.pack(">I", 23))
    tiff += struct.pack(">HHI4s", 256, 3, 1, struct.pack(">HH", 37, 0))
    assert image_size(tiff) == SIZE


@pytest.mark.skipif(not features.check("webp"), reason="Pillow built without WebP")
@pytest.mark.parametrize("options", [{"lossless": False}, {"lossless": True}])
def test_webp(options: dict[str, Any]) -> None:
    assert image_size(encoded("WEBP", **options)) == SIZE
    assert image_size(encoded("WEBP", "RGBA", **options)) == SIZE


def with_jpeg_size(data: bytes, width: int, height: int) -> bytes:
    """The JPEG with its SOF0 marker patched to declare another size."""
    at = data.index(b"\xff\xc0")
    return data[: at + 5] + struct.pack(">HH", height, width) + data[at + 9 :]


def test_a_tiny_jpeg_declaring_30000_squared() -> None:
    bomb = with_jpeg_size(encoded("JPEG", size=(8, 8)), 30000, 30000)
    assert len(bomb) < 1024
    assert image_size(bomb) == (30000, 30000)
    assert pixels((30000, 30000)) > DEFAULT_MAX_IMAGE_PIXELS


def test_hand_made_headers() -> None:
    png = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">II", 70000, 2)
    assert image_size(png) == (70000, 2)
    gif = b"GIF89a" + struct.pack("<HH", 65535, 65535)
    assert image_size(gif) == (65535, 65535)
    bmp = b"BM" + bytes(12) + struct.pack("<Iii", 40, 100000, -50000)
    assert image_size(bmp) == (100000, 50000)  # negative height: top-down rows
    os2_bmp = b"BM" + bytes(12) + struct.pack("<IHH", 12, 300, 200)
    assert image_size(os2_bmp) == (300, 200)
    webp_vp8x = b"RIFF" + bytes(4) + b"WEBPVP8X" + bytes(8) + (99999).to_bytes(3, "little") * 2
    assert image_size(webp_vp8x) == (100000, 100000)
    tiff = b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 2)
    tiff += struct.pack("<HHI4s", 256, 4, 1, struct.pack("<I", 40000))
    tiff += struct.pack("<HHI4s", 257, 3, 1, struct.pack("<HH", 30000, 0))
    assert image_size(tiff) == (40000, 30000)


def test_jpeg_with_fill_bytes_and_restart_markers_before_the_frame() -> None:
    data = encoded("JPEG")
    # Fill bytes may precede any marker.
    padded = data[:2] + b"\xff\xff\xff" + data[2:]
    assert image_size(padded) == SIZE


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00",
        bytes(100),
        b"not an image at all",
        b"\xff\xd8\xff",  # JPEG signature and nothing else
        b"\xff\xd8\xff\xe0\x00\x10JFIF",  # cut inside the first segment
        b"\xff\xd8\xff\xd9",  # ends before any frame
        b"\xff\xd8\xff\xe0\x00\x00",  # a segment length below 2
        b"\x89PNG\r\n\x1a\n\x00\x00",  # PNG cut before IHDR
        b"\x89PNG\r\n\x1a\n" + bytes(4) + b"IDAT" + bytes(8),  # first chunk not IHDR
        b"GIF89a\x01",
        b"BM\x00",
        b"II*\x00\xff\xff\xff\x00",  # IFD offset past the end
        b"RIFF\x00\x00\x00\x00WAVEfmt ",  # a RIFF that is not WebP
    ],
)
def test_what_is_not_a_whole_header_gives_none(data: bytes) -> None:
    assert image_size(data) is None


def test_truncated_real_files_never_raise() -> None:
    for fmt in ("JPEG", "PNG", "GIF", "BMP", "TIFF"):
        data = encoded(fmt, "L" if fmt == "GIF" else "RGB")
        for cut in range(len(data[:400])):
            size = image_size(data[:cut])
            assert size is None or size == SIZE
