"""Loading a pipeline repository from real files: which functions count, and failures."""

from __future__ import annotations

import logging

import pytest

from dalid.server.repository import PipelineRepository

PIPELINE = """
from nvidia.dali import fn, pipeline_def

@pipeline_def(batch_size=2, num_threads=1)
def {name}():
    return fn.external_source(name="x")
"""


def test_public_pipeline_defs_of_each_file_are_served_by_name(tmp_path):
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


def test_failures_are_kept_and_reported_with_the_names_available(tmp_path, caplog):
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


def test_definition_passes_build_arguments_and_parameters(tmp_path):
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
