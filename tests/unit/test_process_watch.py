"""The daemon's watch of its peers' processes: a pidfd each while known, one poll for all."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import cast

import pytest

from dalid.protocol import Hello, Limits, ProcessWatch, Role, liveness
from dalid.protocol.messages import PROTOCOL_VERSION
from dalid.server.jobs.jobs import Job, JobRegistry
from dalid.server.outputs.job_outputs import JobOutputs


def _pidfds() -> set[int]:
    """This process's open pidfds."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[pidfd]":
                found.add(int(name))
        except OSError:
            continue
    return found


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Child processes that live until their stdin is closed; all reaped at the end."""
    made: list[subprocess.Popen[bytes]] = []
    yield made
    for child in made:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(10)


def _child(children: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    children.append(child)
    return child


def _end(child: subprocess.Popen[bytes]) -> None:
    """Lets ``child`` exit, and waits until it has (a zombie: it is not reaped here)."""
    assert child.stdin is not None
    child.stdin.close()
    deadline = time.monotonic() + 10
    while liveness._running_by_proc(child.pid) and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfds", "no-pidfds"])
def test_a_watch_names_the_processes_that_exited_and_holds_a_pidfd_each_while_watched(
    children: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch, pidfds: bool
) -> None:
    if not pidfds:
        # Where pidfds are refused (a seccomp profile), the same answers the old way.
        monkeypatch.setattr(liveness, "_pidfds", False)
    before = _pidfds()
    watch = ProcessWatch()
    try:
        first, second = _child(children), _child(children)
        watch.watch(first.pid)
        watch.watch(second.pid)
        watch.watch(second.pid)  # watched twice: for a job and for its trainer's connection
        watch.watch(0)  # a process the daemon cannot see: not watched
        assert len(watch) == 2
        assert len(_pidfds() - before) == (2 if pidfds else 0)
        assert watch.exited() == set()
        _end(second)
        assert watch.exited() == {second.pid}
        watch.unwatch(second.pid)
        assert watch.exited() == {second.pid}  # one watch of it is left
        watch.unwatch(second.pid)
        assert watch.exited() == set() and len(watch) == 1
        assert len(_pidfds() - before) == (1 if pidfds else 0)
        second.wait(10)
        # A process gone before it is watched is named at once.
        watch.watch(second.pid)
        assert watch.exited() == {second.pid}
        watch.unwatch(second.pid)
    finally:
        watch.close()
    assert len(watch) == 0 and _pidfds() == before
    watch.close()


def _registry_with_a_job(pids: dict[str, int]) -> tuple[JobRegistry, Job]:
    registry = JobRegistry(liveness.pid_namespace())
    hello = Hello(PROTOCOL_VERSION, pids["trainer"], Role.TRAINER)
    limits = Limits(1, 1 << 20, 1 << 20, 1 << 20)
    # The registry keeps a job's outputs and never reads them.
    outputs = cast(JobOutputs, object())
    job = registry.open(b"t", hello, limits, lambda _: outputs, 4, pid=pids["trainer"])
    registry.join(b"t", hello, job, pids["trainer"])
    for name, pid in pids.items():
        if name != "trainer":
            joins = Hello(
                PROTOCOL_VERSION, pid, Role.WORKER, job_id=job.job_id, job_token=job.token
            )
            registry.join(name.encode(), joins, job, pid)
    return registry, job


def test_the_registry_watches_its_peers_while_it_knows_them_and_names_the_dead(
    children: list[subprocess.Popen[bytes]],
) -> None:
    """Each known process has one pidfd open, however many connections and jobs name it; a
    dead worker or trainer is found by one look; forgetting a peer, ending a job and closing
    the registry close their pidfds."""
    before = _pidfds()
    trainer, worker, other = _child(children), _child(children), _child(children)
    # w0: a process the daemon cannot see (pid 0), which lives as long as its connection.
    registry, job = _registry_with_a_job(
        {"trainer": trainer.pid, "w0": 0, "w1": worker.pid, "w2": other.pid, "w3": other.pid}
    )
    try:
        assert len(_pidfds() - before) == 3
        assert registry.dead_workers() == [] and registry.dead_jobs() == []
        _end(other)
        assert sorted(registry.dead_workers()) == [b"w2", b"w3"]
        assert registry.dead_jobs() == []
        registry.forget_peer(b"w2")
        assert len(_pidfds() - before) == 3  # w3 still names it
        registry.forget_peer(b"w3")
        assert len(_pidfds() - before) == 2 and registry.dead_workers() == []
        _end(trainer)
        assert registry.dead_jobs() == [job]
        # The job's outputs are kept until its trainer is gone: it is, so they go now.
        registry.remove(job)
        assert _pidfds() - before == set()
        registry.linger(job)
        assert registry.take_lingering() == [job]
        assert registry.take_lingering() == []
    finally:
        registry.close()
    assert _pidfds() == before


def test_the_open_file_limit_holds_a_socket_and_a_pidfd_a_connection() -> None:
    """Under a limit on open files the daemon cannot raise, it takes as many connections as
    that limit holds with each connection's socket and its process's pidfd beside the daemon's
    other files (a process of its own, so that the limit set is no other test's)."""
    script = (
        "import resource\n"
        "from dalid.server.intake.intake import OTHER_DESCRIPTORS, reserve_descriptors\n"
        "limit = OTHER_DESCRIPTORS + 100\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))\n"
        "print(reserve_descriptors(2048), reserve_descriptors(10))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["50", "10"]
