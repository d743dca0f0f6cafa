"""The daemon's socket outlives a peer that sends more than it has read and then leaves.

Such a connection's input stops (the daemon holds ``RECEIVE_QUEUE`` unread messages of it) and
is then found closed; libzmq 4.3.5 aborts the process if a ZeroMQ heartbeat of that connection
fires before the socket reads again ("Assertion failed: !_io_error"). A daemon whose loop was
busy for a moment, or stopping, while a job ended went down that way. The daemon's socket sends
no heartbeats (Note [No heartbeats from the daemon] in server/intake/daemon.py). Each case runs
in a process of its own, since what fails is an abort.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ..daemons import ROOT

SCRIPT = """
import os, sys, time
from pathlib import Path
import zmq
from dalid.protocol import Ping, endpoint, transport
from dalid.server.intake.daemon import daemon_socket
from dalid.server.intake.gate import Gate

path = Path(sys.argv[1])
heartbeats = sys.argv[2] == "heartbeats"
context = zmq.Context()
gate = Gate(context, frozenset({os.getuid(), 0}))
server = daemon_socket(context, path, 1 << 20)
if heartbeats:  # as the daemon's socket was made before
    server.close(linger=0)
    server = transport.make_socket(
        context, zmq.ROUTER, endpoint(path), bind=True, heartbeat_ms=(1000, 3000),
        queue_limits=(128, 1), zap_domain=b"dalid",
    )
peer = transport.make_socket(context, zmq.DEALER, endpoint(path), bind=False)
for request_id in range(8):
    transport.send(peer, Ping(), request_id)
time.sleep(0.5)  # sent and read into the server's connection: its input stops
peer.close(linger=1000)
time.sleep(2.5)  # not read meanwhile; past a heartbeat's interval
received = 0
while server.poll(200):
    transport.recv_frames(server)
    received += 1
print("received", received)
server.close(linger=0)
gate.close()
context.term()
"""


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "s.sock"
    try:
        return subprocess.run(
            [sys.executable, "-c", SCRIPT, str(path), mode],
            cwd=ROOT,
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        path.unlink(missing_ok=True)  # an aborted process leaves it


def test_the_daemons_socket_outlives_a_peer_that_left_with_messages_unread(
    tmp_path: Path,
) -> None:
    done = _run(tmp_path, "daemon")
    assert done.returncode == 0, done.stdout + done.stderr
    # Every message the peer sent before it left is still read.
    assert done.stdout.split() == ["received", "8"], done.stdout


def test_with_heartbeats_libzmq_aborts_there(tmp_path: Path) -> None:
    """Why the daemon sends none: the same peer, on a socket with heartbeats, aborts the
    process (if a later libzmq no longer does, the daemon could have them again)."""
    done = _run(tmp_path, "heartbeats")
    assert done.returncode != 0, done.stdout
    assert "!_io_error" in done.stderr, done.stderr
