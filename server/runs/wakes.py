"""Wakes of waiting executors, held back by the daemon's I/O thread until its receive turn's
answers are sent (Note [Waking executors after the turn's answers]).

Note [Waking executors after the turn's answers]
------------------------------------------------
pyzmq releases the GIL in every send, receive and poll. An executor that waits for batches and
is woken by one the I/O thread has just queued (a submission, a want, a release that lets a
job's window move on) takes the GIL at the next of those releases, most often while that very
batch's answer is being sent, and runs its Python (forming a run: a few hundred µs) while the
I/O thread waits to get the GIL back. Every message that woke an executor paid that hand-over,
and the I/O thread's wall time per message was several times its CPU time.

So, within a receive turn (``Reception.turn``):

1. State changes at once, under the planner's lock, as before: a batch is queued, a want moves
   it, a release frees its window. An executor busy with a run sees them when it next looks.
2. Only the wake waits: ``notify`` counts it against its condition in the turn's set, and the
   turn's end wakes each condition once, as many waiters as were due (``notify(n)`` wakes what
   the separate notifies would have), after the turn's answers are sent.
3. A turn lasts at most ``TURN_MESSAGES`` messages or ``TURN_SECONDS`` (intake.py), which bounds
   how late a wake can come; its executors then take the GIL while the I/O thread sleeps in
   its poll.
4. The set is the turn's alone: it lives in the I/O thread's own state, made and emptied by the
   one ``turn()`` that opened it (a turn inside it adds to it). Any other caller (the in-process
   link, which serves a core without the daemon's loop; an executor settling its own batch;
   a peer's departure handled between turns) wakes at once.
5. A wake that stops a pipeline (``RunPlanner.wake``) is never held back: the thread that stops
   it then waits for its executors.
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
    this thread's turn if it is in one (point 2), else now."""
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
