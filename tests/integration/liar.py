"""A trainer that lies about its pid, and whose connection outlives it.

    python -m tests.integration.liar --socket PATH --claim PID

Connects by hand (tests/integration/zmtp.py), says hello as a trainer with ``client_pid`` PID
and prints ``job N``. Then it forks a child that keeps the connection open and alive (a ping
every 0.3 s, the pongs read and dropped), prints ``child PID`` and sleeps. Killed with SIGKILL,
it leaves its job a connection that lives on in the child: only its real pid tells the daemon
that the trainer is gone.
"""

from __future__ import annotations

import argparse
import os
import time

from dalid.protocol import PROTOCOL_VERSION, Hello, Ping, Role, Welcome, decode, encode

from .zmtp import RawPeer


def keep_alive(peer: RawPeer) -> None:
    ping = [bytes(frame) for frame in encode(Ping(), None)]
    peer.sock.setblocking(False)
    while True:
        peer.send(ping)
        try:
            while peer.sock.recv(65536):
                pass
        except BlockingIOError:
            pass
        time.sleep(0.3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--claim", type=int, required=True)
    args = parser.parse_args()
    peer = RawPeer(args.socket)
    hello = Hello(PROTOCOL_VERSION, args.claim, Role.TRAINER, name="liar")
    peer.send([bytes(frame) for frame in encode(hello, 1)])
    welcome = decode(peer.receive()).message
    assert isinstance(welcome, Welcome), welcome
    print(f"job {welcome.job_id}", flush=True)
    child = os.fork()
    if child == 0:
        try:
            keep_alive(peer)
        finally:
            os._exit(0)
    print(f"child {child}", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
