"""A trainer killed at any moment leaves no DataLoader worker behind, nor anything in the daemon.

torch's worker watchdog misses a trainer that died while its worker was still starting (a
spawned worker importing): that worker read the reaper as its parent. dalid's DataLoader has
each worker check its trainer in its ``worker_init_fn`` and watch it from then on
(``dalid.client.loader._FrozenHeap``). Here trainers (``restart_job``, two workers, epochs of
two batches so that workers start again and again, spawned or forked) are killed with SIGKILL
at random moments from just after they connected: during a worker's start-up, while batches
are in flight, between epochs. Every process the trainer started must be gone within 10 s, and
the daemon must end the trainer's job.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ..daemons import DaemonProcess, wait_for
from .test_restarts import ROOT

TRIALS = 20
AT_ONCE = 2
# The tag every process of one trial inherits in its environment, to find them once orphaned.
TAG = "DALID_TEST_TREE"


def _tagged(tag: str) -> set[int]:
    """The live (not zombie) processes whose environment holds ``TAG=tag``."""
    found = set()
    needle = f"{TAG}={tag}".encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle not in environ.read_bytes().split(b"\0"):
                continue
            state = (environ.parent / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.add(int(environ.parent.name))
    return found


def _trainer(socket: Path, tag: str, start_method: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.restart_job", "--socket", str(socket),
         "--length", "16", "--epochs", "1000", "--pause-at", "0", "--say-started",
         "--start-method", start_method],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, TAG: tag},
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_workers_of_a_trainer_killed_at_random_moments_exit(daemon: DaemonProcess) -> None:
    rng = random.Random(int.from_bytes(os.urandom(4)))
    left: list[str] = []
    for first in range(0, TRIALS, AT_ONCE):
        trials = []
        for number in range(first, first + AT_ONCE):
            tag = uuid.uuid4().hex
            method = "spawn" if number % 2 == 0 else "fork"
            trials.append((tag, method, _trainer(daemon.socket, tag, method)))
        try:
            for _, _, trainer in trials:
                assert trainer.stdout is not None
                line = trainer.stdout.readline()
                assert line.strip() == "started", line + trainer.stdout.read()
            # The moments: from the first workers' start-up to a few epochs in.
            for _, _, trainer in trials:
                time.sleep(rng.uniform(0.0, 2.0))
                trainer.kill()
                # Not communicate(): a worker left behind would hold the pipe open.
                trainer.wait()
            killed = time.monotonic()
            for tag, method, _ in trials:
                deadline = killed + 10.0
                while _tagged(tag) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if _tagged(tag):
                    left.append(f"{method}: {sorted(_tagged(tag))}")
        finally:
            for tag, _, trainer in trials:
                for pid in _tagged(tag):
                    os.kill(pid, signal.SIGKILL)
                if trainer.poll() is None:
                    trainer.kill()
                trainer.wait()
                assert trainer.stdout is not None
                trainer.stdout.close()
    assert not left, f"processes of killed trainers still running 10 s later: {left}"
    wait_for(lambda: not daemon.status().jobs, 10, "the daemon to end the killed trainers' jobs")
