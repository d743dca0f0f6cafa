"""Stopping a pipeline's threads off the daemon's loop: a DALI call that never returns holds up
only the pipeline it is in.

Note [A pipeline stuck inside DALI]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A pipeline's thread can be inside a DALI call that does not return (a read blocked on a path
made a FIFO after its check, a stuck network mount): nothing in Python can end that call. So a
job's end, on the daemon's loop, never joins a pipeline's threads itself: a :class:`Stop` runs
the executor's stop in a thread of its own, and the loop waits for a job's stops at most
:data:`LOOP_WAIT_S` in all. A job whose stops have not finished by then has its output memory closed
once they have (the core looks at each reap), unmapped if they stopped the threads, kept if not
(the thread may still write into it). At the daemon's exit a stop still under way means a thread
that may never end: the process exits without waiting for it (:func:`any_under_way`). Why, and
what it leaves open: docs/design/checking-paths.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger("dalid.server")

# How long the daemon's loop waits for a stop: a pipeline between runs stops in microseconds,
# one inside a run once DALI returns it (milliseconds on a GPU).
LOOP_WAIT_S = 0.2
# How long a stop waits for the pipeline's threads before it says so in the log; it then waits
# on, without a bound but its process's.
STOP_TIMEOUT_S = 10.0
FOREVER_S = 365 * 86400.0

_under_way: set[threading.Thread] = set()
_lock = threading.Lock()


class Stop:
    """One pipeline's stop, ``stop(timeout)`` (an executor's: whether its threads ended), run in
    a thread of its own (:func:`wait_for` waits for several at once, bounded). ``None``: nothing
    to stop."""

    def __init__(self, name: str, stop: Callable[[float], bool] | None) -> None:
        self.name = name
        self._done = threading.Event()
        self._stopped = stop is None
        if stop is None:
            self._done.set()
            return
        thread = threading.Thread(
            target=self._run, args=(stop,), name=f"dalid-stop-{name}", daemon=True
        )
        with _lock:
            _under_way.add(thread)
        thread.start()

    def wait(self, timeout: float) -> bool:
        """Waits at most ``timeout`` seconds for the stop to finish; whether it has."""
        return self._done.wait(timeout)

    @property
    def finished(self) -> bool:
        """Whether the stop has its answer: the threads ended, or did not in ``STOP_TIMEOUT_S``."""
        return self._done.is_set()

    @property
    def stopped(self) -> bool:
        """Whether the pipeline's threads have ended (False while the stop is under way)."""
        return self._done.is_set() and self._stopped

    def _run(self, stop: Callable[[float], bool]) -> None:
        try:
            self._stopped = stop(STOP_TIMEOUT_S)
            self._done.set()
            if not self._stopped:
                log.warning(
                    "DALI pipeline %s is inside a DALI call that has not returned in %.0f s: "
                    "left to end on its own; its jobs are ended and the daemon goes on",
                    self.name,
                    STOP_TIMEOUT_S,
                )
                stop(FOREVER_S)
                log.info(
                    "DALI pipeline %s: its DALI call returned at last, and it ended", self.name
                )
        finally:
            self._done.set()
            with _lock:
                _under_way.discard(threading.current_thread())


def wait_for(stops: Sequence[Stop], timeout: float = LOOP_WAIT_S) -> None:
    """Waits until every one of ``stops`` has finished, or ``timeout`` seconds, in all."""
    deadline = time.monotonic() + timeout
    for stop in stops:
        stop.wait(max(deadline - time.monotonic(), 0.0))


def any_under_way() -> bool:
    """Whether a stop still waits for a pipeline's threads (Note [A pipeline stuck inside
    DALI])."""
    with _lock:
        return any(thread.is_alive() for thread in _under_way)
