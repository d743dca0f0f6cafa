"""The bench's background load (``--background-load``): real spinning processes, started with a
run and gone after it, their CPU counted apart."""

from __future__ import annotations

import os
import time

import pytest

from bench.__main__ import make_settings, parse_args
from bench.background import BackgroundLoad, _process_cpu_s


def _wait_until_each_spun(load: BackgroundLoad) -> None:
    """Until every spinner has been given CPU (the per-test timeout bounds a stuck one)."""
    while not all(_process_cpu_s(p.pid) > 0 for p in load._processes):
        time.sleep(0.05)


def test_the_spinners_run_through_the_block_and_none_is_left_after_it() -> None:
    load = BackgroundLoad(2)
    with load.running():
        pids = [process.pid for process in load._processes]
        assert len(pids) == 2
        for pid in pids:
            assert os.path.exists(f"/proc/{pid}")
        _wait_until_each_spun(load)
    assert load._processes == []
    for pid in pids:  # killed and waited for: no zombie, no process
        assert not os.path.exists(f"/proc/{pid}")
    assert load.cores > 0


def test_the_spinners_stop_when_the_run_fails() -> None:
    load = BackgroundLoad(1)
    with pytest.raises(RuntimeError), load.running():
        pid = load._processes[0].pid
        raise RuntimeError("a run that failed")
    assert not os.path.exists(f"/proc/{pid}")


def test_no_load_starts_nothing() -> None:
    load = BackgroundLoad(0)
    with load.running():
        assert load._processes == []
    assert load.cores == 0.0


def test_the_option_reaches_the_settings_every_trainer_gets() -> None:
    settings = make_settings(parse_args(["--background-load", "2", "--cpu"]))
    assert settings.background_load == 2
    assert type(settings).from_json(settings.to_json()).background_load == 2
    assert make_settings(parse_args(["--cpu"])).background_load == 0
    with pytest.raises(SystemExit):
        make_settings(parse_args(["--background-load", "-1", "--cpu"]))
