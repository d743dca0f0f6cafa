"""File paths as samples: found in the graph, made absolute, checked before a batch runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode

from dalid.client.paths import resolve_paths
from dalid.protocol.file_inputs import path_inputs
from dalid.server.paths import FilesUnseen, check_paths, first_missing

from ..dali_typing import pipeline_def


def _path(text: str, dtype: type = np.int8) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=dtype)


@pipeline_def(batch_size=2, num_threads=1, device_id=None)
def _two_kinds() -> tuple[DataNode, DataNode, DataNode]:
    paths = fn.external_source(name="paths", no_copy=True)
    other = fn.external_source(name="labels")
    more = fn.external_source(name="more_paths")
    # DALI's stubs lack fn.io.
    images = fn.decoders.image(
        fn.io.file.read(paths),  # type: ignore[attr-defined]
        output_type=types.DALIImageType.RGB,
    )
    return images, other, fn.io.file.read(more)  # type: ignore[attr-defined]


def test_inputs_that_feed_the_file_reader_are_paths() -> None:
    pipe = _two_kinds()
    pipe._build_graph()
    assert path_inputs(pipe) == ("paths", "more_paths")


def test_relative_paths_are_made_absolute_from_the_given_directory(tmp_path: Path) -> None:
    (tmp_path / "a.jpg").write_bytes(b"x")
    samples: dict[str, list[Any]] = {
        "paths": [_path("a.jpg"), _path(str(tmp_path / "a.jpg"), np.uint8), _path("gone.jpg")],
        "labels": [np.int32(1), np.int32(2), np.int32(3)],
    }
    resolved, unreadable = resolve_paths(samples, ["paths"], str(tmp_path))
    texts = [bytes(sample).decode() for sample in resolved["paths"]]
    assert texts == [str(tmp_path / "a.jpg"), str(tmp_path / "a.jpg"), str(tmp_path / "gone.jpg")]
    assert resolved["paths"][1].dtype == np.uint8
    assert unreadable == (2,)
    assert resolved["labels"] is samples["labels"]
    assert samples["paths"][0].tobytes() == b"a.jpg"  # the caller's samples are left as they were


def test_the_daemon_tells_a_missing_file_from_one_it_does_not_see(tmp_path: Path) -> None:
    (tmp_path / "a.jpg").write_bytes(b"x")
    arrays = {"paths": [_path(str(tmp_path / "a.jpg")), _path(str(tmp_path / "gone.jpg"))]}
    bad = check_paths(arrays, ["paths"], unreadable=[1])
    assert list(bad) == [1] and "in the trainer either" in bad[1]
    unseen = {"paths": [_path(str(tmp_path / "data" / "set" / "b.jpg"))]}
    with pytest.raises(FilesUnseen) as caught:
        check_paths(unseen, ["paths"], unreadable=[])
    assert f"({tmp_path / 'data'} does not exist where the daemon runs" in str(caught.value)
    assert "Mount the dataset's directory" in str(caught.value)
    empty = check_paths({"paths": [np.zeros(0, np.int8)]}, ["paths"], [])
    assert empty == {0: "input 'paths': '' is not a file path"}


def test_first_missing_is_the_outermost_missing_part(tmp_path: Path) -> None:
    assert first_missing(str(tmp_path / "x" / "y")) == str(tmp_path / "x")
    assert first_missing("/") == "/"
    assert first_missing(str(tmp_path)) == str(tmp_path)  # nothing missing
