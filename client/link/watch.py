"""Whether the daemon behind a connection lives: its process, its pongs, and the drop of a
trainer's connection.

A :class:`DaemonWatch` belongs to one link: a connection (``connection.py``), which owns the
socket and sends the pings, or an in-process link (``inproc.py``), which uses its pid and its
``gone`` alone. The watch knows the welcomed daemon's pid, whether this process can see that
pid (the same pid namespace), whether the daemon was found gone (or ended the link's job: no
goodbye is due either way), and it owns the monitor that tells a trainer its connection was
dropped. Each wait for the daemon's messages keeps a :class:`Silence`: how long the daemon has
been silent, and the ping sent meanwhile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from dalid.protocol import Envelope, Error, Pong, Welcome, endpoint, pid_namespace, process_running

from ..errors import DaemonUnavailable
from .advice import Advice

# How long the daemon may stay silent while we wait before we ping it, and how long a ping
# may go unanswered before the daemon counts as gone. Where the daemon's pid means something
# here (same pid namespace), a silent wait also checks every WATCH_EVERY_S that its process
# lives, so a killed daemon is noticed at once; a daemon that lives but does not answer then
# gets the longer PING_TIMEOUT_WATCHED_S, since a busy machine may delay a live daemon's pong,
# and is pinged only after PING_AFTER_WATCHED_S: every trainer and worker waiting for a batch
# pinged each second, which with eight jobs of eight workers was most of what the daemon's
# I/O thread received.
PING_AFTER_S = 1.0
PING_AFTER_WATCHED_S = 5.0
PING_TIMEOUT_S = 5.0
PING_TIMEOUT_WATCHED_S = 30.0
WATCH_EVERY_S = 0.25
# A daemon found exited may have sent a stop notice just before: one last look for it.
NOTICE_GRACE_MS = 200


class DaemonWatch:
    """What one connection to the daemon on ``path`` knows of whether that daemon lives; its
    errors end with ``advice``'s next step. Owns the drop monitor (:meth:`watch_drops`),
    closed by :meth:`close`."""

    def __init__(self, path: Path, advice: Advice) -> None:
        self.path = path
        self.advice = advice
        # The welcomed daemon's pid (0 until welcomed), and whether this process can watch it.
        self.daemon_pid = 0
        self.watched = False
        # Found gone or stopping, or this link's job ended: a goodbye would wait in vain.
        self.gone = False
        self._monitor: zmq.Socket[Any] | None = None

    def watch_drops(self, sock: zmq.Socket[Any]) -> None:
        """Watches ``sock`` for the daemon dropping it. A trainer whose connection the daemon
        dropped (its process was stopped or frozen for a few seconds) has lost
        its job; ZeroMQ connects again unseen, as a stranger the daemon ignores."""
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def welcomed(self, welcome: Welcome) -> None:
        """The daemon's welcome: its pid, watched where this process shares its namespace."""
        self.daemon_pid = welcome.daemon_pid
        namespace = welcome.pid_namespace
        self.watched = namespace != 0 and namespace == pid_namespace()

    @property
    def ping_after(self) -> float:
        """How long the daemon may be silent before it is pinged."""
        return PING_AFTER_WATCHED_S if self.watched else PING_AFTER_S

    @property
    def ping_timeout(self) -> float:
        """How long a ping may go unanswered before the daemon counts as gone."""
        return PING_TIMEOUT_WATCHED_S if self.watched else PING_TIMEOUT_S

    def dropped(self) -> bool:
        """Whether the daemon dropped this (welcomed) connection since the last look."""
        if self._monitor is None or not self.daemon_pid:
            return False
        dropped = False
        with contextlib.suppress(zmq.Again):
            while True:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
                dropped = dropped or event["event"] == zmq.EVENT_DISCONNECTED
        return dropped

    def dropped_error(
        self, answering: Callable[[float], int | None], job_id: int
    ) -> DaemonUnavailable:
        """The error for a connection the daemon dropped: the daemon died or was replaced, or
        it ended job ``job_id`` for a trainer stopped or frozen. ``answering(timeout)``
        pings the socket: the pid of the daemon that answers (None: none did)."""
        if self.watched:
            if not process_running(self.daemon_pid):
                return self.gone_error("its process has exited (was it killed?)")
        else:
            pid = answering(self.ping_timeout)
            if pid is None:
                return self.gone_error(
                    f"no reply to a ping in {self.ping_timeout:.0f} s (was it killed?)"
                )
            if pid != self.daemon_pid:
                return self.gone_error(f"daemon pid {pid} now answers (it was restarted)")
        self.gone = True
        return DaemonUnavailable(
            f"the dalid daemon on {endpoint(self.path)} (pid {self.daemon_pid}) ended job "
            f"{job_id}: it dropped the trainer's connection, as this process was stopped or "
            "frozen for a few seconds (SIGSTOP, a debugger's stop, a paused container?) or "
            f"left the daemon's messages unread. {self.advice.after_dropped()}"
        )

    def gone_error(self, why: str) -> DaemonUnavailable:
        """The error for a daemon found gone, saying ``why`` and what to do. From then on
        ``gone`` is set."""
        self.gone = True
        return DaemonUnavailable(
            f"the dalid daemon on {endpoint(self.path)} (pid {self.daemon_pid}) is gone: {why}. "
            f"{self.advice.after_gone()}"
        )

    def close(self, sock: zmq.Socket[Any] | None, *, owned: bool = True) -> None:
        """Closes the drop monitor, first stopping ``sock``'s events to it. Idempotent.
        ``owned``: False in a forked child, which drops it without touching the sockets."""
        monitor, self._monitor = self._monitor, None
        if not owned or monitor is None:
            return
        if sock is not None:
            sock.disable_monitor()
        monitor.close(linger=0)


class Silence:
    """One wait for the daemon's messages (``Connection.receive_until``): since when the daemon
    has been silent, and the ping sent meanwhile. With ``ping`` False, nothing is looked at."""

    def __init__(self, watch: DaemonWatch, ping: bool, now: float) -> None:
        self._watch = watch
        self._ping = ping
        self._last_heard = self._last_look = now
        self._ping_id: int | None = None

    def quiet(
        self, now: float, send_ping: Callable[[], int], last_words: Callable[[], bool]
    ) -> None:
        """A poll found nothing: looks at the daemon's process (``last_words`` waits briefly
        for a stop notice from one that exited), pings the daemon once it has been silent a
        while (``send_ping`` returns the ping's request id), and raises DaemonUnavailable once
        it counts as gone."""
        if not self._ping:
            return
        watch = self._watch
        if watch.watched and now - self._last_look >= WATCH_EVERY_S:
            self._last_look = now
            if not process_running(watch.daemon_pid):
                if last_words():
                    return  # its last words, a stop notice, may be on their way
                raise watch.gone_error("its process has exited (was it killed?)")
        silent = now - self._last_heard
        if self._ping_id is None and silent > watch.ping_after:
            self._ping_id = send_ping()
        elif silent > watch.ping_after + watch.ping_timeout:
            raise watch.gone_error(
                f"no reply to a ping in {watch.ping_timeout:.0f} s (was it killed?)"
            )

    def heard(self, now: float) -> None:
        """A message came from the daemon."""
        self._last_heard = now

    def answers_ping(self, envelope: Envelope) -> bool:
        """Whether ``envelope`` answers this wait's ping (taken here, then); raises
        DaemonUnavailable when another daemon's pong says the one welcomed was replaced."""
        if self._ping_id is None or envelope.request_id != self._ping_id:
            return False
        pong = envelope.message
        assert isinstance(pong, Pong | Error)
        daemon_pid = self._watch.daemon_pid
        if isinstance(pong, Pong) and daemon_pid and pong.daemon_pid != daemon_pid:
            raise self._watch.gone_error(
                f"daemon pid {pong.daemon_pid} now answers (it was restarted)"
            )
        self._ping_id = None
        return True
