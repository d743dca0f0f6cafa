"""Pipelines that read files: the daemon opens them, as DALI's proxy would in the trainer.

Relative paths are taken from the trainer's working directory (the daemon runs in another);
a missing file is a bad sample that says so; a file the trainer reads and the daemon cannot see
fails the batch saying what to mount. The daemon here runs from the repository's directory,
never the test's, so a relative path read from the daemon's own directory would fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode

import dalid.client as dalid
from dalid.client import proxy as dalid_proxy

from ..daemons import DaemonProcess
from ..dali_typing import pipeline_def
from . import dropin_examples as examples
from .test_dropin import dalis_own_proxy


@pipeline_def(batch_size=4, num_threads=2, device_id=None)
def read_pipeline() -> DataNode:
    paths = fn.external_source(name="paths", no_copy=True)
    # DALI's stubs lack fn.io, and type resize's result as a union.
    images = fn.decoders.image(
        fn.io.file.read(paths),  # type: ignore[attr-defined]
        device="cpu",
        output_type=types.DALIImageType.RGB,
    )
    return fn.resize(images, resize_x=32, resize_y=32)  # type: ignore[return-value]


def path_sample(path: str) -> np.ndarray:
    return np.frombuffer(path.encode(), dtype=np.int8)


@pytest.fixture
def in_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's working directory holds ``images/class_k/img_i.jpg``; nothing else does."""
    examples.make_image_folder(tmp_path / "images", classes=2, per_class=4)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_relative_paths_are_read_from_the_trainers_directory_as_with_dalis_proxy(
    daemon: DaemonProcess, in_images: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DALID_SOCKET", str(daemon.socket))
    assert os.getcwd() != str(daemon.socket.parent)
    for workers in (0, 2):
        ours = examples.run_image_folder(
            dalid_proxy, examples.eval_pipe(), "images", batch_size=4, num_workers=workers
        )
        assert [len(target) for _, target in ours] == [4, 4]
        theirs = examples.run_image_folder(
            dalis_own_proxy(monkeypatch),
            examples.eval_pipe(),
            "images",
            batch_size=4,
            num_workers=workers,
        )
        for (data, target), (expected, expected_target) in zip(ours, theirs, strict=True):
            assert torch.equal(target, expected_target)
            assert torch.equal(data, expected)


def test_a_missing_file_is_a_bad_sample_that_says_so(
    daemon: DaemonProcess, in_images: Path
) -> None:
    paths = ["images/class_0/img_0.jpg", "images/class_0/nope.jpg", "images/class_1/img_1.jpg"]
    with dalid.connect(socket=daemon.socket, autostart=False) as session:
        raising = session.proxy(read_pipeline())
        batch = torch.utils.data.default_collate([raising(path_sample(p)) for p in paths])
        with pytest.raises(dalid.BatchError) as caught:
            session.produce_data(batch)
        assert caught.value.positions == [1]
        message = str(caught.value)
        assert f"cannot read {in_images}/images/class_0/nope.jpg, in the trainer either" in message
        skipping = session.proxy(read_pipeline(), on_error="skip")
        batch = torch.utils.data.default_collate([skipping(path_sample(p)) for p in paths])
        images = session.produce_data(batch)
        assert images.shape == (2, 32, 32, 3)
        (report,) = session.last_bad_samples
        assert report.position == 1 and "in the trainer either" in report.message


def test_a_file_the_daemon_cannot_see_fails_saying_what_to_mount(
    daemon: DaemonProcess, in_images: Path
) -> None:
    # A path that names a file in this process only: its own descriptor 987, which the
    # daemon, another process, does not have (as it would not have another container's files).
    with open(in_images / "images/class_0/img_0.jpg", "rb") as image:
        os.dup2(image.fileno(), 987)
    try:
        private = "/proc/self/fd/987"
        assert os.access(private, os.R_OK)
        with dalid.connect(socket=daemon.socket, autostart=False) as session:
            # Whatever on_error says: every batch would fail the same way.
            proxy = session.proxy(read_pipeline(), on_error="skip")
            shared = "images/class_0/img_1.jpg"
            batch = torch.utils.data.default_collate(
                [proxy(path_sample(shared)), proxy(path_sample(private))]
            )
            with pytest.raises(dalid.BatchError) as caught:
                session.produce_data(batch)
    finally:
        os.close(987)
    message = str(caught.value)
    assert f"cannot open {private}, which the trainer reads" in message
    assert "does not see the trainer's files" in message
    assert "Mount the dataset's directory (/proc/self/fd/987, or one above it)" in message
    assert "decode" not in message.lower()


# The unseen directory first: the batch is refused before it runs; later: its run fails in
# DALI, and the check of each file after the failure says the same.
@pytest.mark.parametrize("unseen_first", [True, False])
def test_a_directory_the_daemon_cannot_see_fails_the_batch_saying_what_to_mount(
    daemon: DaemonProcess, in_images: Path, unseen_first: bool
) -> None:
    """The daemon looks at one directory of a batch's paths, not at each file (Note [Checking
    paths per directory]): a dataset directory it does not have (here the trainer's own
    descriptor 986 of the image folder) fails the batch at that look, or after the run that
    fails on it, saying what to mount either way."""
    folder = os.open(in_images / "images", os.O_RDONLY | os.O_DIRECTORY)
    os.dup2(folder, 986)
    os.close(folder)
    try:
        unseen = "/proc/self/fd/986/class_1/img_2.jpg"
        assert os.access(unseen, os.R_OK)
        seen = "images/class_0/img_1.jpg"
        order = (unseen, seen) if unseen_first else (seen, unseen)
        with dalid.connect(socket=daemon.socket, autostart=False) as session:
            proxy = session.proxy(read_pipeline(), on_error="replace")
            batch = torch.utils.data.default_collate([proxy(path_sample(p)) for p in order * 2])
            with pytest.raises(dalid.BatchError) as caught:
                session.produce_data(batch)
            # The daemon goes on serving the job's next batch.
            good = torch.utils.data.default_collate(
                [proxy(path_sample(f"images/class_0/img_{i}.jpg")) for i in range(4)]
            )
            assert session.produce_data(good).shape == (4, 32, 32, 3)
    finally:
        os.close(986)
    message = str(caught.value)
    assert f"cannot open {unseen}, which the trainer reads" in message
    assert "(/proc/self/fd/986 does not exist where the daemon runs" in message
    assert caught.value.positions == []
