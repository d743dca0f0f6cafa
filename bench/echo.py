"""Echo servers for the transport floors: ``python -m bench.echo zmq ADDRESS`` or ``socket FD``.

They answer every message with itself, in a process of their own, so that the transport probes
can show what one cross-process round trip costs on the machine before dalid adds anything.
Kept apart from :mod:`bench.transport` so that they start without DALI or torch.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence

import zmq

STOP = b"stop"


def zmq_echo(address: str) -> None:
    """A ROUTER bound to ``address``, polled like the daemon's, echoing until ``STOP``."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.bind(address)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    try:
        while True:
            if not poller.poll(500):
                continue
            frames = sock.recv_multipart()
            if frames[1] == STOP:
                return
            sock.send_multipart(frames)
    finally:
        sock.close(linger=0)
        context.term()


def socket_echo(fd: int) -> None:
    """Echoes on an inherited Unix socket until ``STOP`` or end of file."""
    with socket.socket(fileno=fd) as sock:
        while True:
            data = sock.recv(64)
            if not data or data == STOP:
                return
            sock.sendall(data)


def main(argv: Sequence[str]) -> int:
    kind, where = argv
    if kind == "zmq":
        zmq_echo(where)
    else:
        socket_echo(int(where))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
