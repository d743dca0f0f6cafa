"""A ZeroMQ peer written by hand (ZMTP 3.0, NULL mechanism), over a plain Unix socket.

For what a ZeroMQ library never does: a connection whose process forks and dies while a child
keeps it open, a peer running as another user with nothing but the standard library. Standard
library only, so that it runs in any interpreter (``python -I -S``).
"""

from __future__ import annotations

import socket
import struct

_MORE, _LONG, _COMMAND = 1, 2, 4


def _greeting() -> bytes:
    signature = b"\xff" + b"\x00" * 8 + b"\x7f"
    return signature + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    """One ZMTP frame (short or long form)."""
    flags = (_MORE if more else 0) | (_COMMAND if command else 0)
    if len(body) > 255:
        return bytes([flags | _LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


class RawPeer:
    """A DEALER's side of one connection to ``path``; ``send`` and ``receive`` whole messages.
    ``routing_id``: the identity it asks the daemon's ROUTER to know it by; ``properties``:
    more metadata it sends in its READY command."""

    def __init__(
        self,
        path: str,
        timeout: float = 10.0,
        routing_id: bytes = b"",
        properties: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.sock.sendall(_greeting())
        self._exactly(64)  # the daemon's greeting
        ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        if routing_id:  # chosen, as zmq.ROUTING_ID does
            ready += b"\x08Identity" + struct.pack(">I", len(routing_id)) + routing_id
        for name, value in properties:  # any other metadata a peer may claim
            ready += bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
        self.sock.sendall(frame(ready, command=True))
        # As a ZeroMQ peer does, nothing is sent before the daemon's READY: until then the
        # daemon may still be deciding on the connection (gate.py), and takes no message.
        _, command, body = self._frame()
        if not (command and body.startswith(b"\x05READY")):
            raise ConnectionError(f"the daemon did not answer READY: {body[:20]!r}")

    def send(self, frames: list[bytes]) -> None:
        self.sock.sendall(
            b"".join(frame(body, more=i < len(frames) - 1) for i, body in enumerate(frames))
        )

    def receive(self) -> list[bytes]:
        """The next message (commands such as READY and heartbeats are skipped); raises
        ConnectionRefusedError with the reason of an ERROR command."""
        parts: list[bytes] = []
        while True:
            more, command, body = self._frame()
            if command:
                continue
            parts.append(body)
            if not more:
                return parts

    def _frame(self) -> tuple[bool, bool, bytes]:
        """The next frame: (more follows, is a command, body)."""
        flags = self._exactly(1)[0]
        if flags & _LONG:
            (size,) = struct.unpack(">Q", self._exactly(8))
        else:
            size = self._exactly(1)[0]
        body = self._exactly(size)
        if flags & _COMMAND and body.startswith(b"\x05ERROR"):  # refused, and why
            raise ConnectionRefusedError(body[7 : 7 + body[6]].decode(errors="replace"))
        return bool(flags & _MORE), bool(flags & _COMMAND), body

    def close(self) -> None:
        self.sock.close()

    def _exactly(self, count: int) -> bytes:
        data = b""
        while len(data) < count:
            chunk = self.sock.recv(count - len(data))
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            data += chunk
        return data
