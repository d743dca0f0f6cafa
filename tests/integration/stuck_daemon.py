"""A real daemon whose loop gets stuck where it never sees a stop, under a real supervisor.

    python -m tests.integration.stuck_daemon SOCKET

runs a supervisor (the one of ``dalid serve``) of one child, ``... stuck_daemon --child
SOCKET``: the real ``dalid serve --no-supervisor`` on SOCKET whose loop, once the socket is
bound, makes one shared-memory slab (as a job would) and then never returns to its stop flag,
as a loop stuck receiving a flood would not. The child says ``the loop is stuck`` then.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from dalid.server.intake.daemon import Daemon
from dalid.server.operations import cli
from dalid.server.operations.supervisor import ChildSpec, Supervisor
from dalid.server.outputs.pool import PAGE
from dalid.server.outputs.shm import SharedMemorySlab


def _stuck_loop(self: Daemon) -> None:
    # What a job's outputs would hold, held until the process is killed.
    _slab = SharedMemorySlab("dalid-stuck-j1-1", PAGE)
    print("the loop is stuck", flush=True)
    while True:  # a stop request (SIGTERM) is never looked at
        time.sleep(0.1)


def main() -> int:
    if sys.argv[1] == "--child":
        Daemon._loop = _stuck_loop  # type: ignore[method-assign]
        return cli.main(["serve", "--no-supervisor", "--socket", sys.argv[2]])
    logging.basicConfig(level="INFO", format="%(asctime)s supervisor %(levelname)s %(message)s")
    socket = Path(sys.argv[1])
    command = (sys.executable, "-m", "tests.integration.stuck_daemon", "--child", str(socket))
    return Supervisor([ChildSpec("stuck", command, socket=socket)]).run()


if __name__ == "__main__":
    sys.exit(main())
