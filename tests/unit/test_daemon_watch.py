"""How a client tells a dead daemon from a silent one by its pid."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from dalid.protocol import liveness, process_running


# The check as the daemon makes it (a pidfd), and where pidfds are refused (/proc).
@pytest.mark.parametrize("check", [process_running, liveness._running_by_proc])
def test_process_running_tells_live_zombie_and_reaped_processes_apart(
    check: Callable[[int], bool],
) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        assert check(child.pid)
        assert child.stdin is not None
        child.stdin.close()
        # Exited but not yet reaped: a zombie, which os.kill(pid, 0) still reaches.
        deadline = time.monotonic() + 10
        while check(child.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not check(child.pid)
    finally:
        child.wait()
    assert not check(child.pid)


def test_process_running_answers_for_a_thread_id_and_keeps_using_pidfds() -> None:
    # A thread's id has no pidfd of its own (EINVAL): asked the old way, it is running.
    ready, done = threading.Event(), threading.Event()
    native: list[int] = []

    def hold() -> None:
        native.append(threading.get_native_id())
        ready.set()
        done.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        ready.wait(10)
        assert native[0] != os.getpid()
        assert process_running(native[0])
        assert liveness._pidfds == hasattr(os, "pidfd_open")
    finally:
        done.set()
        thread.join()
