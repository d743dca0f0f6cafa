"""One user cannot take every place of a daemon that serves two: jobs of one uid fill their
share (``--max-jobs-per-user``, half of ``--max-jobs``), are refused past it with a message that
says what to do, and a job of the other uid is still welcomed within a second; the same for
the daemon's pipelines.

The daemon runs with nobody's real uid (:mod:`tests.integration.daemon_of_nobody`), so that it
serves nobody and root; the jobs that flood it are a process of nobody's, and the test's own
(root's) is the one that must find room. Changing uid takes root: skipped without.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import zmq

from dalid.protocol import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Hello,
    PipelineRegistered,
    RegisterPipeline,
    Role,
    Welcome,
    endpoint,
    transport,
)

from ..daemons import ROOT, DaemonProcess, own_directory, start_daemon
from ..impostor import needs_root
from .daemon_of_nobody import NOBODY

# A process of nobody's: says hello as a trainer ``count`` times, each on a connection of its
# own, prints each answer, and holds its jobs (idle) until its stdin closes.
_FLOOD = """
import os, sys
import zmq
from dalid.protocol import PROTOCOL_VERSION, Error, Hello, Role, Welcome, endpoint, transport
os.setresgid({uid}, {uid}, {uid})
os.setresuid({uid}, {uid}, {uid})
context = zmq.Context()
socks = []
for n in range(int(sys.argv[2])):
    sock = transport.make_socket(context, zmq.DEALER, endpoint(sys.argv[1]), bind=False)
    socks.append(sock)
    transport.send(sock, Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER, name=f"idle{{n}}"), 1)
    if not sock.poll(30_000):
        print("no answer", flush=True)
        continue
    reply = transport.recv(sock).message
    if isinstance(reply, Welcome):
        print("welcome", flush=True)
    else:
        print("refused", reply.message, flush=True)
sys.stdin.read()
for sock in socks:
    sock.close(linger=0)
context.term()
"""


def _stopped(
    daemon: DaemonProcess,
    directory: Path,
    context: zmq.Context[Any],
    sock: zmq.Socket[Any] | None,
    flood: subprocess.Popen[str] | None,
) -> tuple[int, set[str], str]:
    """Closes the test's socket, lets nobody's process end, stops the daemon and removes its
    directory: the daemon's exit code, the segments it left, and its log."""
    if sock is not None:
        sock.close(linger=0)
    context.term()
    if flood is not None:
        flood.communicate(timeout=30)
    code = daemon.stop()
    segments = daemon.segments()
    log = daemon.log_text()
    shutil.rmtree(directory, ignore_errors=True)
    return code, segments, log


@needs_root
def test_one_users_jobs_fill_their_share_and_another_user_is_welcomed_within_a_second() -> None:
    directory = own_directory()
    os.chown(directory, NOBODY, -1)
    daemon = start_daemon(directory, "--max-jobs", "4", module="tests.integration.daemon_of_nobody")
    flood = None
    context: zmq.Context[Any] = zmq.Context()
    sock = None
    try:
        # Its socket is root's (the daemon's effective uid): let nobody's process reach it.
        directory.chmod(0o711)
        daemon.socket.chmod(0o666)
        flood = subprocess.Popen(
            [sys.executable, "-c", _FLOOD.format(uid=NOBODY), str(daemon.socket), "3"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert flood.stdout is not None
        answers = [flood.stdout.readline().strip() for _ in range(3)]
        # Its share is half of --max-jobs 4: the third job is refused, saying why and what to do.
        assert answers[:2] == ["welcome", "welcome"], answers
        assert answers[2].startswith(f"refused uid {NOBODY} already has 2 jobs"), answers
        assert "--max-jobs-per-user 2" in answers[2]
        assert "close a job of yours first" in answers[2]

        # Root's job, with nobody's jobs held idle beside it: welcomed within a second.
        sock = transport.make_socket(context, zmq.DEALER, endpoint(daemon.socket), bind=False)
        transport.send(sock, Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER, name="root"), 1)
        assert sock.poll(1_000), "root's job was not answered within a second"
        assert isinstance(transport.recv(sock).message, Welcome)
        log = daemon.log_text()
        assert "job 3 (root" in log and "job 4" not in log
    finally:
        code, segments, log = _stopped(daemon, directory, context, sock, flood)
    assert code == 0, log
    assert not segments


# A process of nobody's: one job that registers ``count`` pipelines of its own (the serialized
# graph read from a file before it changes uid), printing each answer; holds them until its
# stdin closes.
_PIPELINES = """
import os, sys
import zmq
from dalid.protocol import (
    PROTOCOL_VERSION, Hello, PipelineRegistered, RegisterPipeline, Role, Welcome, endpoint,
    transport,
)
serialized = open(sys.argv[2], "rb").read()
os.setresgid({uid}, {uid}, {uid})
os.setresuid({uid}, {uid}, {uid})
context = zmq.Context()
sock = transport.make_socket(context, zmq.DEALER, endpoint(sys.argv[1]), bind=False)
transport.send(sock, Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER, name="idle"), 1)
assert sock.poll(30_000) and isinstance(transport.recv(sock).message, Welcome)
for n in range(int(sys.argv[3])):
    request = RegisterPipeline(
        memoryview(serialized), ("data",), 2, 2, 1, 1, deterministic=True
    )
    transport.send(sock, request, 2 + n)
    if not sock.poll(60_000):
        print("no answer", flush=True)
        continue
    reply = transport.recv(sock).message
    if isinstance(reply, PipelineRegistered):
        print("registered", flush=True)
    else:
        print("refused", reply.message, flush=True)
sys.stdin.read()
sock.close(linger=0)
context.term()
"""


@needs_root
def test_one_users_pipelines_fill_their_share_and_another_users_still_start() -> None:
    from ..unit.test_operators import small

    directory = own_directory()
    os.chown(directory, NOBODY, -1)
    graph = directory / "graph"
    serialized = small().serialize()
    graph.write_bytes(serialized)
    daemon = start_daemon(
        directory,
        "--max-jobs",
        "4",
        "--max-daemon-pipelines",
        "4",
        module="tests.integration.daemon_of_nobody",
    )
    flood = None
    context: zmq.Context[Any] = zmq.Context()
    sock = None
    try:
        directory.chmod(0o711)
        daemon.socket.chmod(0o666)
        flood = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _PIPELINES.format(uid=NOBODY),
                str(daemon.socket),
                str(graph),
                "3",
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert flood.stdout is not None
        answers = [flood.stdout.readline().strip() for _ in range(3)]
        # Its share: as much of --max-daemon-pipelines 4 as --max-jobs-per-user 2 is of
        # --max-jobs 4, so 2 pipelines; the third is refused, saying why.
        assert answers[:2] == ["registered", "registered"], answers
        assert answers[2].startswith(f"refused uid {NOBODY} already runs 2 pipelines"), answers
        assert "--max-jobs-per-user" in answers[2]

        # Root's job still starts a pipeline of its own.
        sock = transport.make_socket(context, zmq.DEALER, endpoint(daemon.socket), bind=False)
        transport.send(sock, Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER, name="root"), 1)
        assert sock.poll(10_000) and isinstance(transport.recv(sock).message, Welcome)
        request = RegisterPipeline(
            memoryview(serialized), ("data",), 2, 2, 1, 1, deterministic=True
        )
        transport.send(sock, request, 2)
        assert sock.poll(60_000)
        reply = transport.recv(sock).message
        assert not (isinstance(reply, Error) and reply.code is ErrorCode.RESOURCE_EXHAUSTED), reply
        assert isinstance(reply, PipelineRegistered), reply
    finally:
        code, segments, log = _stopped(daemon, directory, context, sock, flood)
    assert code == 0, log
    assert not segments


# A process of nobody's: a job that registers 2 pipelines of its own and idles, and another job
# that registers one, at once and again once the first has idled ``idle_s``; prints each answer
# and the notice the first job's connection gets, then holds its jobs until its stdin closes.
_IDLE_AND_NEWCOMER = """
import os, sys, time
import zmq
from dalid.protocol import (
    PROTOCOL_VERSION, Error, Hello, PipelineRegistered, RegisterPipeline, Role, Welcome,
    endpoint, transport,
)
serialized = open(sys.argv[2], "rb").read()
idle_s = float(sys.argv[3])
os.setresgid({uid}, {uid}, {uid})
os.setresuid({uid}, {uid}, {uid})
context = zmq.Context()

def job(name):
    sock = transport.make_socket(context, zmq.DEALER, endpoint(sys.argv[1]), bind=False)
    transport.send(sock, Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER, name=name), 1)
    assert sock.poll(30_000) and isinstance(transport.recv(sock).message, Welcome)
    return sock

def register(sock, request_id):
    request = RegisterPipeline(memoryview(serialized), ("data",), 2, 2, 1, 1, deterministic=True)
    transport.send(sock, request, request_id)
    if not sock.poll(60_000):
        return "no answer"
    reply = transport.recv(sock).message
    return "registered" if isinstance(reply, PipelineRegistered) else "refused " + reply.message

idle = job("idle")
print(register(idle, 2), flush=True)
print(register(idle, 3), flush=True)
newcomer = job("newcomer")
print(register(newcomer, 2), flush=True)
time.sleep(idle_s + 0.3)
print(register(newcomer, 3), flush=True)
if idle.poll(10_000):
    notice = transport.recv(idle).message
    ended = isinstance(notice, Error) and notice.ends_jobs
    print("ended" if ended else "other", notice.message, flush=True)
else:
    print("no notice", flush=True)
sys.stdin.read()
for sock in (idle, newcomer):
    sock.close(linger=0)
context.term()
"""


@needs_root
def test_a_users_pipeline_that_finds_its_share_full_ends_that_users_idle_job() -> None:
    """Nobody's idle job fills nobody's share of the pipelines; nobody's next job starts one
    once that job has been idle for --reclaim-idle-s, ending it, and root's job, idle longer,
    is not the one ended (it does not compete for nobody's share)."""
    from ..unit.test_operators import small

    idle_s = 1.0
    directory = own_directory()
    os.chown(directory, NOBODY, -1)
    graph = directory / "graph"
    serialized = small().serialize()
    graph.write_bytes(serialized)
    daemon = start_daemon(
        directory,
        "--max-jobs",
        "4",
        "--max-daemon-pipelines",
        "4",
        "--reclaim-idle-s",
        f"{idle_s:g}",
        module="tests.integration.daemon_of_nobody",
    )
    flood = None
    context: zmq.Context[Any] = zmq.Context()
    sock = None
    try:
        directory.chmod(0o711)
        daemon.socket.chmod(0o666)
        # Root's job, with a pipeline of its own, idle longest.
        sock = transport.make_socket(context, zmq.DEALER, endpoint(daemon.socket), bind=False)
        transport.send(sock, Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER, name="root"), 1)
        assert sock.poll(10_000) and isinstance(transport.recv(sock).message, Welcome)
        request = RegisterPipeline(
            memoryview(serialized), ("data",), 2, 2, 1, 1, deterministic=True
        )
        transport.send(sock, request, 2)
        assert sock.poll(60_000)
        assert isinstance(transport.recv(sock).message, PipelineRegistered)
        flood = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _IDLE_AND_NEWCOMER.format(uid=NOBODY),
                str(daemon.socket),
                str(graph),
                f"{idle_s:g}",
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert flood.stdout is not None
        answers = [flood.stdout.readline().strip() for _ in range(5)]
        assert answers[:2] == ["registered", "registered"], answers
        # Nobody's share of --max-daemon-pipelines 4 is 2: refused at first, saying why.
        assert answers[2].startswith(f"refused uid {NOBODY} already runs 2 pipelines"), answers
        assert f"none of the jobs it competes with has been idle for {idle_s:g} s" in answers[2]
        # Once nobody's first job has idled long enough, it makes room, told why.
        assert answers[3] == "registered", answers
        assert answers[4].startswith("ended job 2 was ended after "), answers
        assert (
            " s idle, to make room for another job's pipeline (job 3); the daemon is full: uid "
            f"{NOBODY} already runs 2 pipelines"
        ) in answers[4], answers
        status = daemon.status()
        assert sorted(job.name for job in status.jobs) == ["newcomer", "root"]
    finally:
        code, segments, log = _stopped(daemon, directory, context, sock, flood)
    assert code == 0, log
    assert not segments
    assert log.count("reclaimed after") == 1, log
