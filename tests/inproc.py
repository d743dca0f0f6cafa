"""A daemon core served inside the test process, for unit tests of the client's logic.

The one place that builds a :class:`dalid.server.handling.core.DaemonCore` for the client's tests
(how a core is made is the server's business): :class:`ServedCore` serves one on a socket path
through :class:`dalid.client.link.inproc.InprocDaemon`, so that a session, its proxies and their
workers in this process (``num_workers=0``) reach it by in-process links, and ``restart()``
replaces it with a new core, as a daemon restart does. Nothing listens on the path itself.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

from dalid.client.link.inproc import InprocDaemon
from dalid.protocol import JobStatus, Message, Welcome
from dalid.server.handling.core import DaemonCore
from dalid.server.jobs.quotas import Quotas
from dalid.server.outputs.shm import host_outputs


class ServedCore:
    """A CPU daemon core served in this process on ``path``. Use as a context manager.

    ``received`` lists the messages it was sent, in order. ``older_welcome``: its welcome
    leaves out what a daemon of an earlier release did not say (``want_in_release``,
    ``progress_in_release``), so that
    its clients speak to it as to that daemon; the core itself is this release's."""

    def __init__(
        self,
        path: Path,
        *,
        pool_bytes: int = 8 << 20,
        slab_bytes: int = 1 << 20,
        older_welcome: bool = False,
        max_jobs: int = 64,
        reclaim_idle_s: float = 300.0,
    ) -> None:
        self.path = path
        self._quotas = Quotas(
            max_batch_size=64,
            pool_bytes=pool_bytes,
            slab_bytes=slab_bytes,
            max_jobs=max_jobs,
            reclaim_idle_s=reclaim_idle_s,
        )
        self._older_welcome = older_welcome
        self.received: list[Message] = []
        self.restarts = 0
        self.core, self._served = self._start()

    def _start(self) -> tuple[DaemonCore, InprocDaemon]:
        served = InprocDaemon(self.path)
        core = DaemonCore(
            "cpu",
            host_outputs(),
            served.push,
            self._quotas,
            # Not this process's pid: the leak check counts its segments as nobody's.
            instance=f"inproc-{uuid.uuid4().hex[:8]}",
            concurrency=2,
        )

        def handle(identity: bytes, message: Message, request_id: int | None) -> Message | None:
            self.received.append(message)
            reply = core.handle(identity, message, request_id)
            if self._older_welcome and isinstance(reply, Welcome):
                reply = dataclasses.replace(reply, want_in_release=False, progress_in_release=False)
            return reply

        served.serve(handle, core.peer_disconnected)
        return core, served

    def stop(self) -> None:
        """Stops the daemon as if it died: its links find it gone. Idempotent."""
        self._served.close()
        self.core.close()

    def start(self) -> None:
        """A new daemon on the same path, knowing nothing of the last one."""
        self.core, self._served = self._start()

    def restart(self) -> None:
        self.stop()
        self.start()
        self.restarts += 1

    def job(self, job_id: int) -> JobStatus:
        """The daemon's view of one of its jobs, as ``dalid status`` shows it."""
        (job,) = [job for job in self.core.status().jobs if job.job_id == job_id]
        return job

    def __enter__(self) -> ServedCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
