"""Wakes of waiting executors, held back by the daemon's I/O thread until its receive turn's
answers are sent (Note [Waking executors after the turn's answers]).

Note [Waking executors after the turn's answers]
------------------------------------------------
A message that lets an executor run (a submission, a want, a release) changes the state at
once, under the planner's lock; only the wake waits: ``notify`` counts it in the I/O thread's
turn, and the turn's end wakes each condition as many times, after the turn's answers are
sent. Outside a turn a wake happens at once; a wake that stops a pipeline never waits. Why and
the tests: docs/design/executor-wakes.md.
"""

from __future__ import annotations

import threading


class _Turn(threading.local):
    """The wakes held back by this thread's turn, by condition; None outside a turn."""

    def __init__(self) -> None:
        self.wakes: dict[threading.Condition, int] | None = None


_turn = _Turn()


def notify(condition: threading.Condition) -> None:
    """Wakes one thread waiting on ``condition``, whose lock the caller holds: at the end of
    this thread's turn if it is in one, else now."""
    wakes = _turn.wakes
    if wakes is None:
        condition.notify()
    else:
        wakes[condition] = wakes.get(condition, 0) + 1


class turn:  # named as the function it was: ``with wakes.turn():``
    """A receive turn: the wakes ``notify`` is asked for inside it happen when it ends, also
    when it ends in an exception. A class rather than a generator's context manager: the loop
    opens one at every wake, and this costs it a third as much."""

    __slots__ = ("_wakes",)

    def __enter__(self) -> None:
        # Inside a turn already: the outer one wakes.
        self._wakes: dict[threading.Condition, int] | None = None
        if _turn.wakes is None:
            self._wakes = _turn.wakes = {}

    def __exit__(self, *_: object) -> None:
        wakes = self._wakes
        if wakes is None:
            return
        _turn.wakes = None
        for condition, waiters in wakes.items():
            with condition:
                condition.notify(waiters)
