"""The leak checks tell what is not dalid's apart (:mod:`tests.foreign`), precisely: real native
threads with the names the CUDA driver and jemalloc give theirs, real files named as the CUDA
driver names its own; and what is dalid's, or only looks alike, is still named."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from dalid.protocol import slabs
from tests import foreign, leaks

_LIBC = ctypes.CDLL(None)


@contextmanager
def _native_thread(name: str | None) -> Iterator[None]:
    """A native thread (libc's sleep(60), started with pthread_create, as a library's pool
    starts one) that Python does not know of, named ``name`` (None: left as the process's)."""
    thread = ctypes.c_ulong()
    sleep = ctypes.cast(_LIBC.sleep, ctypes.c_void_p)
    assert _LIBC.pthread_create(ctypes.byref(thread), None, sleep, ctypes.c_void_p(60)) == 0
    try:
        if name is not None:
            assert _LIBC.pthread_setname_np(thread, name.encode()) == 0
        yield
    finally:
        assert _LIBC.pthread_cancel(thread) == 0  # sleep is a cancellation point
        assert _LIBC.pthread_join(thread, None) == 0


def _native_threads_left(names: list[str | None], foreign_code: str | None) -> list[str]:
    """The names of the native threads that the leak check names, of threads named ``names``
    started after its snapshot."""
    before = leaks.take([])
    with ExitStack() as threads:
        for name in names:
            threads.enter_context(_native_thread(name))
        _, inside = leaks.left_behind(
            before, [], Path("/nonexistent"), set(), grace_s=0, foreign_code=foreign_code
        )
        found = leaks.still_there(inside, grace_s=0)
        assert not found.threads and not found.fds
        return sorted(found.tasks.values())


def test_the_cuda_drivers_and_jemallocs_threads_are_not_leaks() -> None:
    names: list[str | None] = ["cuda-EvtHandlr", "cuda00001400006", "jemalloc_bg_thd"]
    # dalid's own names, and names that only look like the libraries', are still leaks.
    still: list[str | None] = [
        "dalid-io",
        "ZMQbg/IO/0",
        "cuda-EvtHandlr2",
        "cudaworker",
        "jemalloc",
    ]
    assert _native_threads_left(names + still, None) == sorted(str(name) for name in still)


def test_an_unnamed_native_thread_is_foreign_only_where_foreign_code_ran() -> None:
    process_name = Path("/proc/self/comm").read_text().strip()
    # In a test of dalid's code: a leak.
    assert _native_threads_left([None], None) == [process_name]
    # In a test that ran only DALI's own proxy: its own; a named thread still is a leak there.
    assert _native_threads_left([None, "dalid-io"], "DALI's own proxy") == ["dalid-io"]
    assert foreign.foreign_thread(process_name, "DALI's own proxy") == "DALI's own proxy"
    assert (
        foreign.foreign_thread("jemalloc_bg_thd", None) == "jemalloc's background purging threads"
    )


def _open(path: Path) -> int:
    path.write_bytes(b"\0" * 64)
    return os.open(path, os.O_RDONLY)


def test_the_cuda_drivers_file_of_this_process_is_not_a_leak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's /dev/shm/cuda.shm.<n>.<pid in hex>.<n>, here in a temporary directory
    standing for /dev/shm: the one of this process is the driver's; one named for another pid,
    one elsewhere and a dalid segment are leaks, and only the segment counts as a segment."""
    monkeypatch.setattr(slabs, "SHM_DIR", tmp_path)
    mine = tmp_path / f"cuda.shm.0.{os.getpid():x}.1"
    theirs = tmp_path / f"cuda.shm.0.{os.getppid():x}.1"
    elsewhere = tmp_path / "sub" / mine.name
    elsewhere.parent.mkdir()
    segment = tmp_path / slabs.new_name()
    before = leaks.take([])
    descriptors = [_open(path) for path in (mine, theirs, elsewhere)]
    fd = os.open(segment, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    descriptors.append(fd)
    slabs.write_record(fd, 4096, slabs.SlabRecord(os.getpid(), "made-by-test_foreign"))
    try:
        _, inside = leaks.left_behind(before, [], tmp_path, set(), grace_s=0)
        found = leaks.still_there(inside, grace_s=0)
        assert sorted(found.fds.values()) == sorted(str(p) for p in (theirs, elsewhere, segment))
        assert found.segments == {segment.name: os.getpid()}
    finally:
        for descriptor in descriptors:
            os.close(descriptor)
    assert foreign.driver_file(str(mine)) and not foreign.driver_file(str(theirs))
    assert foreign.driver_file(f"{tmp_path}/cuda.shm.0.{os.getpid():x}.2")
    assert foreign.driver_file(f"{mine} (deleted)")
    assert not foreign.driver_file(f"{tmp_path}/cuda.shm.0.{os.getpid()}x.1")


@pytest.mark.gpu
def test_the_drivers_files_open_here_are_told_apart() -> None:
    """On a GPU: the files the CUDA driver keeps open in this process once CUDA IPC is used (a
    memory handle and an event handle, as a GPU daemon exports its slabs and batch events) are
    those :func:`foreign.driver_file` names the driver's: its pid in hex, in /dev/shm."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU and a CUDA build of torch")
    from cupy.cuda import runtime

    with torch.cuda.device(0):
        memory = runtime.malloc(1 << 20)
        event = runtime.eventCreateWithFlags(runtime.eventDisableTiming | runtime.eventInterprocess)
        try:
            runtime.ipcGetMemHandle(memory)
            runtime.ipcGetEventHandle(event)
            targets = [target for target in leaks.take([]).fds.values() if "cuda.shm." in target]
        finally:
            runtime.eventDestroy(event)
            runtime.free(memory)
    if not targets:
        pytest.skip("the CUDA driver keeps no cuda.shm file open in this process")
    assert all(foreign.driver_file(target) for target in targets), targets
