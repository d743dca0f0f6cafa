"""What the daemon takes on a client's word, and what it checks for itself: the process and the
user behind a connection come from its socket, and a client's figures are checked."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from dalid.protocol import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Hello,
    Role,
    Welcome,
    decode,
    endpoint,
    transport,
)

from ..daemons import ROOT, own_directory, start_daemon, wait_for

LIAR = (sys.executable, "-m", "tests.integration.liar")


@pytest.mark.parametrize("claim", [0, 1], ids=["pid-0", "pid-of-init"])
def test_a_job_ends_with_its_trainers_process_whatever_pid_it_claims(claim: int) -> None:
    directory = own_directory()
    daemon = start_daemon(directory)
    liar = subprocess.Popen(
        [*LIAR, "--socket", str(daemon.socket), "--claim", str(claim)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = 0
    try:
        assert liar.stdout is not None
        job_id = int(liar.stdout.readline().split()[1])
        child = int(liar.stdout.readline().split()[1])
        (job,) = daemon.status().jobs
        assert (job.job_id, job.pid) == (job_id, liar.pid)  # the socket's word, not the hello's
        liar.kill()
        liar.wait()
        # Its connection lives on in the child, answering the daemon; the job ends anyway.
        wait_for(lambda: not daemon.status().jobs, 10, "the dead trainer's job to end")
        os.kill(child, 0)  # the child, and the connection, were still there
        assert f"job {job_id}: trainer pid {liar.pid} is gone" in daemon.log_text()
    finally:
        if child:
            os.kill(child, signal.SIGKILL)  # it holds the liar's stdout too
        liar.kill()
        liar.communicate()
        assert daemon.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)


# Runs as another user, with nothing but the standard library: the hand-written ZMTP peer of
# tests/integration/zmtp.py, a hello, and what comes back.
_AS_ANOTHER_USER = """{zmtp}
import sys
try:
    peer = RawPeer(sys.argv[1], timeout=10.0)
    print("reply", *(part.hex() for part in peer.receive()), flush=True)
except ConnectionRefusedError as refusal:
    print("refused", refusal, flush=True)
except (ConnectionError, OSError):
    print("closed", flush=True)
"""


def _interpreter_for(uid: int) -> str | None:
    """A Python that user ``uid`` may run (this one may live in root's home)."""
    for candidate in (
        os.path.realpath(sys.executable),
        shutil.which("python3"),
        "/usr/bin/python3",
    ):
        if candidate is None:
            continue
        try:
            probe = subprocess.run(
                [candidate, "-I", "-S", "-c", "pass"], user=uid, capture_output=True, check=False
            )
        except OSError:
            continue  # not executable by that user
        if probe.returncode == 0:
            return candidate
    return None


NOBODY = 65534


@pytest.mark.skipif(os.getuid() != 0, reason="runs a client as another user: needs root")
def test_a_process_of_another_user_is_refused_even_where_the_socket_lets_it_in() -> None:
    python = _interpreter_for(NOBODY)
    if python is None:
        pytest.skip("no Python that another user may run")
    directory = own_directory()
    daemon = start_daemon(directory)
    try:
        # A mode widened by mistake: the socket no longer keeps other users out.
        directory.chmod(0o711)
        daemon.socket.chmod(0o666)
        zmtp = (Path(__file__).parent / "zmtp.py").read_text()
        code = _AS_ANOTHER_USER.format(zmtp=zmtp)
        run = subprocess.run(
            [python, "-I", "-S", "-c", code, str(daemon.socket)],
            user=NOBODY,
            group=NOBODY,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        # Refused at the handshake (ZeroMQ's ERROR carries the status), before any message.
        assert run.stdout.splitlines() == ["refused 400"], run.stdout + run.stderr
        assert f"uid {NOBODY} is refused" in daemon.log_text()
        assert not daemon.status().jobs
    finally:
        assert daemon.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)


def _raw_request(socket: Path, frames: list[bytes]) -> Any:
    context: zmq.Context[Any] = zmq.Context()
    sock = transport.make_socket(context, zmq.DEALER, endpoint(socket), bind=False)
    try:
        sock.send_multipart(frames)
        assert sock.poll(10_000), "no answer"
        return decode(sock.recv_multipart()).message
    finally:
        sock.close(linger=0)
        context.term()


def test_an_infinite_progress_figure_is_refused_on_the_wire(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp)
    context: zmq.Context[Any] = zmq.Context()
    sock = transport.make_socket(context, zmq.DEALER, endpoint(daemon.socket), bind=False)
    try:
        transport.send(sock, Hello(PROTOCOL_VERSION, 1, Role.TRAINER, name="t"), 1)
        assert sock.poll(10_000) and isinstance(transport.recv(sock).message, Welcome)
        for waited in (float("inf"), float("nan")):
            header = {
                "v": PROTOCOL_VERSION,
                "op": "trainer_progress",
                "rid": None,
                "body": {"waited_seconds": waited, "batches_received": 3},
            }
            sock.send_multipart([msgpack.packb(header)])
            assert sock.poll(10_000)
            reply = transport.recv(sock).message
            assert isinstance(reply, Error) and reply.code is ErrorCode.MALFORMED_MESSAGE
            assert "waited_seconds must be a finite number" in reply.message
        (job,) = daemon.status().jobs
        assert job.trainer_wait_seconds == 0.0
    finally:
        sock.close(linger=0)
        context.term()
        assert daemon.stop() == 0


def test_one_process_holds_at_most_its_share_of_the_jobs(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp, "--max-jobs-per-process", "3", "--max-jobs", "5")
    context: zmq.Context[Any] = zmq.Context()
    socks: list[zmq.Socket[Any]] = []

    def hello(name: str) -> Any:
        sock = transport.make_socket(context, zmq.DEALER, endpoint(daemon.socket), bind=False)
        socks.append(sock)
        transport.send(sock, Hello(PROTOCOL_VERSION, 1, Role.TRAINER, name=name), 1)
        assert sock.poll(10_000)
        return transport.recv(sock).message

    try:
        # Idle connections of one process: it holds three jobs, no more.
        assert all(isinstance(hello(f"idle{i}"), Welcome) for i in range(3))
        refused = hello("one too many")
        assert isinstance(refused, Error) and refused.code is ErrorCode.RESOURCE_EXHAUSTED
        assert f"process {os.getpid()} already has 3 jobs" in refused.message
        assert "--max-jobs-per-process 3" in refused.message
        # Another process still gets in.
        other = subprocess.run(
            [sys.executable, "-c", _OTHER_PROCESS, str(daemon.socket)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert other.stdout.strip() == "welcome", other.stdout + other.stderr
    finally:
        for sock in socks:
            sock.close(linger=0)
        context.term()
        wait_for(lambda: not daemon.status().jobs, 10, "the jobs to end")
        assert daemon.stop() == 0


_OTHER_PROCESS = """
import os, sys, zmq
from pathlib import Path
from dalid.protocol import PROTOCOL_VERSION, Hello, Role, endpoint, transport
context = zmq.Context()
sock = transport.make_socket(context, zmq.DEALER, endpoint(Path(sys.argv[1])), bind=False)
transport.send(sock, Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER), 1)
assert sock.poll(10000)
print(transport.recv(sock).message.OP)
sock.close(linger=0)
context.term()
"""
