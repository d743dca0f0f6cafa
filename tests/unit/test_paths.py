"""File paths as samples: found in the graph, made absolute, checked before a batch runs."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode

from dalid.client.worker.paths import resolve_paths
from dalid.protocol import InputBatch
from dalid.protocol.file_inputs import path_inputs
from dalid.server.samples.paths import (
    DirectoryChecks,
    FilesTooLarge,
    FilesUnseen,
    RegularFiles,
    check_paths,
    first_missing,
    unseen_file,
)

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


def _batch(*paths: str | bytes, name: str = "paths") -> list[InputBatch]:
    samples = [np.frombuffer(os.fsencode(path), np.int8) for path in paths]
    return [InputBatch.of(name, samples)]


def test_the_daemon_tells_a_missing_file_from_one_it_does_not_see(tmp_path: Path) -> None:
    (tmp_path / "a.jpg").write_bytes(b"x")
    checks = DirectoryChecks()
    bad = check_paths(
        _batch(str(tmp_path / "a.jpg"), str(tmp_path / "gone.jpg")), ["paths"], [1], checks
    )
    assert list(bad) == [1] and "in the trainer either" in bad[1]
    # A batch whose first path is in a directory the daemon does not see is refused before
    # it runs; one whose unseen path comes later runs, fails in DALI, and its failure, checked
    # file by file, says the same (Note [Checking paths per directory]).
    hidden = str(tmp_path / "data" / "set" / "b.jpg")
    messages = []
    with pytest.raises(FilesUnseen) as caught:
        check_paths(_batch(hidden, str(tmp_path / "a.jpg")), ["paths"], [], checks)
    messages.append(str(caught.value))
    later = _batch(str(tmp_path / "a.jpg"), hidden)
    assert check_paths(later, ["paths"], unreadable=[], directories=checks) == {}
    messages.append(unseen_file(later, ["paths"], []))
    for message in messages:
        assert f"cannot open {hidden}" in message
        assert f"({tmp_path / 'data'} does not exist where the daemon runs" in message
        assert "Mount the dataset's directory" in message
    assert messages[0] == messages[1]
    not_paths = check_paths(_batch(b"", b"/x/\0y", str(tmp_path / "a.jpg")), ["paths"], [])
    assert not_paths == {
        0: "input 'paths': '' is not a file path",
        1: "input 'paths': '/x/\\x00y' is not a file path",
    }
    # Another input's samples are not paths, whatever they hold.
    assert check_paths(_batch("/nowhere/x", name="labels"), ["paths"], []) == {}


def test_a_batch_whose_files_come_to_more_than_its_limit_is_refused(tmp_path: Path) -> None:
    # Sparse: a GiB by their size, which is what DALI would read, and nothing on disk.
    big, small = tmp_path / "big.bin", tmp_path / "small.bin"
    with big.open("wb") as file:
        file.truncate(1 << 30)
    small.write_bytes(b"x" * 1000)
    limit = 512 << 20
    batch = _batch(str(small), *[str(big)] * 8)
    with pytest.raises(FilesTooLarge) as caught:
        check_paths(batch, ["paths"], [], max_read_bytes=limit)
    message = str(caught.value)
    assert "come to 8 GiB" in message and "the 512 MiB one batch of a job may" in message
    assert f"the largest is input 'paths': {big} (1 GiB)" in message
    assert "--input-memory" in message
    # Within the limit, or with none, the same files pass; bad samples are not read, so they
    # count nothing (a FIFO, a /proc file by its zero size, a file nobody can read).
    assert check_paths(batch, ["paths"], [], max_read_bytes=9 << 30) == {}
    assert check_paths(batch, ["paths"], []) == {}
    unreadable = list(range(1, 9))
    assert set(check_paths(batch, ["paths"], unreadable, max_read_bytes=2000)) == set(unreadable)
    with pytest.raises(FilesTooLarge, match=r"come to 1\.95 KiB"):
        check_paths(_batch(str(small), str(small)), ["paths"], [], max_read_bytes=1999)


def test_one_directory_is_looked_at_a_batch_whatever_its_size(tmp_path: Path) -> None:
    folders = [tmp_path / f"class_{k}" for k in range(4)]
    for folder in folders:
        folder.mkdir()
    paths = [str(folders[i % 4] / f"img_{i}.jpg") for i in range(256)]
    checks = DirectoryChecks()
    assert check_paths(_batch(*paths), ["paths"], [], checks) == {}
    assert checks.lookups == 1  # class_0's, its first path's
    check_paths(_batch(*paths[4:]), ["paths"], [], checks)
    assert checks.lookups == 1  # class_0 seen lately: no os.access at all
    check_paths(_batch(*reversed(paths)), ["paths"], [], checks)
    assert checks.lookups == 2  # class_3's
    # Known by their bytes: a longer directory beside them is a new look when it comes first.
    deeper = tmp_path / "class_0" / "a_much_longer_subdirectory_name"
    deeper.mkdir()
    check_paths(_batch(str(deeper / "img.jpg"), *paths[:8]), ["paths"], [], checks)
    assert checks.lookups == 3
    again = DirectoryChecks(recheck_s=0.0)  # every batch looks again, still once
    check_paths(_batch(*paths), ["paths"], [], again)
    check_paths(_batch(*paths), ["paths"], [], again)
    assert again.lookups == 2
    # A directory that went away is seen at its next look, and fails the batch.
    folders[3].rmdir()
    with pytest.raises(FilesUnseen, match=r"class_3/img_3\.jpg"):
        check_paths(_batch(*paths[3:]), ["paths"], [], again)
    # A relative path's directory is the working one (b""), a path at the root's is "/".
    assert check_paths(_batch("img.jpg", "/img.jpg"), ["paths"], [], again) == {}


def test_a_path_with_a_nul_byte_is_a_bad_sample_whose_directory_is_not_looked_at(
    tmp_path: Path,
) -> None:
    checks = DirectoryChecks()
    good = str(tmp_path / "a.jpg")
    bad = check_paths(_batch(good, b"/nowhere\0/x", b"/nowhere/\0"), ["paths"], [], checks)
    assert sorted(bad) == [1, 2]
    assert checks.lookups == 1  # tmp_path's alone: /nowhere would have failed the batch
    # Bad samples first: the batch is checked by the directory of its first good path.
    bad = check_paths(_batch(b"", b"/nowhere\0/x", "/gone/y", good), ["paths"], [2], checks)
    assert sorted(bad) == [0, 1, 2]
    assert checks.lookups == 1  # tmp_path, seen lately
    assert check_paths(_batch(b"", b"/x\0"), ["paths"], [], checks).keys() == {0, 1}


@pytest.mark.skipif(os.geteuid() == 0, reason="root enters and reads whatever the modes say")
def test_a_directory_or_file_the_daemon_may_not_read_is_unseen(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "a.jpg").write_bytes(b"x")
    (tmp_path / "b.jpg").write_bytes(b"x")
    (tmp_path / "b.jpg").chmod(0)
    locked.chmod(0)
    try:
        with pytest.raises(FilesUnseen, match="may not read"):
            check_paths(_batch(str(locked / "a.jpg")), ["paths"], [], DirectoryChecks())
        # A file of a directory the daemon enters: found once the batch failed on it.
        batch = _batch(str(tmp_path / "b.jpg"))
        assert check_paths(batch, ["paths"], [], DirectoryChecks()) == {}
        assert "may not read" in unseen_file(batch, ["paths"], [])
    finally:
        locked.chmod(0o700)


def test_the_check_after_a_failure_sees_each_file(tmp_path: Path) -> None:
    (tmp_path / "a.jpg").write_bytes(b"x")
    batch = _batch(str(tmp_path / "a.jpg"), str(tmp_path / "gone.jpg"), b"")
    # The trainer named the missing file: a bad sample, not a file the daemon does not see.
    assert unseen_file(batch, ["paths"], [1]) == ""
    assert f"cannot open {tmp_path / 'gone.jpg'}" in unseen_file(batch, ["paths"], [])
    assert unseen_file(batch, ["other"], []) == ""


def test_first_missing_is_the_outermost_missing_part(tmp_path: Path) -> None:
    assert first_missing(str(tmp_path / "x" / "y")) == str(tmp_path / "x")
    assert first_missing("/") == "/"
    assert first_missing(str(tmp_path)) == str(tmp_path)  # nothing missing


def test_what_is_not_a_regular_file_is_a_bad_sample_that_says_what_it_is(tmp_path: Path) -> None:
    """A FIFO would block DALI's open() forever; a device, a directory, a socket and the
    kernel's /proc files are no dataset's files either (Note [Checking paths per directory])."""
    good = tmp_path / "a.jpg"
    good.write_bytes(b"x")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(tmp_path / "sock"))
    try:
        paths = [good, fifo, "/dev/zero", tmp_path, tmp_path / "sock", "/proc/self/mem", good]
        bad = check_paths(_batch(*map(str, paths)), ["paths"], [], DirectoryChecks())
    finally:
        listening.close()
        (tmp_path / "sock").unlink()
    assert sorted(bad) == [1, 2, 3, 4, 5]
    assert bad[1] == (
        f"input 'paths': {fifo} is not a regular file (a FIFO (named pipe)); the daemon reads "
        "only regular files: give the path of a file"
    )
    assert "/dev/zero is not a regular file (a character device)" in bad[2]
    assert f"{tmp_path} is not a regular file (a directory)" in bad[3]
    assert "(a socket)" in bad[4]
    assert "/proc/self/mem is not a regular file (a file the kernel makes" in bad[5]
    # A link is judged by what it leads to, as DALI's open() follows it.
    (tmp_path / "link.jpg").symlink_to(fifo)
    linked = check_paths(_batch(str(tmp_path / "link.jpg")), ["paths"], [], DirectoryChecks())
    assert "link.jpg is not a regular file (a FIFO (named pipe))" in linked[0]
    # A missing file the trainer did not name is left to the read, as before; one it named
    # is not looked at again.
    missing = str(tmp_path / "gone.jpg")
    assert check_paths(_batch(str(good), missing), ["paths"], [], DirectoryChecks()) == {}
    named = check_paths(_batch(missing, str(fifo)), ["paths"], [0], DirectoryChecks())
    assert sorted(named) == [0, 1] and "in the trainer either" in named[0]


def test_a_path_found_regular_is_not_looked_at_again_within_its_period(tmp_path: Path) -> None:
    """Each epoch of a small dataset stats each file once a period, not once a sample; what
    is not a regular file is looked at every time (Note [Checking paths per directory])."""
    files = [tmp_path / f"{i}.jpg" for i in range(4)]
    for file in files:
        file.write_bytes(b"x")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    regular = RegularFiles()
    batch = _batch(*map(str, files), str(fifo))

    def bad_samples() -> list[int]:
        return sorted(check_paths(batch, ["paths"], [], DirectoryChecks(), regular=regular))

    assert bad_samples() == [4]
    assert regular.stats == 5
    assert bad_samples() == [4]
    assert regular.stats == 6  # the FIFO alone, again
    # Swapped for a FIFO within the period: as the race the check never closed; caught once
    # the period ends.
    files[0].unlink()
    os.mkfifo(files[0])
    assert bad_samples() == [4]
    regular.recheck_s = 0.0
    assert bad_samples() == [0, 4]
    assert regular.stats == 12
    # Bounded: past `most` paths the memory starts afresh.
    few = RegularFiles(most=2)
    for _ in range(2):
        check_paths(_batch(*map(str, files[1:])), ["paths"], [], DirectoryChecks(), regular=few)
    assert few.stats == 6
    # A remembered file's size still counts against what a batch may have read.
    files[1].write_bytes(b"x" * 100)
    sized = RegularFiles()
    three = _batch(*map(str, files[1:]))
    assert check_paths(three, ["paths"], [], DirectoryChecks(), 1000, regular=sized) == {}
    with pytest.raises(FilesTooLarge):
        check_paths(three, ["paths"], [], DirectoryChecks(), 101, regular=sized)
    assert sized.stats == 3
