"""Why a bad sample failed, in plain words, where its bytes tell: before DALI's own text.

DALI's messages for a sample it cannot decode often say little ("nvImageCodec failure: '#4'"
for random bytes, a GIF or a 1-byte sample). Once a sample is known bad (it failed on its own,
see ``badsamples.py``), its bytes usually say why: nothing at all, a JPEG or PNG cut short, a
GIF (which DALI's decoder does not take), bytes of no image format. For an input of file paths
(``paths.py``), the file's bytes are read instead, from its start and end only.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from .paths import PATH_DTYPES

# Image formats by signature, as imagesize.py reads them, and those DALI's decoders take.
SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"RIFF", "WebP"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
)
# How much of a file is read to explain it: its head and its tail.
PEEK_BYTES = 64
PNG_END = b"IEND\xae\x42\x60\x82"


def explain(
    found: Mapping[int, str],
    arrays: Mapping[str, np.ndarray | Sequence[np.ndarray]],
    path_inputs: Collection[str] = (),
) -> dict[int, str]:
    """``found`` (position: DALI's message) with the plain cause put first where one shows."""
    explained = {}
    for position, message in found.items():
        cause = None
        for name, samples in arrays.items():
            if position < len(samples):
                cause = _cause(samples[position], name in path_inputs, message)
            if cause is not None:
                cause = f"input {name!r}: {cause}"
                break
        explained[position] = message if cause is None else f"{cause}; DALI says: {message}"
    return explained


def _cause(sample: np.ndarray, is_path: bool, message: str) -> str | None:
    if is_path and sample.dtype in PATH_DTYPES and sample.ndim == 1:
        path = sample.tobytes()
        try:
            # Never waits: a path made a FIFO since it was checked (paths.py) would block a
            # plain open until a writer came; and only a regular file's bytes are read.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except (OSError, ValueError):
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return None
            size = info.st_size
            head = os.pread(fd, PEEK_BYTES, 0)
            tail = os.pread(fd, PEEK_BYTES, max(0, size - PEEK_BYTES))
        except OSError:
            return None
        finally:
            os.close(fd)
        cause = bytes_cause(head, tail, size, message)
        return None if cause is None else f"{os.fsdecode(path)} is {cause}"
    if sample.dtype != np.uint8 or sample.ndim != 1:
        return None
    data = sample.data
    return bytes_cause(bytes(data[:PEEK_BYTES]), bytes(data[-PEEK_BYTES:]), len(sample), message)


def bytes_cause(head: bytes, tail: bytes, size: int, message: str = "") -> str | None:
    """What an encoded sample is, judged by its first and last bytes and its size, when that
    explains a failure; None when it looks whole (DALI's message is all there is)."""
    if size == 0:
        return "empty (0 bytes)"
    kind = next((name for signature, name in SIGNATURES if head.startswith(signature)), None)
    if kind == "GIF":
        return "a GIF, a format DALI's image decoder does not take"
    if kind == "JPEG" and not tail.rstrip(b"\x00").endswith(b"\xff\xd9"):
        return f"a truncated JPEG ({size} bytes, cut before its end-of-image marker)"
    if kind == "PNG" and not tail.endswith(PNG_END):
        return f"a truncated PNG ({size} bytes, cut before its end chunk)"
    if kind is None and _decoding(message):
        shown = " ".join(f"{byte:02x}" for byte in head[:8])
        return f"not in an image format DALI decodes ({size} bytes starting {shown})"
    return None


def _decoding(message: str) -> bool:
    """Whether DALI's message is a decoder's: only then are unknown bytes "no image"."""
    lowered = message.lower()
    return "decod" in lowered or "nvimagecodec" in lowered or "image" in lowered
