"""Attacks on a real daemon by a process of another user, a hostile client and a full /dev/shm.

Each test runs one attack for real, next to a real job that must get every batch it asks for,
and checks that the daemon is still serving afterwards. Acting as another user (uid 65534,
"nobody") takes root: those tests skip without it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import zmq

from dalid.protocol import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Hello,
    Role,
    Shutdown,
    Welcome,
    decode,
    encode,
    endpoint,
    transport,
)

from ..daemons import DaemonProcess, kill_leftovers, own_directory, start_daemon, start_job
from .test_client_trust import NOBODY, _interpreter_for

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="acts as another user: needs root")

# Runs as another user, with the standard library only (tests/integration/zmtp.py's peer).
# Its plan: connections one after the other, each with its routing id, the READY properties
# it claims, the messages it sends, and whether it reads the answers or closes at once.
_INTRUDER = """{zmtp}
import json, sys
for step in json.loads(sys.argv[2]):
    peer = RawPeer(
        sys.argv[1],
        timeout=step.get("timeout", 5.0),
        routing_id=bytes.fromhex(step.get("rid", "")),
        properties=tuple((k.encode(), v.encode()) for k, v in step.get("properties", [])),
    )
    for message in step["messages"]:
        peer.send([bytes.fromhex(frame) for frame in message])
    if step.get("read"):
        try:
            while True:
                print("reply", *(part.hex() for part in peer.receive()), flush=True)
        except TimeoutError:
            print("timeout", flush=True)
        except (ConnectionError, OSError):
            print("closed", flush=True)
    peer.close()
print("done", flush=True)
"""


def _hex(message: Any, request_id: int) -> list[str]:
    return [bytes(frame).hex() for frame in encode(message, request_id)]


def intrude(python: str, daemon: DaemonProcess, plan: list[dict[str, Any]]) -> list[Any]:
    """Runs ``plan`` as user nobody against ``daemon``; the replies it read (decoded), with
    "closed" or "timeout" where a read ended."""
    code = _INTRUDER.format(zmtp=(Path(__file__).parent / "zmtp.py").read_text())
    run = subprocess.run(
        [python, "-I", "-S", "-c", code, str(daemon.socket), json.dumps(plan)],
        user=NOBODY,
        group=NOBODY,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = run.stdout.splitlines()
    assert lines and lines[-1] == "done", run.stdout + run.stderr
    return [
        decode([bytes.fromhex(part) for part in line.split()[1:]]).message
        if line.startswith("reply ")
        else line
        for line in lines[:-1]
    ]


def opened_up(directory: Path, daemon: DaemonProcess) -> None:
    """Widens the modes as an operator sharing the daemon might: others may connect."""
    directory.chmod(0o711)
    daemon.socket.chmod(0o666)


def steady_job(daemon: DaemonProcess, batches: int) -> subprocess.Popen[str]:
    """A real job beside the attack, one batch at a time; waits until it runs."""
    job = start_job(
        "load_job", daemon.socket, "--name", "steady", "--workers", "0",
        "--batches", str(batches), "--window", "3", "--batch", "4",
    )  # fmt: skip
    assert job.stdout is not None
    line = job.stdout.readline()
    assert line.strip() == "running", line + job.communicate()[0]
    return job


def finished(job: subprocess.Popen[str], batches: int) -> None:
    """The job got all its batches, every one checked by the job itself."""
    out, _ = job.communicate(timeout=90)
    assert job.returncode == 0 and f"ok {batches}" in out, out


def still_serving(daemon: DaemonProcess) -> None:
    assert daemon.process.poll() is None, daemon.log_text()
    daemon.status()  # answers
    log = daemon.log_text()
    assert "shutdown requested" not in log
    assert "(intruder" not in log  # no job was opened for the intruder


def refused_as_stranger(reply: Any) -> None:
    assert isinstance(reply, Error) and reply.code is ErrorCode.NOT_WELCOMED, reply
    assert f"uid {NOBODY} is refused" in reply.message


@needs_root
def test_another_user_who_sends_shutdown_and_closes_at_once_stops_nothing() -> None:
    python = _interpreter_for(NOBODY)
    if python is None:
        pytest.skip("no Python that another user may run")
    directory = own_directory()
    daemon = start_daemon(directory)
    job = steady_job(daemon, 30)
    try:
        opened_up(directory, daemon)
        hello = _hex(Hello(PROTOCOL_VERSION, 1, Role.TRAINER, name="intruder"), 1)
        shutdown = _hex(Shutdown(), 2)
        plan: list[dict[str, Any]] = [
            # Gone before the daemon reads the message: its credentials are the message's.
            *({"messages": [shutdown]} for _ in range(6)),
            *({"messages": [hello, shutdown]} for _ in range(3)),
            # Claiming another sender in the metadata it sends changes nothing.
            {"messages": [shutdown], "properties": [("Peer-Address", "localhost:0:0:1")]},
            # One that stays to read: told once, then cut; nothing after the first is read.
            {"messages": [shutdown, hello, shutdown], "read": True},
        ]
        replies = intrude(python, daemon, plan)
        assert len(replies) == 2, replies
        refused_as_stranger(replies[0])
        assert replies[1] == "closed"
        still_serving(daemon)
        finished(job, 30)
        assert not daemon.status().jobs
    finally:
        kill_leftovers([job])
        assert daemon.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)


@needs_root
def test_another_user_reusing_a_clients_routing_id_gets_nothing() -> None:
    # A routing id is no secret: a client may choose one (zmq.ROUTING_ID), and an attacker
    # may guess one. Without ROUTER_HANDOVER, this attack aborted the daemon inside libzmq.
    python = _interpreter_for(NOBODY)
    if python is None:
        pytest.skip("no Python that another user may run")
    directory = own_directory()
    daemon = start_daemon(directory)
    job = steady_job(daemon, 30)
    context: zmq.Context[Any] = zmq.Context()
    victim_id = b"victim-routing-id"
    victim = context.socket(zmq.DEALER)
    try:
        opened_up(directory, daemon)
        victim.setsockopt(zmq.ROUTING_ID, victim_id)
        victim.connect(endpoint(daemon.socket))
        transport.send(victim, Hello(PROTOCOL_VERSION, 1, Role.TRAINER, name="victim"), 1)
        assert victim.poll(10_000) and isinstance(transport.recv(victim).message, Welcome)
        hello = _hex(Hello(PROTOCOL_VERSION, 1, Role.TRAINER, name="intruder"), 1)
        shutdown = _hex(Shutdown(), 2)
        # Under the victim's id while it is connected, then again once it is gone; each time
        # it sends more than the daemon reads of a connection at once, then reads or closes.
        step = {"rid": victim_id.hex(), "messages": [shutdown, hello, shutdown]}
        replies = intrude(python, daemon, [{**step, "read": True}, step, {**step, "read": True}])
        assert replies.count("closed") == 2, replies
        for reply in replies:
            if reply != "closed":
                assert isinstance(reply, Error) and reply.code is ErrorCode.NOT_WELCOMED, reply
        still_serving(daemon)
        finished(job, 30)
        # No job but the victim's (whose connection may have been handed over: its job then
        # ends with it, a denial of service to whoever knows its routing id, not a way in).
        assert {job.name for job in daemon.status().jobs} <= {"victim"}
    finally:
        victim.close(linger=0)
        context.term()
        kill_leftovers([job])
        assert daemon.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)
