"""Plain causes of bad samples, read from their bytes (or their file's)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from PIL import Image

from dalid.server.samples.causes import bytes_cause, explain


def _encoded(fmt: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 200, 30)).save(out, format=fmt)
    return out.getvalue()


def _cause(data: bytes, message: str = "nvImageCodec failure: '#4'") -> str | None:
    return bytes_cause(data[:64], data[-64:], len(data), message)


def test_each_cause_dalid_can_tell() -> None:
    jpeg, png = _encoded("JPEG"), _encoded("PNG")
    assert _cause(b"") == "empty (0 bytes)"
    assert _cause(jpeg[:200]) == "a truncated JPEG (200 bytes, cut before its end-of-image marker)"
    assert (_cause(png[:40]) or "").startswith("a truncated PNG (40 bytes")
    assert _cause(_encoded("GIF")) == "a GIF, a format DALI's image decoder does not take"
    assert _cause(bytes(range(7, 107))) == (
        "not in an image format DALI decodes (100 bytes starting 07 08 09 0a 0b 0c 0d 0e)"
    )


def test_whole_images_and_other_failures_leave_dalis_message_alone() -> None:
    assert _cause(_encoded("JPEG")) is None
    assert _cause(_encoded("PNG")) is None
    assert _cause(bytes(range(100)), 'Assert on "x > 0" failed') is None  # not a decoder's


def test_explain_puts_the_cause_first_and_reads_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    arrays: dict[str, list[np.ndarray]] = {
        "jpegs": [np.frombuffer(_encoded("JPEG")[:100], np.uint8), np.zeros(3, np.uint8)],
        "paths": [np.frombuffer(str(empty).encode(), np.int8)] * 2,
    }
    found = {0: "Failed to decode sample #0", 1: "Some other error"}
    explained = explain(found, {"jpegs": arrays["jpegs"]})
    assert explained[0] == (
        "input 'jpegs': a truncated JPEG (100 bytes, cut before its end-of-image marker); "
        "DALI says: Failed to decode sample #0"
    )
    assert explained[1] == "Some other error"
    from_file = explain({1: "Failed to decode"}, {"paths": arrays["paths"]}, ["paths"])
    assert from_file[1] == f"input 'paths': {empty} is empty (0 bytes); DALI says: Failed to decode"


def test_explain_never_opens_what_is_not_a_regular_file(tmp_path: Path) -> None:
    """A path made a FIFO after its check: reading it to explain a failure must not block."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    paths = {"paths": [np.frombuffer(str(fifo).encode(), np.int8)]}
    assert explain({0: "Failed to decode"}, paths, ["paths"]) == {0: "Failed to decode"}
