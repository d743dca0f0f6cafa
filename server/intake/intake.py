"""What the daemon takes from each connection, and when it stops: limits per connection.

Every message comes in on one ROUTER socket, from many connections. ZeroMQ holds at most
``RECEIVE_QUEUE`` whole messages per connection that the daemon has not read yet (past that it
stops reading the connection's socket: the sender queues or blocks on its side), and at most
``SEND_QUEUE`` messages per connection that the peer has not taken. The daemon reads in turns
of at most ``TURN_MESSAGES`` messages (or ``TURN_SECONDS``) and sends what is ready between
turns; within a turn ZeroMQ hands it one message per connection in rotation, so a connection
that floods gets one turn in each round, like any other.

:class:`Intake` knows every open connection: the credentials of its process, read from its
socket (:mod:`dalid.server.intake.credentials`), and the requests of it that the daemon refused. A
connection that oversteps a limit is told so (``error`` ``resource_exhausted``, or
``not_welcomed`` for another user, whose message says the daemon closes the connection), its
later messages are dropped unread, and ``CUT_GRACE_S`` later, once the error has left, the
daemon shuts its socket down (ZeroMQ then frees it as if the peer had gone):

- a process of another user than the daemon's (or root): the socket's mode keeps them out, and
  this keeps them out if the mode was widened; and a process the daemon cannot tell, whose
  message came with no credentials (it fails closed). A message's sender is the process
  ZeroMQ names in the message itself, read when it accepted the connection, never the
  descriptor read later, which the peer may have closed or another connection reused;
- a message under an identity (a ZeroMQ routing id, which a peer may choose) that another
  connection or process used first: refused, and the connection it belongs to is untouched;
- a message larger than any the daemon would accept (``max_message_bytes``);
- refused requests faster than a client that reads its answers makes them: a burst of
  ``refusal_burst``, then ``refusals_per_second``.

Three limits cut at once, untold: a connection past ``max_connections`` open at once (it has
asked nothing to answer), one past a process's share of them (``per_process_connections``, so
that a storm of one process's connections leaves room for others'), and a peer that leaves
``SEND_QUEUE`` messages unread (nothing more can reach it).

A line that a storm of connections could repeat is logged a few times a second at most, with a
count of those left out (:mod:`dalid.server.intake.log_damper`).
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

from dalid.protocol import BatchFailed, Error, ErrorCode

from .credentials import PeerCredentials, SocketId, not_served, read_peer, shut_down
from .log_damper import DampedLog

log = logging.getLogger("dalid.server")

RECEIVE_QUEUE = 1
SEND_QUEUE = 128
TURN_MESSAGES = 64
TURN_SECONDS = 0.01
CUT_GRACE_S = 0.2
# Refusals logged per connection; the line that cuts it counts the rest.
LOGGED_REFUSALS = 5
# Identities of connections closed lately: a message of one that ZeroMQ still hands over
# afterwards is dropped, not taken for a new connection's.
CLOSED_REMEMBERED = 1024
# Descriptors kept for everything but connections: pipelines, shared memory, logs.
OTHER_DESCRIPTORS = 512
# Descriptors a connection may hold: its socket, and a pidfd of its process while it is a job's
# peer (the registry watches each peer's process through one, server/jobs/jobs.py).
DESCRIPTORS_PER_CONNECTION = 2


@dataclass(frozen=True)
class IntakeLimits:
    """What one connection may do; see the module's docstring."""

    max_connections: int = 2048
    max_message_bytes: int = 1 << 30
    refusal_burst: int = 100
    refusals_per_second: float = 20.0


def per_process_connections(max_connections: int) -> int:
    """The connections one process may hold open: an eighth of ``max_connections``, at least
    ``MIN_PER_PROCESS`` (a trainer holds one per session, each worker one of its own)."""
    return max(MIN_PER_PROCESS, max_connections // 8)


# The fewest connections one process may always hold.
MIN_PER_PROCESS = 64


class Verdict(enum.Enum):
    PROCESS = "process"
    DROP = "drop"


@dataclass
class Connection:
    fd: int
    socket: SocketId | None = None
    credentials: PeerCredentials | None = None
    identity: bytes | None = None
    tokens: float = 0.0
    refilled: float = 0.0
    refusals: int = 0
    # Set once the connection is told it is cut: when its socket is shut down.
    cut_at: float | None = None

    def sent_by(self, fd: int | None, sender: PeerCredentials | None) -> bool:
        """Whether a message received on ``fd`` from ``sender`` came on this connection."""
        same_descriptor = fd is None or self.fd < 0 or fd == self.fd
        return sender is not None and sender == self.credentials and same_descriptor

    def describe(self) -> str:
        creds = self.credentials
        if creds is None:
            return f"connection {self.fd}"
        return f"connection {self.fd} (pid {creds.pid}, uid {creds.uid})"


class Intake:
    """The open connections and their limits; used by the daemon's I/O thread alone."""

    def __init__(
        self,
        limits: IntakeLimits,
        uids: frozenset[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        # The users whose processes it serves: the daemon's own, and root.
        self._uids = frozenset({os.getuid(), 0}) if uids is None else uids
        self._clock = clock
        self._by_fd: dict[int, Connection] = {}
        # Open connections by the pid of their process (those it can see), and the most of one.
        self._of_process: collections.Counter[int] = collections.Counter()
        self._per_process = per_process_connections(limits.max_connections)
        self._by_identity: dict[bytes, Connection] = {}
        # Connections told they are cut, whose sockets are still to be shut down (by id).
        self._cutting: dict[int, Connection] = {}
        self._closed: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        # Cut connections gone so far: shut down here, or closed by their peer while told.
        self.cuts = 0
        # Messages refused for an identity that another connection had used first.
        self.impostors = 0
        # The lines of cut connections, at most a few a second each (a storm of connections
        # would write thousands): those cut at once over the limit, and the others.
        self.cut_at_once_log = DampedLog(log, clock=clock)
        self.cut_log = DampedLog(log, clock=clock)

    @property
    def open_connections(self) -> int:
        return len(self._by_fd)

    def credentials(self, identity: bytes) -> PeerCredentials | None:
        connection = self._by_identity.get(identity)
        return connection.credentials if connection is not None else None

    # --- connection events ----------------------------------------------------------------------

    def accepted(self, fd: int) -> bytes | None:
        """A new connection on descriptor ``fd``; the identity of one that it replaces, which
        closed unreported (treat it as disconnected), else None."""
        replaced = self.closed(fd)
        connection = self._new(fd)
        self._read_credentials(connection)
        self._hold(fd, connection)
        pid = connection.credentials.pid if connection.credentials is not None else 0
        if self._stranger(connection):
            # Cut once its first message, if one comes at once, has been answered.
            self._cut(connection, self._stranger_notice(connection))
        elif len(self._by_fd) > self.limits.max_connections:
            self.cut_at_once_log.warning(
                "%s cut at once: %d connections are open, the daemon's limit "
                "(dalid serve --max-connections %d)",
                connection.describe(),
                len(self._by_fd),
                self.limits.max_connections,
            )
            self._shut_down(connection)
        elif pid > 0 and self._of_process[pid] > self._per_process:
            self.cut_at_once_log.warning(
                "%s cut at once: process %d holds %d connections, the most of one process "
                "(an eighth of dalid serve --max-connections %d, at least %d): it opens "
                "connections it does not close",
                connection.describe(),
                pid,
                self._of_process[pid],
                self.limits.max_connections,
                MIN_PER_PROCESS,
            )
            self._shut_down(connection)
        return replaced

    def _hold(self, fd: int, connection: Connection) -> None:
        """``connection`` is the one open on ``fd`` (one there before, closed unreported, is
        no longer counted)."""
        self._release(self._by_fd.get(fd))
        self._by_fd[fd] = connection
        self._count(connection)

    def _count(self, connection: Connection) -> None:
        creds = connection.credentials
        if creds is not None and creds.pid > 0:
            self._of_process[creds.pid] += 1

    def _release(self, connection: Connection | None) -> None:
        creds = connection.credentials if connection is not None else None
        if creds is not None and creds.pid > 0:
            self._of_process[creds.pid] -= 1
            if self._of_process[creds.pid] <= 0:
                del self._of_process[creds.pid]

    def closed(self, fd: int) -> bytes | None:
        """The connection on ``fd`` closed; the identity that sent on it, if any did."""
        connection = self._by_fd.pop(fd, None)
        if connection is None:
            return None
        self._release(connection)
        if self._cutting.pop(id(connection), None) is not None:
            self.cuts += 1
        identity = connection.identity
        if identity is None:
            return None
        self._by_identity.pop(identity, None)
        self._closed[identity] = None
        if len(self._closed) > CLOSED_REMEMBERED:
            self._closed.popitem(last=False)
        return identity

    # --- messages -------------------------------------------------------------------------------

    def knows(self, identity: bytes) -> bool:
        """Whether ``identity`` has sent before (on a connection open or closed)."""
        return identity in self._by_identity or identity in self._closed

    def admit(
        self, identity: bytes, fd: int | None, nbytes: int, sender: PeerCredentials | None
    ) -> Verdict | Error:
        """Whether to handle a message of ``nbytes`` from ``identity``, received on ``fd`` from
        the process ``sender`` (the credentials ZeroMQ attached to the message): yes, drop it
        unread, or send this error.

        It fails closed. A message whose sender is unknown or of another user is refused and
        its connection cut, whatever it asks; and an identity is bound to the connection and
        the process it first came from, so a message under it from any other is refused.
        """
        if identity in self._closed:
            return Verdict.DROP
        connection = self._by_identity.get(identity)
        if connection is None:
            connection = self._first_message(identity, fd, sender)
            refusal = self._unwelcome(connection)
            if refusal is not None:
                if connection.cut_at is None:
                    self._cut(connection, refusal)
                return refusal
        elif connection.cut_at is not None:
            return Verdict.DROP
        elif not connection.sent_by(fd, sender):
            return self._impostor(connection, fd, sender)
        if nbytes > self.limits.max_message_bytes:
            return self._cut(
                connection,
                Error(
                    ErrorCode.RESOURCE_EXHAUSTED,
                    f"a message of {nbytes} bytes is over this daemon's limit of "
                    f"{self.limits.max_message_bytes} (half its --input-memory): send smaller "
                    "batches; the daemon closes this connection",
                ),
            )
        return Verdict.PROCESS

    def refused(self, identity: bytes, error: Error | BatchFailed) -> Error | None:
        """Counts a refused request of ``identity``: the error that cuts the connection, when
        it has had more refusals than its limits allow, else None."""
        connection = self._by_identity.get(identity)
        if connection is None or connection.cut_at is not None:
            return None
        connection.refusals += 1
        now = self._clock()
        limits = self.limits
        connection.tokens = min(
            limits.refusal_burst,
            connection.tokens + (now - connection.refilled) * limits.refusals_per_second,
        )
        connection.refilled = now
        connection.tokens -= 1
        if connection.tokens >= 0:
            return None
        last = f"{error.code}: {error.message}"
        return self._cut(
            connection,
            Error(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"{connection.refusals} requests on this connection were refused, more than "
                f"{limits.refusal_burst} at once or {limits.refusals_per_second:g} a second "
                f"(the last: {last[:300]}): read the daemon's answers and wait for them before "
                "sending more; the daemon closes this connection",
            ),
        )

    def log_refusal(self, identity: bytes) -> bool:
        """Whether a refusal of ``identity`` goes to the log (the first few of each connection)."""
        connection = self._by_identity.get(identity)
        return connection is None or connection.refusals < LOGGED_REFUSALS

    def unreachable(self, identity: bytes) -> None:
        """``identity`` left ``SEND_QUEUE`` messages unread: cut at once."""
        dropped = self.drop(identity)
        if dropped is not None:
            self.cut_log.warning(
                "%s cut: it left %d messages of the daemon unread", dropped, SEND_QUEUE
            )

    def drop(self, identity: bytes) -> str | None:
        """Shuts ``identity``'s connection down at once, untold (its process reads nothing: it
        left its answers unread, or is stopped or frozen, :mod:`.frozen`); ZeroMQ then reports
        it closed. The connection as the log names it, or None: it was not open."""
        connection = self._by_identity.get(identity)
        if connection is None or connection.fd < 0:
            return None
        described = connection.describe()
        connection.cut_at = self._clock()
        self._shut_down(connection)
        return described

    # --- cutting --------------------------------------------------------------------------------

    def next_cut(self) -> float | None:
        """Seconds until the next connection told it is cut is due to be (None: none is)."""
        if not self._cutting:
            return None  # the loop asks at every wake; almost always, none is
        due = [c.cut_at for c in self._cutting.values() if c.cut_at is not None]
        return max(0.0, min(due) - self._clock()) if due else None

    def cut_due(self) -> None:
        """Shuts down the connections whose grace has passed (and tells the log how many cut
        lines it left out, once a storm is over)."""
        self.cut_at_once_log.flush()
        self.cut_log.flush()
        if not self._cutting:
            return
        now = self._clock()
        for key, connection in list(self._cutting.items()):
            if connection.cut_at is not None and connection.cut_at <= now:
                del self._cutting[key]
                self._shut_down(connection)

    def _cut(self, connection: Connection, notice: Error) -> Error:
        self.cut_log.warning("%s cut: %s", connection.describe(), notice.message)
        connection.cut_at = self._clock() + CUT_GRACE_S
        self._cutting[id(connection)] = connection
        return notice

    def _stranger(self, connection: Connection) -> bool:
        """Whether a process of another user is behind ``connection``."""
        creds = connection.credentials
        return creds is not None and creds.uid not in self._uids

    def _unwelcome(self, connection: Connection) -> Error | None:
        """Why the sender of ``connection``'s first message is not served, or None."""
        if connection.credentials is None:
            return Error(
                ErrorCode.NOT_WELCOMED,
                "the daemon cannot tell which process sent this message (its connection has "
                "no credentials it can read), and serves no one it cannot tell; it closes this "
                "connection",
            )
        return self._stranger_notice(connection) if self._stranger(connection) else None

    def _stranger_notice(self, connection: Connection) -> Error:
        assert connection.credentials is not None
        return Error(
            ErrorCode.NOT_WELCOMED,
            f"{not_served(self._uids, connection.credentials.uid)}, and the daemon closes this "
            "connection",
        )

    def _impostor(
        self, connection: Connection, fd: int | None, sender: PeerCredentials | None
    ) -> Error:
        """A message under the identity of ``connection`` from another connection or process
        (a peer that chose the identity, ``zmq.ROUTING_ID``): refused, and nothing of the
        connection the identity belongs to is touched."""
        self.impostors += 1
        if self.impostors <= LOGGED_REFUSALS:
            who = "unknown" if sender is None else f"pid {sender.pid}, uid {sender.uid}"
            log.warning(
                "a message from connection %s (%s) under the identity of %s: refused",
                fd,
                who,
                connection.describe(),
            )
        return Error(
            ErrorCode.NOT_WELCOMED,
            "this connection's routing id is another connection's: the daemon serves a "
            "routing id on the connection it first came on only (leave zmq.ROUTING_ID unset)",
        )

    def _shut_down(self, connection: Connection) -> None:
        if connection.socket is not None and connection.fd >= 0:
            self.cuts += shut_down(connection.fd, connection.socket)
        # Done with its descriptor: ZeroMQ may reuse the number once it sees the close.
        connection.fd = -1

    def _first_message(
        self, identity: bytes, fd: int | None, sender: PeerCredentials | None
    ) -> Connection:
        """The connection ``identity`` is bound to from now on: the one on ``fd`` if its
        socket's credentials are the message's, else one with no descriptor to shut down."""
        connection = self._by_fd.get(fd) if fd is not None else None
        if connection is None or connection.identity is not None:
            # No event for it (or its descriptor's earlier connection closed unreported).
            connection = self._new(fd if fd is not None else -1)
            self._read_credentials(connection)
            if connection.fd >= 0 and connection.credentials == sender:
                self._hold(connection.fd, connection)
        elif connection.credentials is None:
            self._read_credentials(connection)
            self._count(connection)
        if connection.credentials != sender:
            # The descriptor names another process's connection now (the sender's closed and
            # its number was taken again): that one is not the sender's to have cut.
            connection = self._new(-1)
        connection.credentials = sender
        connection.identity = identity
        self._by_identity[identity] = connection
        return connection

    def _new(self, fd: int) -> Connection:
        return Connection(fd, tokens=self.limits.refusal_burst, refilled=self._clock())

    @staticmethod
    def _read_credentials(connection: Connection) -> None:
        if connection.fd < 0:
            return
        peer = read_peer(connection.fd)
        if peer is not None:
            connection.socket, connection.credentials = peer


def reserve_descriptors(max_connections: int) -> int:
    """Raises this process's limit on open descriptors (within the hard limit) to hold
    ``max_connections`` connections and the daemon's other files; the connections it can
    hold."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections * DESCRIPTORS_PER_CONNECTION + OTHER_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (OSError, ValueError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return max_connections
    held = max(1, (soft - OTHER_DESCRIPTORS) // DESCRIPTORS_PER_CONNECTION)
    log.warning(
        "the limit on open files (%d) holds %d connections, not --max-connections %d: raise "
        "it (ulimit -n) for more",
        soft,
        held,
        max_connections,
    )
    return held
