"""The daemon loop's timed chores: what it does at times rather than on news.

Each second the reap of dead peers, the drop of trainers stopped or frozen past their limit
(:mod:`.frozen`), and with them giving freed memory back to the system (:mod:`.heap`); the
status snapshot the metrics endpoint serves, while there is one; and the idle timeout. The
loop asks :meth:`Chores.sleep_ms` how long it may sleep, and calls :meth:`Chores.run` once a
turn. Used by the loop's thread alone.

Note [The loop's timers]
~~~~~~~~~~~~~~~~~~~~~~~~
The loop wakes for news or when a timed chore is due, never on a fixed tick: its poll sleeps
until the first chore's time (``sleep_ms``), and what must be seen at once comes as news (a
message, a monitor event, a write to the eventfd). Why, and the tests that hold it:
docs/design/daemon-loop.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dalid.protocol import StatusReport

from ..handling.core import DaemonCore
from .frozen import FrozenTrainers
from .heap import HeapKeeper, give_back_free_memory
from .intake import Intake

log = logging.getLogger("dalid.server")

# How often dead peers are reaped.
REAP_INTERVAL_S = 1.0
# Batch inputs freed since the last time, past which the loop gives the heap's free memory back.
TRIM_AFTER_BYTES = 16 << 20
# How often the status snapshot that the metrics endpoint serves is refreshed (only while the
# daemon serves metrics).
SNAPSHOT_INTERVAL_S = 1.0


def sleep_ms(now: float, reap_at: float, *due: float | None, cut_in: float | None = None) -> int:
    """How long the loop may sleep, in ms rounded up: until the reap, or the first other time
    in ``due`` that is set (monotonic seconds), or ``cut_in`` seconds from now if sooner."""
    wake_at = min([reap_at, *(t for t in due if t is not None)])
    wait_s = wake_at - now if cut_in is None else min(wake_at - now, cut_in)
    return max(0, int(wait_s * 1000) + 1)


class Chores:
    """When each timed chore of the loop is next due, and what memory was freed since the
    heap was last trimmed. ``publish`` takes each new status snapshot (None: no metrics
    endpoint, no snapshots); ``idle_timeout``: seconds without jobs after which the daemon
    exits (None: never)."""

    def __init__(
        self,
        core: DaemonCore,
        intake: Intake,
        now: float,
        *,
        idle_timeout: float | None,
        publish: Callable[[StatusReport], None] | None,
    ) -> None:
        self._core = core
        self._intake = intake
        self._idle_timeout = idle_timeout
        self._publish = publish
        self._next_reap = now + REAP_INTERVAL_S
        self._next_snapshot = now + SNAPSHOT_INTERVAL_S
        self._idle_since: float | None = now
        # A job that ended, a connection cut, or batch inputs freed since the last trim leave
        # freed memory to give back; counted, as a flooding job may come and go within a reap.
        self._departures = self._departed()
        self._inputs_peak = core.inputs.held
        # And while jobs run, whenever the heap's resident memory has grown (heap.py).
        self._heap = HeapKeeper(trim=give_back_free_memory)
        self._frozen = FrozenTrainers()

    def sleep_ms(self, now: float, cut_in: float | None) -> int:
        """How long the loop may sleep from ``now``: until the first chore is due, or
        ``cut_in`` seconds (a cut connection's grace) if sooner."""
        timeout, idle_since = self._idle_timeout, self._idle_since
        return sleep_ms(
            now,
            self._next_reap,
            self._next_snapshot if self._publish is not None else None,
            idle_since + timeout if timeout is not None and idle_since is not None else None,
            cut_in=cut_in,
        )

    def run(self, now: float) -> bool:
        """Does what is due at ``now``; whether the daemon has had no jobs for its idle
        timeout, and should exit."""
        if now >= self._next_reap:
            self._reap(now)
        if self._publish is not None and now >= self._next_snapshot:
            # Only the metrics endpoint reads it: without one, the status is made when asked.
            self._publish(self._core.status())
            self._next_snapshot = now + SNAPSHOT_INTERVAL_S
        if self._core.jobs:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        timeout, idle_since = self._idle_timeout, self._idle_since
        if timeout is not None and idle_since is not None and now - idle_since >= timeout:
            log.info("no jobs for %.0f s: exiting", timeout)
            return True
        return False

    def _reap(self, now: float) -> None:
        core = self._core
        core.reap()
        self._drop_frozen(now)
        self._next_reap = now + REAP_INTERVAL_S
        self._inputs_peak = max(self._inputs_peak, core.inputs.take_peak())
        held = core.inputs.held
        departures = self._departed()
        if departures != self._departures or self._inputs_peak - held >= TRIM_AFTER_BYTES:
            self._heap.trim()
            self._departures = departures
            self._inputs_peak = held
        else:
            self._heap.check()

    def _drop_frozen(self, now: float) -> None:
        """Shuts down the connection of each trainer stopped or frozen past the limit: the
        monitor then reports it closed, which ends its job."""
        trainers = self._core.registry.trainers()
        for identity, pid, state, held in self._frozen.past_limit(now, trainers):
            if self._intake.drop(identity) is not None:
                log.warning(
                    "the trainer of pid %d has been %s for %.0f s: dropping its connection "
                    "(its job ends)",
                    pid,
                    state.value,
                    held,
                )

    def _departed(self) -> int:
        return departures(self._core, self._intake)


def departures(core: DaemonCore, intake: Intake) -> int:
    """Jobs ended and cut connections gone, so far: each leaves freed memory to give back."""
    return core.registry.ended + intake.cuts
