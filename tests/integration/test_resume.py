"""Checkpoint and resume mid-epoch, for real: a trainer killed with SIGKILL at random steps of a
3-epoch run, resumed each time in a new process from the last state it saved, gets exactly the
batches of the uninterrupted run (``resume_job.py``).

A deterministic job (random crop, flip and draws, ``enable_checkpointing=True``) gets the same
dataset indices in the same order and bit-equal outputs; a job on a shared pipeline the same
indices. Each chain of kills draws its steps at random: the seed is in the failure's message
(``DALID_TEST_SEED`` replays it).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import dalid.client as dalid
from dalid.client import InputError
from dalid.client.checkpoint import STATE_KEY

from ..daemons import DaemonProcess, start_daemon
from .resume_job import BATCH, Images, random_augment

ROOT = Path(__file__).resolve().parents[2]
EPOCHS = 3
LENGTH = 22
STEPS = EPOCHS * -(-LENGTH // BATCH)  # 18: the last batch of each epoch is short
SEED = int(os.environ.get("DALID_TEST_SEED", time.time_ns() % 1_000_000))

# The uninterrupted runs, by (mode, workers, proxy): each is made once for the module.
_REFERENCES: dict[tuple[str, int, bool], list[str]] = {}


def _run(socket: Path, directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.integration.resume_job",
            "--socket",
            str(socket),
            "--record",
            str(directory / "record"),
            "--state",
            str(directory / "state"),
            "--epochs",
            str(EPOCHS),
            "--length",
            str(LENGTH),
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def _job_args(mode: str, workers: int, proxy: bool) -> list[str]:
    return ["--mode", mode, "--workers", str(workers), *(["--proxy"] if proxy else [])]


def _records(path: Path, mode: str) -> list[str]:
    """The run's lines: step, epoch, indices and (deterministic only) the outputs' digest."""
    lines = path.read_text().splitlines() if path.exists() else []
    if mode == "shared":  # a shared pipeline's draws are not repeated: indices only
        return [line.rsplit(" ", 1)[0] for line in lines]
    return lines


def _reference(socket: Path, directory: Path, mode: str, workers: int, proxy: bool) -> list[str]:
    key = (mode, workers, proxy)
    if key not in _REFERENCES:
        where = directory / "reference"
        where.mkdir()
        done = _run(socket, where, *_job_args(mode, workers, proxy))
        assert done.returncode == 0, done.stdout + done.stderr
        _REFERENCES[key] = _records(where / "record", mode)
        assert len(_REFERENCES[key]) == STEPS
    return _REFERENCES[key]


def _chain(
    socket: Callable[[], Path],
    directory: Path,
    mode: str,
    workers: int,
    kills: list[int],
    *,
    proxy: bool = False,
    between: Callable[[], None] | None = None,
) -> list[str]:
    """Runs the job, killing it at each step of ``kills`` in turn and resuming it from its last
    saved state (``between`` runs after each kill); the lines of the run as resumed."""
    record, state = directory / "record", directory / "state"
    for kill in [*kills, 0]:
        resume = ["--resume"] if state.exists() else []
        done = _run(socket(), directory, *_job_args(mode, workers, proxy), "--kill-at",
                    str(kill), *resume)  # fmt: skip
        if kill == 0:
            assert done.returncode == 0, done.stdout + done.stderr
            break
        assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
        # What the killed trainer did after its last saved state is lost with it: the resumed
        # one does it again.
        saved = torch.load(state, weights_only=True)["step"] if state.exists() else 0
        kept = [line for line in record.read_text().splitlines() if int(line.split()[0]) <= saved]
        record.write_text("".join(f"{line}\n" for line in kept))
        if between is not None:
            between()
    return _records(record, mode)


def _kills(rng: random.Random, count: int) -> list[int]:
    return sorted(rng.sample(range(1, STEPS + 1), count))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2, 4])
@pytest.mark.parametrize("mode", ["deterministic", "shared"])
def test_a_killed_trainer_resumes_with_the_batches_of_the_uninterrupted_run(
    daemon: DaemonProcess, short_tmp: Path, mode: str, workers: int
) -> None:
    rng = random.Random(f"{SEED}-{mode}-{workers}")
    kills = _kills(rng, 1)  # several in a row: test_ten_kills_of_one_run
    expected = _reference(daemon.socket, short_tmp, mode, workers, proxy=False)
    got = _chain(lambda: daemon.socket, short_tmp, mode, workers, kills)
    assert got == expected, f"killed at steps {kills} (DALID_TEST_SEED={SEED})"


@pytest.mark.slow
def test_ten_kills_of_one_run(daemon: DaemonProcess, short_tmp: Path) -> None:
    rng = random.Random(f"{SEED}-ten")
    kills = _kills(rng, 10)
    expected = _reference(daemon.socket, short_tmp, "deterministic", 2, proxy=False)
    got = _chain(lambda: daemon.socket, short_tmp, "deterministic", 2, kills)
    assert got == expected, f"killed at steps {kills} (DALID_TEST_SEED={SEED})"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["deterministic", "shared"])
def test_a_resume_on_a_restarted_daemon(daemon: DaemonProcess, short_tmp: Path, mode: str) -> None:
    """Between each kill and its resume the daemon is stopped and another started: the state
    carries the pipeline's draws to the new daemon."""
    rng = random.Random(f"{SEED}-restart-{mode}")
    kills = _kills(rng, 1)
    expected = _reference(daemon.socket, short_tmp, mode, 2, proxy=False)
    own = short_tmp / "own"
    own.mkdir(mode=0o700)
    running = [start_daemon(own)]

    def restart() -> None:
        assert running[0].stop() == 0, running[0].log_text()
        running[0] = start_daemon(own)

    try:
        got = _chain(lambda: running[0].socket, own, mode, 2, kills, between=restart)
    finally:
        code = running[0].stop()
    assert code == 0, running[0].log_text()
    assert got == expected, f"killed at steps {kills} (DALID_TEST_SEED={SEED})"


@pytest.mark.slow
def test_the_proxy_api_resumes_too(daemon: DaemonProcess, short_tmp: Path) -> None:
    """``DALIServer`` and its ``DataLoader``, with ``state_dict()`` in the training checkpoint."""
    rng = random.Random(f"{SEED}-proxy")
    kills = _kills(rng, 1)
    expected = _reference(daemon.socket, short_tmp, "deterministic", 2, proxy=True)
    got = _chain(lambda: daemon.socket, short_tmp, "deterministic", 2, kills, proxy=True)
    assert got == expected, f"killed at steps {kills} (DALID_TEST_SEED={SEED})"


# --- refusals, in this process --------------------------------------------------------------


def _state(daemon: DaemonProcess, *, deterministic: bool = True, length: int = 10) -> Any:
    with dalid.connect(socket=daemon.socket, autostart=False) as session:
        proxy = session.proxy(random_augment(), deterministic=deterministic)
        loader = dalid.DataLoader(session, Images(proxy, length), batch_size=BATCH)
        iterator = iter(loader)
        next(iterator)
        state = loader.state_dict()
        del iterator
    return state


def _loader(session: dalid.Session, pipeline: Any, length: int = 10) -> dalid.DataLoader:
    proxy = session.proxy(pipeline, deterministic=True)
    return dalid.DataLoader(session, Images(proxy, length), batch_size=BATCH)


def test_a_state_holds_the_pipelines_checkpoint(daemon: DaemonProcess) -> None:
    state = _state(daemon)
    (pipeline,) = state[STATE_KEY]["pipelines"]
    assert pipeline["deterministic"]
    assert isinstance(pipeline["checkpoint"], bytes) and pipeline["checkpoint"]
    shared = _state(daemon, deterministic=False)
    assert shared[STATE_KEY]["pipelines"][0]["checkpoint"] is None


def test_a_state_of_another_pipeline_is_refused(daemon: DaemonProcess) -> None:
    state = _state(daemon)
    other = random_augment(seed=99)
    with dalid.connect(socket=daemon.socket, autostart=False) as session:
        loader = _loader(session, other)
        with pytest.raises(InputError, match="taken with another pipeline: its pipeline 0"):
            loader.load_state_dict(state)


def test_a_state_of_another_dataset_length_is_refused(daemon: DaemonProcess) -> None:
    state = _state(daemon)
    with dalid.connect(socket=daemon.socket, autostart=False) as session:
        loader = _loader(session, random_augment(), length=11)
        with pytest.raises(InputError, match=r"dataset of 10 samples, and this loader's .* 11"):
            loader.load_state_dict(state)


def test_a_state_of_another_protocol_is_refused(daemon: DaemonProcess) -> None:
    state = _state(daemon)
    state[STATE_KEY]["protocol"] -= 1
    with dalid.connect(socket=daemon.socket, autostart=False) as session:
        loader = _loader(session, random_augment())
        with pytest.raises(InputError, match="speaking protocol"):
            loader.load_state_dict(state)


def test_a_deterministic_pipeline_without_checkpointing_warns(daemon: DaemonProcess) -> None:
    plain = random_augment(enable_checkpointing=False)
    with dalid.connect(socket=daemon.socket, autostart=False) as session:
        loader = _loader(session, plain)
        iterator = iter(loader)
        next(iterator)
        with pytest.warns(dalid.DrawsNotSaved, match="enable_checkpointing=True"):
            state = loader.state_dict()
        del iterator
    assert state[STATE_KEY]["pipelines"][0]["checkpoint"] is None
