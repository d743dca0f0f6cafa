"""Corrupt, unsupported and oversized images through a real daemon, by each on_error policy.

The expected outputs are the same pipeline's, run in this process on the good samples.
"""

from __future__ import annotations

import functools
import io
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode
from PIL import Image

import dalid.client as dalid
from dalid.client import proxy as dali_proxy
from dalid.protocol import ErrorCode

from ..daemons import DaemonProcess
from ..dali_typing import pipeline_def
from .helpers import run_in_process

BATCH = 8
SIDE = 32


@pipeline_def(batch_size=BATCH, num_threads=2, device_id=None, seed=7)
def decode_pipeline() -> DataNode:
    jpegs = fn.external_source(name="jpegs", no_copy=True)
    images = fn.decoders.image(jpegs, device="cpu", output_type=types.DALIImageType.RGB)
    return fn.resize(images, resize_x=SIDE, resize_y=SIDE)  # type: ignore[return-value]


@functools.cache
def photo_tiles() -> list[np.ndarray]:
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    return [photo[y : y + 48, x : x + 64] for photo in photos for y in (0, 200) for x in (0, 300)]


def encode(index: int, fmt: str = "JPEG", mode: str = "RGB", **options: object) -> bytes:
    tiles = photo_tiles()
    image = Image.fromarray(tiles[index % len(tiles)]).convert(mode)
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def bomb() -> bytes:
    """A JPEG under 1 KB whose frame header declares 30000x30000 pixels."""
    data = _small_jpeg()
    at = data.index(b"\xff\xc0")
    return data[: at + 5] + struct.pack(">HH", 30000, 30000) + data[at + 9 :]


def _small_jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(out, format="JPEG")
    return out.getvalue()


# Dataset index -> what is wrong with it. Batches of 8: batch 0 holds formats DALI's CPU decoder
# accepts, batch 1 and 2 bad samples, batch 3 is all good.
BAD = {
    9: "truncated",
    12: "random",
    15: "gif",
    16: "zero",
    20: "bomb",
}
DECODES_FINE = {1: "cmyk", 2: "progressive", 3: "png", 4: "bmp", 5: "gray"}
LENGTH = 32


def sample_bytes(index: int) -> bytes:
    kind = BAD.get(index) or DECODES_FINE.get(index)
    makers: dict[str | None, Callable[[], bytes]] = {
        None: lambda: encode(index),
        "truncated": lambda: encode(index)[: len(encode(index)) // 2],
        "random": lambda: np.random.default_rng(index).integers(0, 256, 3000, np.uint8).tobytes(),
        "gif": lambda: encode(index, "GIF", "P"),
        "zero": lambda: b"",
        "bomb": bomb,
        "cmyk": lambda: encode(index, "JPEG", "CMYK"),
        "progressive": lambda: encode(index, progressive=True),
        "png": lambda: encode(index, "PNG"),
        "bmp": lambda: encode(index, "BMP"),
        "gray": lambda: encode(index, "JPEG", "L"),
    }
    return makers[kind]()


def _known(index: int | None) -> int:
    """A report's index, which a DataLoader's reports always have."""
    assert index is not None
    return index


def as_array(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8) if data else np.zeros(0, np.uint8)


class ImageDataset(torch.utils.data.Dataset[tuple[Any, int, str]]):
    """(images, label, name) per sample; the label is the dataset index times 10."""

    def __init__(self, proxy: dalid.Proxy, indices: list[int]) -> None:
        self.proxy = proxy
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[Any, int, str]:
        index = self.indices[i]
        return self.proxy(as_array(sample_bytes(index))), index * 10, f"img{index}"


def expected(indices: list[int]) -> np.ndarray:
    """The pipeline run in this process on these dataset samples, as one batch."""
    batch = [as_array(sample_bytes(index)) for index in indices]
    return run_in_process(decode_pipeline(), [{"jpegs": batch}])[0][0]


def batches_of(indices: list[int]) -> list[list[int]]:
    return [indices[start : start + BATCH] for start in range(0, len(indices), BATCH)]


@pytest.fixture(scope="module")
def session(daemon: DaemonProcess) -> Iterator[dalid.Session]:
    with dalid.connect(socket=daemon.socket, autostart=False) as session:
        yield session


def test_cmyk_progressive_png_bmp_and_gray_decode_as_in_process(session: dalid.Session) -> None:
    proxy = session.proxy(decode_pipeline())
    loader = dalid.DataLoader(session, ImageDataset(proxy, list(range(8))), batch_size=BATCH)
    ((images, labels, _),) = list(loader)
    np.testing.assert_array_equal(images.numpy(), expected(list(range(8))))
    assert labels.tolist() == [10 * i for i in range(8)]
    assert loader.bad_samples == []


@pytest.mark.parametrize("num_workers", [0, 2])
def test_raise_names_positions_dataset_indices_and_dali_message(
    session: dalid.Session, num_workers: int
) -> None:
    proxy = session.proxy(decode_pipeline())
    indices = list(range(LENGTH))
    loader = dalid.DataLoader(
        session, ImageDataset(proxy, indices), batch_size=BATCH, num_workers=num_workers
    )
    iterator = iter(loader)
    first, _, _ = next(iterator)
    np.testing.assert_array_equal(first.numpy(), expected(list(range(8))))
    with pytest.raises(dalid.BatchError) as raised:
        next(iterator)
    error = raised.value
    assert error.code is ErrorCode.BAD_SAMPLES
    assert error.positions == [1, 4, 7]
    assert error.dataset_indices == [9, 12, 15]
    # The batch by the loader's step, each sample by its dataset index and in plain words,
    # then DALI's text.
    message = str(error)
    assert error.step == 1
    assert message.startswith(
        "Critical error in pipeline: "  # DALI's proxy's words, then dalid's
        f"loader step 1 (pipeline {error.pipeline_id} batch {error.batch_id} in the daemon's log) "
        "failed, 3 bad samples: sample 1 (dataset index 9): input 'jpegs': a truncated JPEG ("
    ), message
    assert "sample 4 (dataset index 12): input 'jpegs': not in an image format DALI decodes" in (
        message
    )
    assert "sample 7 (dataset index 15): input 'jpegs': a GIF, a format DALI's image" in message
    assert "DALI says: " in message and "nvImageCodec failure" in message
    with pytest.raises(dalid.BatchError) as raised:
        next(iterator)
    assert raised.value.positions == [0, 4] and raised.value.dataset_indices == [16, 20]
    message = str(raised.value)
    assert message.startswith("Critical error in pipeline: loader step 2 ")
    assert "sample 0 (dataset index 16): input 'jpegs': empty (0 bytes); DALI says:" in message
    assert "sample 4 (dataset index 20): input 'jpegs': the image declares 30000x30000" in message
    # The batches after the bad ones are whole and right.
    last, labels, _ = next(iterator)
    np.testing.assert_array_equal(last.numpy(), expected(list(range(24, 32))))
    assert labels.tolist() == [10 * i for i in range(24, 32)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_drops_bad_samples_with_their_labels(session: dalid.Session, num_workers: int) -> None:
    proxy = session.proxy(decode_pipeline(), on_error="skip")
    loader = dalid.DataLoader(
        session, ImageDataset(proxy, list(range(LENGTH))), batch_size=BATCH, num_workers=num_workers
    )
    seen = []
    for batch_indices, (images, labels, names) in zip(
        batches_of(list(range(LENGTH))), loader, strict=True
    ):
        good = [index for index in batch_indices if index not in BAD]
        np.testing.assert_array_equal(images.numpy(), expected(good))
        assert labels.tolist() == [10 * index for index in good]
        assert list(names) == [f"img{index}" for index in good]
        seen.extend(good)
    assert seen == [index for index in range(LENGTH) if index not in BAD]
    reports = loader.bad_samples
    assert [report.dataset_index for report in reports] == sorted(BAD)
    assert [report.step for report in reports] == [1, 1, 1, 2, 2]
    assert all(report.dropped for report in reports)
    assert [report.position for report in reports] == [1, 4, 7, 0, 4]
    assert "30000x30000" in reports[-1].message
    assert str(reports[0]).startswith(
        "loader step 1: sample 1 (dataset index 9) dropped: input 'jpegs': a truncated JPEG"
    )


def test_replace_fills_bad_positions_with_good_samples_and_their_labels(
    session: dalid.Session,
) -> None:
    proxy = session.proxy(decode_pipeline(), on_error="replace")
    indices = list(range(8, 24))
    loader = dalid.DataLoader(session, ImageDataset(proxy, indices), batch_size=BATCH)
    produced = list(loader)
    reports = loader.bad_samples
    # The loader's indices are the dataset's: ImageDataset maps them onto `indices`.
    assert [indices[_known(r.dataset_index)] for r in reports] == sorted(BAD)
    # In each batch the n-th bad sample takes the n-th good one's place.
    assert [(r.position, r.replaced_by) for r in reports] == [
        (1, 0),
        (4, 2),
        (7, 3),
        (0, 1),
        (4, 2),
    ]
    for batch_indices, (images, labels, names) in zip(batches_of(indices), produced, strict=True):
        rows = list(batch_indices)
        for report in reports:
            if indices[_known(report.dataset_index)] in batch_indices:
                rows[report.position] = batch_indices[_known(report.replaced_by)]
        np.testing.assert_array_equal(images.numpy(), expected(rows))
        assert labels.tolist() == [10 * index for index in rows]
        assert list(names) == [f"img{index}" for index in rows]


@pytest.mark.parametrize("policy", ["skip", "replace"])
def test_a_batch_of_only_bad_samples_fails_clearly(session: dalid.Session, policy: str) -> None:
    proxy = session.proxy(decode_pipeline(), on_error=policy)
    loader = dalid.DataLoader(session, ImageDataset(proxy, [9, 12, 15, 16]), batch_size=4)
    with pytest.raises(dalid.BatchError, match="every sample of the batch is bad") as raised:
        next(iter(loader))
    assert raised.value.code is ErrorCode.BAD_SAMPLES
    assert raised.value.dataset_indices == [0, 1, 2, 3]


def test_another_job_sees_nothing_of_it(daemon: DaemonProcess, session: dalid.Session) -> None:
    with dalid.connect(socket=daemon.socket, autostart=False) as other:
        good_proxy = other.proxy(decode_pipeline())
        bad_proxy = session.proxy(decode_pipeline())
        good = dalid.DataLoader(other, ImageDataset(good_proxy, list(range(24, 32))), batch_size=8)
        bad = dalid.DataLoader(session, ImageDataset(bad_proxy, list(range(8, 16))), batch_size=8)
        good_iterator = iter(good)
        with pytest.raises(dalid.BatchError):
            next(iter(bad))
        images, _, _ = next(good_iterator)
        np.testing.assert_array_equal(images.numpy(), expected(list(range(24, 32))))


def test_dropin_server_takes_on_error(daemon: DaemonProcess) -> None:
    with dali_proxy.DALIServer(
        decode_pipeline(), on_error="skip", socket=daemon.socket, autostart=False
    ) as server:
        loader = dali_proxy.DataLoader(
            server, ImageDataset(server.proxy, list(range(8, 16))), batch_size=BATCH
        )
        ((images, labels, _),) = list(loader)
        good = [index for index in range(8, 16) if index not in BAD]
        np.testing.assert_array_equal(images.numpy(), expected(good))
        assert labels.tolist() == [10 * index for index in good]
        # The session's own list names the dataset indices too.
        assert [r.position for r in server.last_bad_samples] == [1, 4, 7]
        assert [r.dataset_index for r in server.last_bad_samples] == [1, 4, 7]
        assert [r.dataset_index for r in loader.bad_samples] == [1, 4, 7]


def test_unknown_policy_is_refused_in_the_caller(session: dalid.Session) -> None:
    with pytest.raises(dalid.InputError, match="on_error must be one of"):
        session.proxy(decode_pipeline(), on_error="ignore")


def test_max_image_pixels_flag(short_tmp: Path) -> None:
    from ..daemons import start_daemon

    daemon = start_daemon(short_tmp, "--max-image-pixels", "3000")
    try:
        with dalid.connect(socket=daemon.socket, autostart=False) as session:
            assert session.limits.max_image_pixels == 3000
            proxy = session.proxy(decode_pipeline(), on_error="skip")
            small = encode(0)
            big = encode(1)
            tiny = _small_jpeg()  # 8x8
            assert Image.open(io.BytesIO(big)).size == (64, 48)  # 3072 pixels
            refs = [proxy(as_array(data)) for data in (tiny, big, small, tiny)]
            images = session.produce_data(torch.utils.data.default_collate(refs))
            reports = session.last_bad_samples
            assert [(r.position, r.dropped) for r in reports] == [(1, True), (2, True)]
            assert "64x48 pixels, over this daemon's limit of 3000" in reports[0].message
            reference = run_in_process(decode_pipeline(), [{"jpegs": [as_array(tiny)] * 2}])
            np.testing.assert_array_equal(images.numpy(), reference[0][0])
    finally:
        assert daemon.stop() == 0, daemon.log_text()


def test_skip_in_deterministic_mode(session: dalid.Session) -> None:
    proxy = session.proxy(decode_pipeline(), deterministic=True, on_error="skip")
    indices = list(range(8, 24))
    loader = dalid.DataLoader(session, ImageDataset(proxy, indices), batch_size=BATCH)
    for batch_indices, (images, labels, _) in zip(batches_of(indices), loader, strict=True):
        good = [index for index in batch_indices if index not in BAD]
        np.testing.assert_array_equal(images.numpy(), expected(good))
        assert labels.tolist() == [10 * index for index in good]
    assert [indices[_known(r.dataset_index)] for r in loader.bad_samples] == sorted(BAD)


class FlakyDataset(ImageDataset):
    """Raises for index 0, as a dataset with a missing file does (before any proxy call of its
    batch: samples already given to the proxy would stay in its unfinished batch)."""

    def __getitem__(self, i: int) -> tuple[Any, int, str]:
        if i == 0:
            raise FileNotFoundError("img0")
        return super().__getitem__(i)


def test_dataset_indices_stay_right_after_a_batch_that_raised_in_the_dataset(
    session: dalid.Session,
) -> None:
    proxy = session.proxy(decode_pipeline())
    loader = dalid.DataLoader(session, FlakyDataset(proxy, list(range(16))), batch_size=BATCH)
    iterator = iter(loader)
    with pytest.raises(FileNotFoundError):
        next(iterator)
    with pytest.raises(dalid.BatchError) as raised:
        next(iterator)
    assert raised.value.dataset_indices == [9, 12, 15]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_with_the_legacy_executor(session: dalid.Session, num_workers: int) -> None:
    """With workers, several runs are in DALI at once, and the legacy executor raises a failure
    at the next collect, whichever run failed: each batch still gets its own outcome."""
    pipeline = decode_pipeline(exec_dynamic=False, prefetch_queue_depth=2)
    proxy = session.proxy(pipeline, on_error="skip")
    indices = list(range(8, 32))
    loader = dalid.DataLoader(
        session, ImageDataset(proxy, indices), batch_size=BATCH, num_workers=num_workers
    )
    for batch_indices, (images, labels, _) in zip(batches_of(indices), loader, strict=True):
        good = [index for index in batch_indices if index not in BAD]
        np.testing.assert_array_equal(images.numpy(), expected(good))
        assert labels.tolist() == [10 * index for index in good]
