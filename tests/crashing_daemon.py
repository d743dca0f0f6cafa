"""A daemon whose DALI "crashes" on one pipeline, as a bug in an operator would crash it.

    python -m tests.crashing_daemon serve ...   (the arguments of ``dalid serve``)

The daemon is the real one but for one thing: once a run of a pipeline named CRASHER has been
handed to DALI, the process kills itself with SIGSEGV, while the run is in flight. One named
BESIDE does so once a run of another pipeline is in DALI too (or after 30 s without one), as a
crash among several jobs' runs would. Used by the crash-attribution tests
(server/pipelines/flight.py).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

CRASHER = "crasher"
BESIDE = "crasher-beside"
# The pipelines whose slots of the flight recorder are marked running: a slot is marked and
# cleared under the lock, so a pipeline seen here under it stays marked while the lock is held.
_marked: set[int] = set()
_lock = threading.Lock()


def serve(argv: list[str]) -> int:
    from dalid.server.operations.cli import main
    from dalid.server.pipelines import flight, runner

    schedule = runner.PipelineRunner.schedule
    running, idle = flight.FlightRecorder.running, flight.FlightRecorder.idle

    def crash() -> None:
        # To this thread, so that it dies here, with the run in flight: a signal to the
        # process may be taken by another thread later, after this one has collected the
        # run and the flight record says no run is in DALI (seen on a loaded machine).
        signal.pthread_kill(threading.get_ident(), signal.SIGSEGV)
        threading.Event().wait()  # never past this point, whichever thread takes it

    def crashing(self: runner.PipelineRunner, inputs: Any) -> None:
        schedule(self, inputs)
        if self.spec.name == BESIDE:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with _lock:
                    if len(_marked) > 1:
                        crash()  # holding the lock: the other pipeline stays marked in flight
                time.sleep(0.001)
        if self.spec.name in (CRASHER, BESIDE):
            crash()

    def marking(
        self: flight.FlightRecorder,
        instance_id: int,
        key: bytes,
        pids: Iterable[int],
        name: str,
        *,
        solo: bool = False,
    ) -> None:
        with _lock:
            running(self, instance_id, key, pids, name, solo=solo)
            _marked.add(instance_id)

    def clearing(self: flight.FlightRecorder, instance_id: int) -> None:
        with _lock:
            idle(self, instance_id)
            _marked.discard(instance_id)

    runner.PipelineRunner.schedule = crashing  # type: ignore[method-assign]
    flight.FlightRecorder.running = marking  # type: ignore[method-assign]
    flight.FlightRecorder.idle = clearing  # type: ignore[method-assign]
    return main(argv)


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
