"""What a client's errors tell its user to do: only what applies to the call that failed.

A trainer given a socket (``socket=``, ``$DALID_SOCKET``) is never told to use autostart, which
starts a daemon only on the default socket; a call that had autostart on is not told to turn it
on; a job with ``reconnect=True`` is not told to connect with it. Each link carries the
:class:`Advice` of the call that opened it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Advice:
    """What the call behind a link did: enough to say what its user can do next."""

    # Whether the call starts a daemon when none answers (autostart on the default socket).
    autostarts: bool = False
    # Whether its socket is the device's default one (where autostart would start a daemon).
    default_socket: bool = False
    # Whether its job reconnects to a daemon that comes back on the socket.
    reconnects: bool = False

    def start_one(self, path: Path, device: str | int) -> str:
        """How to get a daemon on ``path`` where none answers."""
        serve = f"start one with `dalid serve --device {device} --socket {path}`"
        if self.autostarts:
            return f"{serve}, or see why the one autostart started did not answer in its log"
        if self.default_socket:
            return f"{serve}, or connect with autostart=True, which starts one there"
        return serve

    def after_gone(self) -> str:
        """What follows from a daemon found gone (killed, crashed, restarted)."""
        if self.reconnects:
            return "This job has reconnect=True and carries on with the daemon on the socket"
        return (
            "`dalid serve` restarts a crashed daemon; connect again, or connect with "
            "reconnect=True to have a job carry on by itself"
        )

    def after_dropped(self) -> str:
        """What follows from a job the daemon ended for a trainer stopped or frozen."""
        if self.reconnects:
            return "This job has reconnect=True and carries on with the daemon on the socket"
        return "connect again, or connect with reconnect=True to have a job carry on by itself"

    def after_stop(self, path: Path, device: str | int) -> str:
        """What follows from a daemon stopped on purpose, which nothing restarts."""
        if self.autostarts:
            return "connecting again starts a new daemon (autostart)"
        return f"{self.start_one(path, device)}, then connect again"


# A link opened by a call that neither autostarts, nor uses the default socket, nor reconnects.
NO_ADVICE = Advice()
