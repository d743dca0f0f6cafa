"""A daemon whose DALI "crashes" on one pipeline, as a bug in an operator would crash it.

    python -m tests.crashing_daemon serve ...   (the arguments of ``dalid serve``)

The daemon is the real one but for one thing: once a run of a pipeline named CRASHER has been
handed to DALI, the process kills itself with SIGSEGV, while the run is in flight. Used by the
crash-attribution test (server/flight.py).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

CRASHER = "crasher"


def serve(argv: list[str]) -> int:
    from dalid.server import runner
    from dalid.server.cli import main

    schedule = runner.PipelineRunner.schedule

    def crashing(self: runner.PipelineRunner, inputs: Any) -> None:
        schedule(self, inputs)
        if self.spec.name == CRASHER:
            os.kill(os.getpid(), signal.SIGSEGV)

    runner.PipelineRunner.schedule = crashing  # type: ignore[method-assign]
    return main(argv)


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
