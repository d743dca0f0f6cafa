"""A pipeline's stop off the daemon's loop (Note [A pipeline stuck inside DALI]), with real
threads: the stop is an executor's own ``stop(timeout)``, here one that waits on an event as a
DALI call that does not return would."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from dalid.server.runs import stopping
from dalid.server.runs.stopping import Stop, wait_for


def _stop_waiting_on(released: threading.Event) -> Callable[[float], bool]:
    """An executor's stop whose thread ends only once ``released`` is set."""

    def stop(timeout: float) -> bool:
        return released.wait(timeout)

    return stop


def _until(condition: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_stop_that_ends_at_once_is_finished_after_a_moment() -> None:
    stop = Stop("1", lambda timeout: True)
    wait_for([stop])
    assert stop.finished and stop.stopped
    nothing = Stop("2", None)
    assert nothing.finished and nothing.stopped
    _until(lambda: not stopping.any_under_way())


def test_a_stuck_pipeline_does_not_hold_up_the_caller_and_is_reaped_when_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stopping, "STOP_TIMEOUT_S", 0.3)
    released = threading.Event()
    try:
        stop = Stop("7", _stop_waiting_on(released))
        wait_for([stop, Stop("9", None)])
        # Back to the caller with the pipeline still inside its call.
        assert not stop.stopped and stopping.any_under_way()
        # Past STOP_TIMEOUT_S: the stop has its answer, not stopped, and waits on.
        _until(lambda: stop.finished)
        assert not stop.stopped and stopping.any_under_way()
    finally:
        released.set()
    # The call returns: the thread ends, and nothing waits any more.
    _until(lambda: not stopping.any_under_way())
    assert not any(t.name == "dalid-stop-7" for t in threading.enumerate())


def test_a_stop_that_ends_late_is_stopped_once_it_has() -> None:
    released = threading.Event()
    stop = Stop("8", _stop_waiting_on(released))
    assert not stop.finished
    released.set()
    _until(lambda: stop.finished)
    assert stop.stopped
    _until(lambda: not stopping.any_under_way())
