"""Stopping a pipeline's threads off the daemon's loop: a DALI call that never returns holds up
only the pipeline it is in.

Note [A pipeline stuck inside DALI]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A pipeline's thread can be inside a DALI call that does not return (a read blocked on a path
made a FIFO after its check, a stuck network mount): nothing in Python can end that call. So a
job's end, on the daemon's loop, never joins a pipeline's threads itself: :func:`stop_aside`
runs the executor's stop (bounded, :data:`STOP_TIMEOUT_S`) in a thread of its own and waits
for it at most :data:`LOOP_WAIT_S`. A stop not done by then counts as not stopped (the job's
output memory stays mapped, as for a pipeline that could not be stopped); the pipeline's thread
ends on its own once its DALI call returns. At the daemon's exit, a stop still under way means a
thread that may never end: the process then exits without waiting for it
(:func:`any_under_way`, ``operations/cli.py``), its socket and lock files already removed.
Why, and what it leaves open: docs/design/checking-paths.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("dalid.server")

# How long the daemon's loop waits for a stop: a pipeline between runs stops in microseconds,
# one inside a run once DALI returns it (milliseconds).
LOOP_WAIT_S = 0.2
# How long a stop's own thread waits for the pipeline's threads before it says so in the log.
STOP_TIMEOUT_S = 10.0
# Then it waits on, without a bound but its process's.
FOREVER_S = 365 * 86400.0

_under_way: set[threading.Thread] = set()
_lock = threading.Lock()


def stop_aside(name: str, stop: Callable[[float], bool]) -> bool:
    """Runs ``stop(STOP_TIMEOUT_S)`` in a thread of its own; whether it returned True within
    :data:`LOOP_WAIT_S`. Never waits longer, whatever DALI does."""
    done = threading.Event()
    stopped = False

    def run() -> None:
        nonlocal stopped
        try:
            stopped = stop(STOP_TIMEOUT_S)
            done.set()
            if not stopped:
                log.warning(
                    "DALI pipeline %s is inside a DALI call that has not returned in %.0f s: "
                    "left to end on its own; its jobs are ended and the daemon goes on",
                    name,
                    STOP_TIMEOUT_S,
                )
                stop(FOREVER_S)
                log.info("DALI pipeline %s: its DALI call returned at last, and it ended", name)
        finally:
            done.set()
            with _lock:
                _under_way.discard(threading.current_thread())

    thread = threading.Thread(target=run, name=f"dalid-stop-{name}", daemon=True)
    with _lock:
        _under_way.add(thread)
    thread.start()
    return done.wait(LOOP_WAIT_S) and stopped


def any_under_way() -> bool:
    """Whether a stop still waits for a pipeline's threads (Note [A pipeline stuck inside
    DALI])."""
    with _lock:
        return any(thread.is_alive() for thread in _under_way)
