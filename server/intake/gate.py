"""The daemon's gate: ZeroMQ asks it about every connection before the connection is attached.

ZeroMQ's authentication protocol (ZAP, RFC 27) hands each new connection's handshake to a
handler on ``inproc://zeromq.zap.01``, with the peer's address; for a Unix socket that address
ends in the credentials the kernel gave for it (``<address>:<uid>:<gid>:<pid>``, the same as
:func:`dalid.server.intake.credentials.parse_peer_address` reads). The gate answers 200 for a
process of a user the daemon serves and 400 for anyone else, and for a connection whose credentials
it cannot read (it fails closed). ZeroMQ then ends a refused handshake with a ZMTP ERROR command
carrying the gate's reason, and closes the connection: nothing the peer sends reaches the
daemon, however it times its messages or its close, and no queue of its exists for libzmq to
mishandle (see Note [A routing id claimed twice] in ``reception.py``).

The intake (:mod:`.intake`) checks every message's sender again, as defence in depth.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from .credentials import not_served, parse_peer_address

log = logging.getLogger("dalid.server")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = b"dalid"
# Refusals logged; the count goes on.
LOGGED_REFUSALS = 5
_POLL_MS = 200


class Gate:
    """Answers ZeroMQ's questions about new connections, in a thread of its own, until closed.

    Must be opened in the daemon socket's ``context`` before that socket binds with
    ``zmq.ZAP_DOMAIN`` = :data:`DOMAIN`.
    """

    def __init__(self, context: zmq.Context[Any], uids: frozenset[int]) -> None:
        self._uids = uids
        self.refused = 0
        self._stop = threading.Event()
        self._socket: zmq.Socket[Any] | None = context.socket(zmq.REP)
        try:
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.bind(ZAP_ENDPOINT)
        except BaseException:
            self._socket.close(linger=0)
            raise
        # The thread owns the socket from here, and closes it when it stops.
        self._thread = threading.Thread(target=self._serve, name="dalid-gate", daemon=True)
        self._thread.start()

    def verdict(self, address: str) -> tuple[bytes, str]:
        """The ZAP status code and text for a peer at ``address``."""
        peer = parse_peer_address(address)
        if peer is None:
            return b"400", (
                "the daemon cannot tell which process this connection is (no credentials), and "
                "serves no one it cannot tell"
            )
        if peer.uid not in self._uids:
            return b"400", not_served(self._uids, peer.uid)
        return b"200", "OK"

    def _serve(self) -> None:
        sock = self._socket
        assert sock is not None
        try:
            while not self._stop.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                request = sock.recv_multipart()
                # version, request id, domain, address, identity, mechanism, credentials...
                if len(request) < 6:
                    sock.send_multipart([b"1.0", b"", b"500", b"malformed", b"", b""])
                    continue
                address = request[3].decode("utf-8", "replace")
                try:
                    code, text = self.verdict(address)
                except Exception as error:  # never leave ZeroMQ without an answer
                    code, text = b"500", f"the gate failed: {error}"
                if code != b"200":
                    self.refused += 1
                    if self.refused <= LOGGED_REFUSALS:
                        log.warning("connection of %s refused: %s", address, text)
                sock.send_multipart([request[0], request[1], code, text.encode(), b"", b""])
        except zmq.ZMQError as error:
            if not self._stop.is_set():
                log.error("the connection gate stopped: %s", error)
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        """Stops the thread (which closes the socket). Idempotent; before the context ends."""
        if self._socket is None:
            return
        self._stop.set()
        self._thread.join()
        self._socket = None
