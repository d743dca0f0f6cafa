"""How a client tells a dead daemon from a silent one by its pid."""

from __future__ import annotations

import subprocess
import sys
import time

from dalid.protocol import process_running


def test_process_running_tells_live_zombie_and_reaped_processes_apart() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        assert process_running(child.pid)
        assert child.stdin is not None
        child.stdin.close()
        # Exited but not yet reaped: a zombie, which os.kill(pid, 0) still reaches.
        deadline = time.monotonic() + 10
        while process_running(child.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not process_running(child.pid)
    finally:
        child.wait()
    assert not process_running(child.pid)
