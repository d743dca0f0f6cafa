"""Another user's process listening on a socket a dalid client might be pointed at.

``Impostor(path)`` runs a process that binds ``path`` as this user (so the socket file is
the user's own, as in a directory the user shares), then becomes ``OTHER_UID`` and listens:
the kernel then reports that uid as the listener's (``SO_PEERCRED``). It accepts connections
and records every byte it is sent; :meth:`Impostor.received` stops it and returns them.
Changing uid takes root: tests that need it are skipped without (``needs_root``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

OTHER_UID = 65534  # nobody
needs_root = pytest.mark.skipif(
    os.getuid() != 0, reason="acting as another user (chown, setuid) needs root"
)

_SCRIPT = """
import os, select, socket, sys
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
os.setgid(int(sys.argv[2]))
os.setuid(int(sys.argv[2]))
server.listen(16)
print("listening", flush=True)
received = bytearray()
peers = []
while True:
    ready, _, _ = select.select([server, sys.stdin, *peers], [], [])
    if sys.stdin in ready:
        break
    if server in ready:
        peers.append(server.accept()[0])
    for peer in [p for p in peers if p in ready]:
        data = peer.recv(65536)
        received += data
        if not data:
            peers.remove(peer)
            peer.close()
sys.stdout.write(received.hex())
"""


class Impostor:
    def __init__(self, path: Path, uid: int = OTHER_UID) -> None:
        self.path = path
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, str(path), str(uid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != "listening":
            self.process.kill()
            raise AssertionError(f"the impostor did not start: {line!r}")

    def received(self) -> bytes:
        """Stops the impostor; every byte any client sent it."""
        out, _ = self.process.communicate("stop\n", timeout=10)
        self.path.unlink(missing_ok=True)
        return bytes.fromhex(out)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.path.unlink(missing_ok=True)
