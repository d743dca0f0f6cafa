"""A client's link to a daemon: the interface the session and the workers use, and ``dial``.

Two implementations: :class:`~dalid.client.link.connection.Connection`, a ZeroMQ DEALER socket to a
daemon process, and :class:`~dalid.client.link.inproc.InprocLink`, which hands the same encoded
messages to a daemon core in this process (tests drive the session's logic through it without
sockets). ``dial`` picks the in-process one where a daemon is served in this process on the
path, the socket otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from dalid.protocol import Envelope, Message, Role, Welcome

from ..errors import DaemonUnavailable
from .connection import Connection
from .inproc import InprocLink, served_at


class Link(Protocol):
    """A connection that the daemon on ``path`` has welcomed, used by the process that opened
    it. Requests get their reply or raise (a :class:`~dalid.client.errors.DalidError`); every
    other message that arrives goes to the ``on_push`` callback it was opened with."""

    path: Path
    welcome: Welcome

    @property
    def closed(self) -> bool: ...

    def request(self, message: Message, timeout: float | None = None) -> Message:
        """Sends a request and returns its reply; an error reply is raised."""
        ...

    def send(self, message: Message) -> int:
        """Sends a request without waiting for its reply; returns its request id."""
        ...

    def reply(self, request_id: int, op: str, timeout: float | None = None) -> Message:
        """The reply to the request ``op`` that :meth:`send` sent as ``request_id``; an error
        reply is raised. Messages received meanwhile go to ``on_push``."""
        ...

    def notify(self, message: Message) -> None:
        """Sends a message that gets no reply."""
        ...

    def receive_until(
        self,
        done: Callable[[Envelope], bool],
        timeout: float | None,
        *,
        idle: Callable[[], None] | None = None,
    ) -> Envelope | None:
        """Receives until a message satisfies ``done`` (returned) or ``timeout`` passes (None),
        running ``idle`` after each wait that found nothing. Raises DaemonUnavailable when the
        daemon is gone."""
        ...

    def close(self, goodbye: bool = True, kept_slabs: tuple[str, ...] = ()) -> None:
        """Says goodbye (``kept_slabs``: see ``Goodbye``) and closes. Idempotent."""
        ...

    def abort(self) -> None:
        """Closes now, without a goodbye. Idempotent."""
        ...

    def gone_error(self, why: str) -> DaemonUnavailable:
        """The error for a daemon found gone, saying ``why``; no goodbye is waited for then."""
        ...


def dial(path: Path, role: Role, **hello: Any) -> Link:
    """A link to the daemon on ``path``, welcomed in ``role``; ``hello``: the options the hello
    carries (see :class:`~dalid.client.link.connection.Connection`)."""
    daemon = served_at(path)
    if daemon is not None:
        return InprocLink(daemon, path, role, **hello)
    return Connection(path, role, **hello)


def answering(path: Path) -> bool:
    """Whether a daemon may answer on ``path``: one is served in this process there, or its
    socket file exists."""
    return served_at(path) is not None or path.exists()
