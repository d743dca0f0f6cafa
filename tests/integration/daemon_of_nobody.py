"""``dalid serve`` whose real uid is nobody's and effective uid root's (run as root).

A daemon serves the processes of its own uid and of root; this one's own is nobody's, so it
serves two users, as the daemon of an ordinary user does, while it reads and writes what root
may (the interpreter of the tests may live in root's home). Tests of what one user may take
from another run it with ``start_daemon(..., module="tests.integration.daemon_of_nobody")``,
in a directory that belongs to nobody.
"""

from __future__ import annotations

import os
import sys

NOBODY = 65534

if __name__ == "__main__":
    os.setresgid(NOBODY, 0, 0)
    os.setresuid(NOBODY, 0, 0)
    from dalid.server.operations.cli import main

    sys.exit(main())
