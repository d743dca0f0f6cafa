"""The daemon the bench measures (a real ``dalid serve`` run with the bench's thread probes) keeps
to one malloc arena, as ``dalid serve`` does."""

from __future__ import annotations

from pathlib import Path

from bench.daemon import running_daemon
from bench.memory import malloc_arenas

from ..daemons import module_daemon


def test_the_measured_daemon_keeps_to_one_malloc_arena(tmp_path: Path) -> None:
    # The probes' own thread starts after the daemon limits its arenas: one made before would
    # be shared by DALI's threads later, and the daemon measured would hold more than one
    # run without the probes.
    with running_daemon("cpu", tmp_path) as daemon:
        assert malloc_arenas(daemon.pid) == 0
    assert daemon.threads, "the probes wrote no snapshot"


def test_dalid_serve_keeps_to_one_malloc_arena() -> None:
    # What the bench's daemon is compared with: dalid serve as users run it, supervised.
    with module_daemon(supervised=True) as daemon:
        assert malloc_arenas(daemon.daemon_pid()) == 0
