"""A supervisor of two CPU daemons on the given sockets, for the supervisor tests.

python -m tests.integration.supervise_two SOCKET_A SOCKET_B
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from dalid.server.operations.supervisor import ChildSpec, Supervisor


def main() -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s supervisor %(levelname)s %(message)s")
    specs = []
    for name, socket in zip("ab", sys.argv[1:3], strict=True):
        command = (
            sys.executable, "-m", "dalid.server", "serve", "--no-supervisor", "--socket", socket,
        )  # fmt: skip
        specs.append(ChildSpec(name, command, Path(socket + ".log")))
    return Supervisor(specs).run()


if __name__ == "__main__":
    sys.exit(main())
