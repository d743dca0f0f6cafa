"""bench.hops wraps the daemon's and the client's functions by name: each must still exist."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_function_the_probes_wrap_exists() -> None:
    """A module split or a renamed method stops `python -m bench.hops` at its daemon's start;
    this says which name is gone instead."""
    probe = (
        "from bench import hops\n"
        "hops.trace_daemon()\n"
        "hops.trace_client()\n"
        "hops.count_steps()\n"
        "print(len(hops.STEPS))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) >= 10
