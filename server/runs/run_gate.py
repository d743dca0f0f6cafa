"""Which runs may be inside DALI together: every ordinary run, or one solo run alone.

A pipeline on probation after a crash (``pipelines/flight.py``) runs solo: while one of its runs
is in DALI, no other run of the daemon is, so that a crash then is its own. :class:`RunGate` is
taken by a run before DALI gets it and given back once DALI is done with it: shared by ordinary
runs, alone by a solo one (a readers-writer lock between runs, not threads).

Turns go by arrival: a run that waits is passed by no run that came after it, so a solo run
waits only for the runs in DALI when it came, and ordinary runs wait only for the solo runs
that came before them. A pipeline's loop asks without waiting while it has runs in DALI
(they must come out first: ``RunLoop``), and waits only when it has none.
"""

from __future__ import annotations

import itertools
import threading

# How often a run that waits looks whether its pipeline stops.
_WAIT_S = 0.1


class RunGate:
    """Runs in DALI: any number of ordinary ones, or one solo one."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._ordinary = 0
        self._solo = False
        # The turns of the runs that wait, and whether each is solo.
        self._waiting: dict[int, bool] = {}
        self._tickets = itertools.count()

    @property
    def inside(self) -> tuple[int, bool]:
        """The ordinary runs in DALI, and whether a solo run is."""
        with self._changed:
            return self._ordinary, self._solo

    def enter(self, solo: bool, wait: bool, stopping: threading.Event | None = None) -> bool:
        """Lets a run into DALI; without ``wait``, only if it may go at once. False: it may not
        (or ``stopping`` was set while it waited)."""
        with self._changed:
            ticket = next(self._tickets)
            self._waiting[ticket] = solo
            try:
                while not self._may_enter(ticket, solo):
                    if not wait or (stopping is not None and stopping.is_set()):
                        return False
                    self._changed.wait(_WAIT_S)
                if solo:
                    self._solo = True
                else:
                    self._ordinary += 1
                return True
            finally:
                del self._waiting[ticket]
                if self._waiting:  # its turn may have held up a later one
                    self._changed.notify_all()

    def leave(self, solo: bool) -> None:
        """A run that entered is out of DALI."""
        with self._changed:
            if solo:
                self._solo = False
            else:
                self._ordinary -= 1
            if self._waiting:
                self._changed.notify_all()

    def _may_enter(self, ticket: int, solo: bool) -> bool:
        if self._solo:
            return False
        earlier = [other for turn, other in self._waiting.items() if turn < ticket]
        if solo:
            return self._ordinary == 0 and not earlier
        return not any(earlier)
