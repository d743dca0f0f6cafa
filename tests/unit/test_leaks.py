"""The leak check itself (:mod:`tests.leaks`): each kind of leak is named, and what is not the
test's (there before it, or another test session's) is not."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dalid.protocol import slabs
from tests import leaks

_SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _make_segment(maker: int) -> Path:
    """A dalid segment whose record names ``maker``, as a daemon with that pid makes one."""
    path = slabs.SHM_DIR / slabs.new_name()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        slabs.write_record(fd, 4096, slabs.SlabRecord(maker, "made-by-test_leaks"))
    finally:
        os.close(fd)
    return path


def _leave_socket_file(path: Path) -> None:
    """A socket file with nothing listening: what a process that binds and never unlinks leaves."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))


def _orphan(environment: dict[str, str]) -> int:
    """A sleeping process whose parent has exited (adopted by init), as autostart makes one."""
    parent = subprocess.run(
        [
            sys.executable,
            "-c",
            "import subprocess as s, sys; "
            "print(s.Popen(sys.argv[1:], stdout=s.DEVNULL, stderr=s.DEVNULL).pid)",
            *_SLEEPER,
        ],
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(parent.stdout)


@pytest.fixture
def runtime_dir(tmp_path: Path) -> Path:
    return tmp_path / "runtime"


@pytest.fixture
def cleanup() -> Iterator[list[leaks.Leaks]]:
    """Leaks found by a test, cleaned up after it whatever it asserted."""
    found: list[leaks.Leaks] = []
    yield found
    for each in found:
        each.clean_up()


def test_each_kind_of_leak_is_named(
    tmp_path: Path, runtime_dir: Path, cleanup: list[leaks.Leaks]
) -> None:
    before = leaks.take([tmp_path])
    child = subprocess.Popen(_SLEEPER)
    made_here, made_by_child = _make_segment(os.getpid()), _make_segment(child.pid)
    _leave_socket_file(tmp_path / "left.sock")
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="left-running")
    thread.start()
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        outside, inside = leaks.left_behind(before, [tmp_path], runtime_dir, set(), grace_s=0)
        cleanup.append(outside)
        assert [process.pid for process in outside.processes] == [child.pid]
        assert outside.segments == {made_by_child.name: child.pid}
        assert outside.sockets == [tmp_path / "left.sock"]
        text = "\n".join(outside.lines())
        for named in (f"pid {child.pid} ({' '.join(_SLEEPER)})", made_by_child.name, "left.sock"):
            assert named in text
        # What is in this process is judged later (a wider fixture may own it): still there.
        cleanup.append(inside)
        found = leaks.still_there(inside, grace_s=0)
        assert found.segments == {made_here.name: os.getpid()}
        assert found.threads == [thread]
        assert found.fds == {fd: str(tmp_path)}
        assert not found.tasks
        text = "\n".join(found.lines())
        for named in (made_here.name, "threads: 'left-running'", f"{fd} -> {tmp_path}"):
            assert named in text
    finally:
        stop.set()
        thread.join()
        os.close(fd)
    outside.clean_up()  # kills and reaps the child, removes its segment and the socket file
    child.wait()
    assert not Path(f"/proc/{child.pid}").exists()
    assert not made_by_child.exists() and not (tmp_path / "left.sock").exists()
    assert not leaks.left_behind(before, [tmp_path], runtime_dir, set(), grace_s=0)[0]
    assert leaks.still_there(inside, grace_s=0).segments == {made_here.name: os.getpid()}
    inside.clean_up()
    assert not leaks.still_there(inside, grace_s=0)


def test_a_native_thread_is_named(runtime_dir: Path) -> None:
    """A thread that Python does not know of, as a library's thread pool starts one: here
    libc's sleep(60), started with pthread_create."""
    libc = ctypes.CDLL(None)
    before = leaks.take([])
    thread = ctypes.c_ulong()
    sleep = ctypes.cast(libc.sleep, ctypes.c_void_p)
    assert libc.pthread_create(ctypes.byref(thread), None, sleep, ctypes.c_void_p(60)) == 0
    try:
        _, inside = leaks.left_behind(before, [], runtime_dir, set(), grace_s=0)
        found = leaks.still_there(inside, grace_s=0)
        assert not found.threads and len(found.tasks) == 1
        ((tid, name),) = found.tasks.items()
        assert f"threads: native {name!r} (tid {tid})" in found.lines()
    finally:
        assert libc.pthread_cancel(thread) == 0  # sleep is a cancellation point
        assert libc.pthread_join(thread, None) == 0
    assert not leaks.still_there(inside, grace_s=0)


def test_a_child_that_exited_unreaped_is_a_leak(
    tmp_path: Path, runtime_dir: Path, cleanup: list[leaks.Leaks]
) -> None:
    before = leaks.take([])
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    outside, _ = leaks.left_behind(before, [], runtime_dir, set(), grace_s=0)
    cleanup.append(outside)
    assert [process.pid for process in outside.processes] == [child.pid]
    assert "exited but not reaped" in outside.lines()[0]
    child.wait()
    assert not leaks.left_behind(before, [], runtime_dir, set(), grace_s=0)[0]


def test_an_orphan_is_ours_only_with_this_sessions_runtime_directory(
    runtime_dir: Path, cleanup: list[leaks.Leaks]
) -> None:
    before = leaks.take([])
    ours = _orphan({**os.environ, "DALID_RUNTIME_DIR": str(runtime_dir)})
    # Another session's: same user, same machine, its own runtime directory.
    theirs = _orphan({**os.environ, "DALID_RUNTIME_DIR": str(runtime_dir) + "-other"})
    try:
        outside, _ = leaks.left_behind(before, [], runtime_dir, set(), grace_s=0)
        cleanup.append(outside)
        assert [process.pid for process in outside.processes] == [ours]
    finally:
        for pid in (ours, theirs):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_what_was_there_before_and_other_sessions_segments_are_not_leaks(
    tmp_path: Path, runtime_dir: Path, cleanup: list[leaks.Leaks]
) -> None:
    earlier = _make_segment(os.getpid())
    _leave_socket_file(tmp_path / "earlier.sock")
    daemon = subprocess.Popen(_SLEEPER)  # a module's daemon: started by the tests, running
    dead_known, dead_unknown = _dead_pid(), _dead_pid()
    before = leaks.take([tmp_path])
    made = {
        "by a running process the tests started": _make_segment(daemon.pid),
        "by a dead process the tests did not start (another session's)": _make_segment(
            dead_unknown
        ),
        "by a dead process the tests started": _make_segment(dead_known),
    }
    try:
        outside, inside = leaks.left_behind(
            before, [tmp_path], runtime_dir, {daemon.pid, dead_known}, grace_s=0
        )
        cleanup.append(outside)
        assert outside.segments == {made["by a dead process the tests started"].name: dead_known}
        assert not (outside.processes or outside.sockets or inside)
    finally:
        daemon.kill()
        daemon.wait()
        for path in [earlier, *made.values()]:
            path.unlink(missing_ok=True)
        (tmp_path / "earlier.sock").unlink()


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_without_cuda_the_cuda_state_is_nothing(runtime_dir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this process has CUDA: see the gpu-marked test below")
    before = leaks.take([])
    leaks._cuda_context()
    leaks._dali_gpu_decoding()
    assert not torch.cuda.is_initialized()
    _, inside = leaks.left_behind(before, [], runtime_dir, set(), grace_s=0)
    assert not leaks.still_there(inside, grace_s=0)


@pytest.mark.gpu
def test_cuda_state_of_the_process_is_there_before_any_test(runtime_dir: Path) -> None:
    """The GPU tests' first CUDA use (a context, DALI's GPU decoding) makes nothing a test is
    blamed for: it was made before the first snapshot."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU and a CUDA build of torch")
    before = leaks.take([])
    assert "cuda-EvtHandlr" in before.tasks.values()
    assert any(target.startswith("/dev/nvidia") for target in before.fds.values())
    leaks._cuda_context()
    leaks._dali_gpu_decoding()
    _, inside = leaks.left_behind(before, [], runtime_dir, set(), grace_s=0)
    assert not leaks.still_there(inside, grace_s=2.0)
