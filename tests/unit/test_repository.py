"""Loading a pipeline repository from real files: which functions count, failures, reloads."""

from __future__ import annotations

import logging
import queue
import uuid
from pathlib import Path

import pytest

from dalid.protocol import (
    Error,
    ErrorCode,
    Message,
    ReloadRepository,
    RepositoryFailure,
    RepositoryReport,
)
from dalid.server.handling.core import DaemonCore
from dalid.server.jobs.quotas import Quotas
from dalid.server.outputs.shm import host_outputs
from dalid.server.pipelines.repository import PipelineRepository, RepositoryUnavailable

PIPELINE = """
from nvidia.dali import fn, pipeline_def

@pipeline_def(batch_size=2, num_threads=1)
def {name}():
    return fn.external_source(name="x")
"""


def test_public_pipeline_defs_of_each_file_are_served_by_name(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        PIPELINE.format(name="train")
        + PIPELINE.format(name="_hidden")
        + "\ndef plain():\n    return 1\n"
    )
    # A pipeline imported from another file is served under its own file only.
    borrowing = "from a import train as borrowed\n" + PIPELINE.format(name="val")
    (tmp_path / "b.py").write_text(borrowing)
    (tmp_path / "notes.txt").write_text("not python")
    repository = PipelineRepository.load(tmp_path)
    assert sorted(repository.entries) == ["train", "val"]
    assert repository.entries["train"].path.name == "a.py"
    assert not repository.failures


def test_failures_are_kept_and_reported_with_the_names_available(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "good.py").write_text(PIPELINE.format(name="train"))
    (tmp_path / "syntax.py").write_text("def broken(:\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "twice.py").write_text(PIPELINE.format(name="train"))
    with caplog.at_level(logging.ERROR, logger="dalid.server"):
        repository = PipelineRepository.load(tmp_path)
    assert sorted(repository.entries) == ["train"]
    assert repository.entries["train"].path.name == "good.py"
    assert repository.failures["syntax.py"].startswith("SyntaxError")
    assert repository.failures["exits.py"] == "SystemExit: 3"
    assert "also defined in good.py" in repository.failures["twice.py"]
    assert "syntax.py could not be loaded" in caplog.text
    with pytest.raises(KeyError) as raised:
        repository.get("resnet")
    message = raised.value.args[0]
    assert "available: train" in message
    assert "syntax.py: SyntaxError" in message and "exits.py: SystemExit: 3" in message


def test_definition_passes_build_arguments_and_parameters(tmp_path: Path) -> None:
    (tmp_path / "p.py").write_text(
        "from nvidia.dali import fn, pipeline_def\n"
        "@pipeline_def\n"
        "def scaled(factor=1):\n"
        "    return fn.external_source(name='x') * factor\n"
    )
    repository = PipelineRepository.load(tmp_path)
    build = repository.definition(
        "scaled", {"batch_size": 3, "num_threads": 1, "device_id": None}, {"factor": 5}
    )
    pipeline = build()
    assert pipeline.max_batch_size == 3 and pipeline.device_id is None
    assert build() is not pipeline  # each call defines a new pipeline, for rebuilds


# --- Reloading ----------------------------------------------------------------------------------

SIZED = """
from nvidia.dali import fn, pipeline_def

@pipeline_def(batch_size={size}, num_threads=1, device_id=None)
def {name}():
    return fn.external_source(name="x")
"""


def _batch_size(repository: PipelineRepository, name: str) -> int:
    """The batch size of ``name`` as the repository defines it now: tells definitions apart."""
    size: int = repository.definition(name, {}, {})().max_batch_size
    return size


def test_a_reload_adds_new_files_and_reads_changed_ones_within_the_same_second(
    tmp_path: Path,
) -> None:
    (tmp_path / "a.py").write_text(SIZED.format(size=2, name="train"))
    first = PipelineRepository.load(tmp_path)
    # Same size, and most likely the same modification second: a cached bytecode would pass.
    (tmp_path / "a.py").write_text(SIZED.format(size=3, name="train"))
    (tmp_path / "b.py").write_text(SIZED.format(size=5, name="val"))
    second = first.reload()
    assert sorted(second.entries) == ["train", "val"]
    assert _batch_size(second, "train") == 3 and _batch_size(second, "val") == 5
    assert not second.failures and not second.kept
    # The repository replaced is left as it was: what was built from it is unaffected.
    assert sorted(first.entries) == ["train"] and _batch_size(first, "train") == 2
    assert second.changes_from(first) == "added val"


def test_a_file_that_fails_again_keeps_its_last_good_definitions(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a.py").write_text(SIZED.format(size=2, name="train") + "\nLEVEL = 1\n")
    (tmp_path / "other.py").write_text(SIZED.format(size=4, name="val"))
    first = PipelineRepository.load(tmp_path)
    (tmp_path / "a.py").write_text("def half_saved(:\n")
    (tmp_path / "new.py").write_text("import a_module_that_does_not_exist\n")
    with caplog.at_level(logging.WARNING, logger="dalid.server"):
        second = first.reload()
    assert sorted(second.entries) == ["train", "val"]
    assert _batch_size(second, "train") == 2
    assert second.failures["a.py"].startswith("SyntaxError")
    assert second.failures["new.py"].startswith("ModuleNotFoundError")
    assert second.kept == {"a.py": ("train",)}  # new.py never loaded: nothing to keep
    assert "a.py keeps its previous definitions of train" in caplog.text
    # Still failing at the next reload: still the last good definitions.
    third = second.reload()
    assert _batch_size(third, "train") == 2 and third.kept == {"a.py": ("train",)}
    # Fixed: its new definitions, and no failure left.
    (tmp_path / "a.py").write_text(SIZED.format(size=6, name="train"))
    (tmp_path / "new.py").unlink()
    fourth = third.reload()
    assert _batch_size(fourth, "train") == 6
    assert not fourth.failures and not fourth.kept


def test_a_removed_file_takes_its_names_with_it(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(SIZED.format(size=2, name="train"))
    (tmp_path / "b.py").write_text(SIZED.format(size=2, name="val"))
    first = PipelineRepository.load(tmp_path)
    (tmp_path / "b.py").unlink()
    second = first.reload()
    assert sorted(second.entries) == ["train"]
    with pytest.raises(KeyError, match=r"no pipeline named 'val'.*available: train"):
        second.get("val")
    assert second.changes_from(first) == "removed val"


def test_a_kept_definition_gives_way_to_a_file_that_now_loads_the_name_first(
    tmp_path: Path,
) -> None:
    (tmp_path / "b.py").write_text(SIZED.format(size=2, name="train"))
    first = PipelineRepository.load(tmp_path)
    (tmp_path / "b.py").write_text("raise RuntimeError('broken')\n")
    (tmp_path / "a.py").write_text(SIZED.format(size=7, name="train"))
    second = first.reload()
    assert _batch_size(second, "train") == 7
    assert second.entries["train"].path.name == "a.py"
    assert second.failures["b.py"] == "RuntimeError: broken"  # its own error, not the clash
    assert "b.py" not in second.kept


def test_a_reload_imports_a_changed_sibling_afresh(tmp_path: Path) -> None:
    (tmp_path / "constants.py").write_text("SIZE = 2\n")
    (tmp_path / "a.py").write_text(
        "from constants import SIZE\n" + SIZED.format(size="SIZE", name="train")
    )
    first = PipelineRepository.load(tmp_path)
    (tmp_path / "constants.py").write_text("SIZE = 9\n")
    second = first.reload()
    assert _batch_size(first, "train") == 2 and _batch_size(second, "train") == 9


def test_nothing_to_reload_leaves_the_repository_as_it_is(tmp_path: Path) -> None:
    with pytest.raises(RepositoryUnavailable, match="--pipelines DIR"):
        PipelineRepository().reload()
    directory = tmp_path / "pipelines"
    directory.mkdir()
    (directory / "a.py").write_text(SIZED.format(size=2, name="train"))
    repository = PipelineRepository.load(directory)
    (directory / "a.py").unlink()
    directory.rmdir()
    with pytest.raises(RepositoryUnavailable, match="not a directory any more"):
        repository.reload()
    assert sorted(repository.entries) == ["train"]


# --- Reloading through the daemon's core ---------------------------------------------------------


# What the core sends to its peers: (peer, message, request id).
Pushed = queue.Queue[tuple[bytes, Message, int | None]]


@pytest.fixture
def pushed() -> Pushed:
    return queue.Queue()


def _core(pushed: Pushed, repository: PipelineRepository | None) -> DaemonCore:
    return DaemonCore(
        "cpu",
        host_outputs(),
        lambda peer, message, rid: pushed.put((peer, message, rid)),
        Quotas(max_batch_size=64, pool_bytes=1 << 20, slab_bytes=1 << 16),
        instance=f"unittest-{uuid.uuid4().hex[:8]}",
        repository=repository,
    )


def test_a_reload_request_needs_no_hello_and_is_answered_with_what_loaded(
    tmp_path: Path, pushed: Pushed
) -> None:
    (tmp_path / "a.py").write_text(SIZED.format(size=2, name="train"))
    core = _core(pushed, PipelineRepository.load(tmp_path))
    try:
        (tmp_path / "a.py").write_text("raise RuntimeError('half saved')\n")
        (tmp_path / "b.py").write_text(SIZED.format(size=2, name="val"))
        assert core.handle(b"cli", ReloadRepository(), 7) is None  # answered once loaded
        peer, report, request_id = pushed.get(timeout=30)
        assert (peer, request_id) == (b"cli", 7)
        assert report == RepositoryReport(
            directory=str(tmp_path),
            pipelines=("train", "val"),
            failures=(
                RepositoryFailure("a.py", "RuntimeError: half saved", kept_pipelines=("train",)),
            ),
        )
        assert sorted(core.repository.current.entries) == ["train", "val"]
    finally:
        core.close()


def test_a_daemon_without_a_repository_refuses_a_reload(pushed: Pushed) -> None:
    core = _core(pushed, None)
    try:
        assert core.handle(b"cli", ReloadRepository(), 3) is None
        _, reply, _ = pushed.get(timeout=30)
        assert isinstance(reply, Error)
        assert reply.code is ErrorCode.UNKNOWN_PIPELINE and "--pipelines DIR" in reply.message
    finally:
        core.close()
