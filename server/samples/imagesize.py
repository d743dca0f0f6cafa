"""Declared image sizes read from encoded headers, before anything is decoded.

A few bytes can declare an image of billions of pixels (a "decompression bomb"): DALI's CPU
decoder then allocates the whole image and returns garbage without an error. The daemon reads
the width and height that JPEG, PNG, GIF, BMP, TIFF and WebP headers declare and refuses a
sample over its ``--max-image-pixels`` before DALI sees it.

Which samples are images: a sample of any external_source input that is a 1-D ``uint8`` byte
string and starts with the signature of one of those formats. Everything else (tensors, labels,
file names, unknown formats) is not checked. Pure functions over bytes: no I/O, no DALI.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
"""Pillow's default ``Image.MAX_IMAGE_PIXELS``: about a quarter gigabyte of RGB pixels."""

Size = tuple[int, int]
"""(width, height) in pixels."""

# JPEG start-of-frame markers: C0-CF except DHT (C4), JPG (C8) and DAC (CC).
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers that stand alone, without a length: TEM, RSTn, SOI, EOI.
_STANDALONE = frozenset({0x01, *range(0xD0, 0xDA)})


def image_size(data: bytes | memoryview) -> Size | None:
    """The size an encoded image declares, or None when ``data`` is not a header we know.

    A truncated or malformed header of a known format gives None too: DALI then fails on it,
    and that failure is handled as any corrupt sample is.
    """
    head = bytes(data[:16])
    # Most samples that are not images go after one lookup of their first byte.
    for signature, parse in _PARSERS_BY_FIRST_BYTE.get(head[:1], ()):
        if head.startswith(signature):
            try:
                return parse(data)
            except (struct.error, IndexError, ValueError):
                return None
    return None


def pixels(size: Size) -> int:
    return size[0] * size[1]


def _jpeg(data: bytes | memoryview) -> Size | None:
    position = 2
    end = len(data)
    while position + 4 <= end:
        if data[position] != 0xFF:
            return None
        marker = data[position + 1]
        if marker == 0xFF:  # fill byte before a marker
            position += 1
            continue
        if marker in _STANDALONE:
            position += 2
            continue
        if marker == 0xD9:  # end of image before any frame
            return None
        (length,) = struct.unpack_from(">H", data, position + 2)
        if marker in _SOF_MARKERS:
            height, width = struct.unpack_from(">HH", data, position + 5)
            return width, height
        if length < 2:
            return None
        position += 2 + length
    return None


def _png(data: bytes | memoryview) -> Size | None:
    # Signature (8), chunk length (4), "IHDR", width, height.
    if bytes(data[12:16]) != b"IHDR":
        return None
    width, height = struct.unpack_from(">II", data, 16)
    return width, height


def _gif(data: bytes | memoryview) -> Size | None:
    width, height = struct.unpack_from("<HH", data, 6)
    return width, height


def _bmp(data: bytes | memoryview) -> Size | None:
    (header_size,) = struct.unpack_from("<I", data, 14)
    if header_size == 12:  # OS/2 BITMAPCOREHEADER
        width, height = struct.unpack_from("<HH", data, 18)
        return width, height
    width, height = struct.unpack_from("<ii", data, 18)
    # A negative height means a top-down bitmap.
    return abs(width), abs(height)


def _tiff(data: bytes | memoryview) -> Size | None:
    order = "<" if bytes(data[:2]) == b"II" else ">"
    (offset,) = struct.unpack_from(order + "I", data, 4)
    (count,) = struct.unpack_from(order + "H", data, offset)
    found: dict[int, int] = {}
    for index in range(count):
        tag, kind, _, value = struct.unpack_from(order + "HHI4s", data, offset + 2 + 12 * index)
        if tag in (256, 257):  # ImageWidth, ImageLength: SHORT (3) or LONG (4)
            fmt = order + ("H" if kind == 3 else "I")
            found[tag] = struct.unpack_from(fmt, value)[0]
    if 256 in found and 257 in found:
        return found[256], found[257]
    return None


def _webp(data: bytes | memoryview) -> Size | None:
    if bytes(data[8:12]) != b"WEBP":
        return None
    chunk = bytes(data[12:16])
    if chunk == b"VP8 ":
        # Frame tag (3), start code (3), then 14-bit width and height.
        width, height = struct.unpack_from("<HH", data, 26)
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L":
        (bits,) = struct.unpack_from("<I", data, 21)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        raw = bytes(data[24:30])
        width = int.from_bytes(raw[0:3], "little") + 1
        height = int.from_bytes(raw[3:6], "little") + 1
        return width, height
    return None


_PARSERS: tuple[tuple[bytes, Callable[[bytes | memoryview], Size | None]], ...] = (
    (b"\xff\xd8\xff", _jpeg),
    (b"\x89PNG\r\n\x1a\n", _png),
    (b"GIF87a", _gif),
    (b"GIF89a", _gif),
    (b"BM", _bmp),
    (b"II*\x00", _tiff),
    (b"MM\x00*", _tiff),
    (b"RIFF", _webp),
)
# The same, by the first byte of their signatures.
_PARSERS_BY_FIRST_BYTE = {
    first: tuple(parser for parser in _PARSERS if parser[0][:1] == first)
    for first in {signature[:1] for signature, _ in _PARSERS}
}
