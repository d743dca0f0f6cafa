"""The daemon's gate into DALI: ordinary runs together, a solo run alone, turns by arrival."""

from __future__ import annotations

import threading
import time

from dalid.server.runs.run_gate import RunGate


def _waiting(gate: RunGate, solo: bool) -> tuple[threading.Thread, threading.Event]:
    """A run that waits for the gate in a thread; the event is set once it is in."""
    entered = threading.Event()

    def enter() -> None:
        assert gate.enter(solo, wait=True)
        entered.set()

    thread = threading.Thread(target=enter, daemon=True)
    thread.start()
    time.sleep(0.05)  # it has asked
    return thread, entered


def test_ordinary_runs_go_in_together_and_a_solo_run_alone() -> None:
    gate = RunGate()
    assert gate.enter(False, wait=False) and gate.enter(False, wait=False)
    assert gate.inside == (2, False)
    assert not gate.enter(True, wait=False)  # not while ordinary runs are in
    gate.leave(False)
    gate.leave(False)
    assert gate.enter(True, wait=False)
    assert gate.inside == (0, True)
    assert not gate.enter(False, wait=False) and not gate.enter(True, wait=False)
    gate.leave(True)
    assert gate.enter(False, wait=False)
    gate.leave(False)
    assert gate.inside == (0, False)


def test_a_solo_run_that_waits_is_passed_by_no_run_that_came_after_it() -> None:
    gate = RunGate()
    assert gate.enter(False, wait=False)
    solo, solo_in = _waiting(gate, True)
    # An ordinary run that comes now waits for the solo run, which waits for the first.
    assert not gate.enter(False, wait=False)
    later, later_in = _waiting(gate, False)
    assert not solo_in.is_set() and not later_in.is_set()
    gate.leave(False)
    assert solo_in.wait(5)
    assert not later_in.wait(0.2)
    assert gate.inside == (0, True)
    gate.leave(True)
    assert later_in.wait(5)
    solo.join(5)
    later.join(5)
    gate.leave(False)


def test_an_ordinary_run_that_waits_goes_before_a_later_solo_run() -> None:
    gate = RunGate()
    assert gate.enter(True, wait=False)
    first, first_in = _waiting(gate, False)
    solo, solo_in = _waiting(gate, True)
    gate.leave(True)
    assert first_in.wait(5)
    assert not solo_in.wait(0.2)  # the ordinary run came first and is inside
    gate.leave(False)
    assert solo_in.wait(5)
    gate.leave(True)
    first.join(5)
    solo.join(5)


def test_a_run_that_waits_gives_up_when_its_pipeline_stops() -> None:
    gate = RunGate()
    assert gate.enter(True, wait=False)
    stopping = threading.Event()
    outcome: list[bool] = []
    thread = threading.Thread(target=lambda: outcome.append(gate.enter(False, True, stopping)))
    thread.start()
    stopping.set()
    thread.join(5)
    assert outcome == [False]
    gate.leave(True)
    assert gate.inside == (0, False)
    assert gate.enter(True, wait=False)  # it left no turn behind
    gate.leave(True)
