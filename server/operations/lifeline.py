"""A supervised daemon ends when its supervisor does, even a daemon stuck where it cannot stop.

The supervisor starts each child with ``PR_SET_PDEATHSIG`` (SIGTERM when the supervisor dies),
checks in the child before exec that it still lives (it may have died before the prctl), and
names itself in ``$DALID_SUPERVISOR_PID``. SIGTERM only asks the daemon's loop to stop, though:
a daemon whose main thread is stuck (in a pipeline repository file that never finishes
importing, say, or in a loop that does not get back to its flag) would never see it, and run on
as an orphan holding the socket, which no new supervisor could then replace.

So the daemon also watches its supervisor from a thread of its own (:func:`watch_supervisor`):
once the supervisor is gone (the daemon has a new parent), it asks the daemon to stop (a stop
its peers are told is the supervisor's death, not an operator's: ``farewell.py``), and if
the process still runs ``ORPHAN_GRACE_S`` later, it removes what a stop would have removed (the
socket file and link, the daemon's shared memory: ``abandon``) and exits at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("dalid.server")

SUPERVISOR_ENV = "DALID_SUPERVISOR_PID"
ORPHAN_GRACE_S = 5.0
WATCH_INTERVAL_S = 0.2
EXIT_ORPHANED = 1


def supervisor_pid() -> int | None:
    """The supervisor this process runs under (None: none), as it named itself."""
    named = os.environ.pop(SUPERVISOR_ENV, "")
    return int(named) if named.isdigit() else None


def watch_supervisor(
    supervisor: int, stop: Callable[[int], None], abandon: Callable[[], None]
) -> threading.Thread:
    """Starts the watch of ``supervisor``; ``stop(supervisor)`` once it is gone."""
    thread = threading.Thread(
        target=_watch, args=(supervisor, stop, abandon), name="dalid-lifeline", daemon=True
    )
    thread.start()
    return thread


def _watch(supervisor: int, stop: Callable[[int], None], abandon: Callable[[], None]) -> None:
    # Checked at once, too: the supervisor may have died before this process was watching.
    while os.getppid() == supervisor:
        time.sleep(WATCH_INTERVAL_S)
    log.error("the supervisor (pid %d) is gone: this daemon stops", supervisor)
    stop(supervisor)
    time.sleep(ORPHAN_GRACE_S)
    # Still here: the main thread is stuck somewhere it does not see the stop.
    log.error("not stopped %.0f s after the supervisor died: exiting now", ORPHAN_GRACE_S)
    try:
        abandon()
    finally:
        os._exit(EXIT_ORPHANED)
