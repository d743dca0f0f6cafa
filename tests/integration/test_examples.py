"""The examples run end to end on the CPU, with small sizes, against a real daemon."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.dataset import make_imagefolder

from ..daemons import DaemonProcess, own_directory, start_daemon

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def images() -> Iterator[Path]:
    directory = own_directory("dalid-ex-")
    dataset = make_imagefolder(directory / "images", num_images=24, num_classes=3, seed=1)
    yield dataset.root
    shutil.rmtree(directory, ignore_errors=True)


def _run(module: str, daemon: DaemonProcess, images: Path, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", module, "--data", str(images), "--socket", str(daemon.socket),
         "--batch-size", "8", "--workers", "2", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.slow
def test_imagefolder_training(daemon: DaemonProcess, images: Path) -> None:
    out = _run("examples.imagefolder_train", daemon, images)
    assert "trained on 24 images in 3 classes" in out


@pytest.mark.slow
def test_imagefolder_training_with_the_repository_pipeline(images: Path) -> None:
    directory = own_directory()
    daemon = start_daemon(
        directory,
        "--pipelines",
        str(ROOT / "examples" / "pipelines"),
        "--repository-operators",
        "PythonFunction",
    )
    try:
        out = _run("examples.imagefolder_train", daemon, images, "--named")
    finally:
        code = daemon.stop()
        log = daemon.log_text()
        shutil.rmtree(directory, ignore_errors=True)
    assert code == 0, log
    assert "pipeline repository" in log and ": train" in log
    assert "trained on 24 images in 3 classes" in out


@pytest.mark.slow
def test_lightning_datamodule(daemon: DaemonProcess, images: Path) -> None:
    """It trains, and a run resumed from a mid-epoch checkpoint (which holds the DataLoader's
    state) trains on the batches after it: 24 images, 8 a batch, checkpoints every 2 steps."""
    pytest.importorskip("lightning")
    checkpoints = own_directory("dalid-ck-")
    try:
        out = _run("examples.lightning_datamodule", daemon, images, "--checkpoints",
                   str(checkpoints))  # fmt: skip
        assert "trained on 24 images with Lightning" in out
        checkpoint = checkpoints / "epoch=0-step=2.ckpt"
        saved = torch.load(checkpoint, weights_only=False)
        (loader,) = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        assert loader["dalid"]["dataset_length"] == 24
        out = _run("examples.lightning_datamodule", daemon, images, "--resume", str(checkpoint))
        assert "trained on 8 images with Lightning" in out
    finally:
        shutil.rmtree(checkpoints, ignore_errors=True)


@pytest.mark.slow
def test_multi_input_pipeline(daemon: DaemonProcess, images: Path) -> None:
    out = _run("examples.multi_input", daemon, images)
    assert "24 samples rotated and cropped, each with its own parameters" in out
    assert out.count("rotated") >= 3


def readme_block(heading: str) -> str:
    """The first Python block of the README after ``heading``."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index(heading) :]
    start = after.index("```python\n") + len("```python\n")
    return after[start : after.index("```\n", start)]


def test_the_readmes_using_it_code_runs_as_pasted(
    daemon: DaemonProcess, images: Path, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(readme_block("## Using it"))
    result = subprocess.run(
        [sys.executable, str(script), str(images)],
        cwd=tmp_path,
        env={**os.environ, "DALID_SOCKET": str(daemon.socket)},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torch.Size([24, 3, 224, 224])" in result.stdout


def test_dev_run_reaches_the_environments_tools_from_the_callers_directory(
    tmp_path: Path,
) -> None:
    """`./dev run CMD` runs CMD with the environment's dalid and python first on the PATH, in
    the directory it was called from: what the README's commands rely on."""
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip("runs only from the environment that ./dev made (it would install one)")
    script = "pwd; command -v dalid; command -v python; dalid --version"
    result = subprocess.run(
        [str(ROOT / "dev"), "run", "sh", "-c", script],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    where, dalid_path, python_path, version = result.stdout.splitlines()
    assert Path(where) == tmp_path
    assert Path(dalid_path) == ROOT / ".venv" / "bin" / "dalid"
    assert Path(python_path) == ROOT / ".venv" / "bin" / "python"
    assert version.startswith("dalid ")
    # Nothing to install: the command's output is its own.
    assert "dev: installing" not in result.stderr


def test_dev_run_without_a_command_says_how_to_use_it() -> None:
    result = subprocess.run(
        [str(ROOT / "dev"), "run"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert "./dev run dalid status" in result.stderr
