"""A daemon whose DALI "crashes" on one pipeline, as a bug in an operator would crash it.

    python -m tests.crashing_daemon serve ...   (the arguments of ``dalid serve``)

The daemon is the real one but for one thing: once a run of a pipeline named CRASHER has been
handed to DALI, the process kills itself with SIGSEGV, while the run is in flight. Used by the
crash-attribution test (server/pipelines/flight.py).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

CRASHER = "crasher"


def serve(argv: list[str]) -> int:
    from dalid.server.operations.cli import main
    from dalid.server.pipelines import runner

    schedule = runner.PipelineRunner.schedule

    def crashing(self: runner.PipelineRunner, inputs: Any) -> None:
        schedule(self, inputs)
        if self.spec.name == CRASHER:
            # To this thread, so that it dies here, with the run in flight: a signal to the
            # process may be taken by another thread later, after this one has collected the
            # run and the flight record says no run is in DALI (seen on a loaded machine).
            signal.pthread_kill(threading.get_ident(), signal.SIGSEGV)
            threading.Event().wait()  # never past this point, whichever thread takes it

    runner.PipelineRunner.schedule = crashing  # type: ignore[method-assign]
    return main(argv)


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
