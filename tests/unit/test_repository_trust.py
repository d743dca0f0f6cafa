"""A pipeline repository that other users can change is not run: real files with bad modes.

Each file here that would run leaves a mark (``ran-<name>``) when imported, so a test sees
both the refusal and that nothing ran. Another owner is played by root (``needs_root``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dalid.protocol.ownership import UnsafePath
from dalid.server.pipelines.repository import PipelineRepository, RepositoryUnavailable
from tests.impostor import OTHER_UID, needs_root

PIPELINE = """
import pathlib
pathlib.Path({mark!r}).touch()
from nvidia.dali import fn, pipeline_def

@pipeline_def(batch_size=2, num_threads=1, device_id=None)
def {name}():
    return fn.external_source(name="x")
"""


@pytest.fixture
def marks(tmp_path: Path) -> Path:
    path = tmp_path / "marks"
    path.mkdir()
    return path


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    path = tmp_path / "pipelines"
    path.mkdir(mode=0o755)
    return path


def _write(directory: Path, marks: Path, file: str, name: str, mode: int = 0o644) -> Path:
    path = directory / file
    path.write_text(PIPELINE.format(mark=str(marks / f"ran-{name}"), name=name))
    path.chmod(mode)
    return path


def _ran(marks: Path) -> list[str]:
    return sorted(path.name.removeprefix("ran-") for path in marks.iterdir())


@pytest.mark.parametrize("mode", [0o666, 0o646, 0o664, 0o620])
def test_a_file_others_can_write_is_refused_and_never_runs(
    repository: Path, marks: Path, mode: int
) -> None:
    _write(repository, marks, "good.py", "train")
    bad = _write(repository, marks, "open.py", "val", mode)
    loaded = PipelineRepository.load(repository)
    assert sorted(loaded.entries) == ["train"]
    failure = loaded.failures["open.py"]
    assert failure.startswith("UnsafePath: ")
    assert f"can be written by other users (mode {mode:o}): run `chmod go-w {bad}`" in failure
    assert _ran(marks) == ["train"]
    with pytest.raises(KeyError, match=r"open\.py: UnsafePath.*chmod go-w"):
        loaded.get("val")  # a client asking for it is told why


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757, 0o1777])
def test_a_directory_others_can_write_is_refused_whole(
    repository: Path, marks: Path, mode: int
) -> None:
    # The case that once ran: a 0666 file in a 0777 directory ran with the daemon's rights.
    _write(repository, marks, "a.py", "train", 0o666)
    repository.chmod(mode)
    with pytest.raises(UnsafePath, match=rf"pipeline repository {repository} can be written"):
        PipelineRepository.load(repository)
    assert _ran(marks) == []


def test_a_directory_on_the_way_that_others_can_write_is_refused(
    tmp_path: Path, marks: Path
) -> None:
    # Anyone could rename the repository away and put another in its place.
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    inside = parent / "pipelines"
    inside.mkdir(mode=0o755)
    _write(inside, marks, "a.py", "train")
    with pytest.raises(UnsafePath, match=f"lies in {parent}, which other users can write to"):
        PipelineRepository.load(inside)
    assert _ran(marks) == []


def test_a_sibling_package_others_can_write_is_refused_whole(repository: Path, marks: Path) -> None:
    package = repository / "helpers"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "sizes.py").write_text("SIZE = 2\n")
    (repository / "a.py").write_text(
        "from helpers.sizes import SIZE\n"
        + PIPELINE.format(mark=str(marks / "ran-train"), name="train")
    )
    (package / "sizes.py").chmod(0o666)
    with pytest.raises(UnsafePath, match=r"pipeline repository module .*sizes\.py can be written"):
        PipelineRepository.load(repository)
    (package / "sizes.py").chmod(0o644)
    package.chmod(0o777)
    with pytest.raises(UnsafePath, match=f"pipeline repository directory {package} can be"):
        PipelineRepository.load(repository)
    package.chmod(0o755)
    assert sorted(PipelineRepository.load(repository).entries) == ["train"]


def test_a_link_to_a_file_others_can_write_is_refused(
    repository: Path, marks: Path, tmp_path: Path
) -> None:
    elsewhere = _write(tmp_path, marks, "elsewhere.py", "val", 0o666)
    (repository / "linked.py").symlink_to(elsewhere)
    loaded = PipelineRepository.load(repository)
    assert (
        "a link to" in loaded.failures["linked.py"] and "chmod go-w" in loaded.failures["linked.py"]
    )
    assert _ran(marks) == []


@needs_root
def test_a_file_of_another_user_is_refused(repository: Path, marks: Path) -> None:
    theirs = _write(repository, marks, "theirs.py", "val")
    os.chown(theirs, OTHER_UID, OTHER_UID)
    loaded = PipelineRepository.load(repository)
    failure = loaded.failures["theirs.py"]
    assert f"belongs to uid {OTHER_UID}" in failure and f"chown {os.getuid()} {theirs}" in failure
    assert _ran(marks) == []


@needs_root
def test_a_directory_of_another_user_is_refused(repository: Path, marks: Path) -> None:
    _write(repository, marks, "a.py", "train")
    os.chown(repository, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePath, match=f"belongs to uid {OTHER_UID}"):
        PipelineRepository.load(repository)
    assert _ran(marks) == []


def test_a_reload_of_a_repository_made_writable_keeps_the_one_in_use(
    repository: Path, marks: Path
) -> None:
    _write(repository, marks, "a.py", "train")
    first = PipelineRepository.load(repository)
    (marks / "ran-train").unlink()
    # Made writable by others since: a file...
    (repository / "a.py").chmod(0o666)
    second = first.reload()
    assert second.kept == {"a.py": ("train",)}  # the definitions loaded while it was safe
    assert "chmod go-w" in second.failures["a.py"]
    # ...and the directory.
    repository.chmod(0o777)
    with pytest.raises(RepositoryUnavailable, match=r"chmod go-w.*loaded before stay in use"):
        second.reload()
    assert _ran(marks) == []
