"""What the daemon's pipelines hold of its DALI threads and of its room for pipelines.

:class:`PipelineBudget` owns the count: each pipeline's threads (all its DALI instances'), what
one instance of it has, and its instances past the first. A new pipeline asks for
:meth:`~PipelineBudget.room`, which refuses one that does not fit; an executor asks for another
instance's threads with :meth:`~PipelineBudget.take` and gives them back with
:meth:`~PipelineBudget.give` (it is the executor's ``InstanceRoom``).
"""

from __future__ import annotations

import os
import threading

from dalid.protocol import ErrorCode

from ..errors import RequestRefused


class PipelineBudget:
    """DALI threads and pipelines of the daemon: ``max_threads`` threads of all pipelines together
    (0: 8 a core, at least 128), at most the cores for one pipeline, and ``max_pipelines`` DALI
    instances at once (0: no limit). Thread-safe: the I/O thread adds and forgets pipelines,
    executors take and give back their instances' threads."""

    def __init__(self, max_threads: int = 0, max_pipelines: int = 0) -> None:
        # Threads past the cores only wait (one registration of 1,024 threads used to exhaust
        # the system's).
        cores = len(os.sched_getaffinity(0))
        self.max_threads = max_threads or max(128, 8 * cores)
        self._thread_share = cores
        self.max_pipelines = max_pipelines
        self._lock = threading.Lock()
        # The threads each running pipeline may have, by instance id (all its DALI instances'),
        # what one DALI instance of it has, and its instances past the first.
        self._threads: dict[int, int] = {}
        self._instance_threads: dict[int, int] = {}
        self._more_instances: dict[int, int] = {}

    @property
    def threads(self) -> dict[int, int]:
        """The threads each pipeline holds now, by its instance id (a copy)."""
        with self._lock:
            return dict(self._threads)

    def room(self) -> int:
        """The DALI threads a new pipeline may have; refuses one that does not fit."""
        with self._lock:
            running = len(self._threads) + sum(self._more_instances.values())
            used = sum(self._threads.values())
        if self.max_pipelines and running >= self.max_pipelines:
            raise RequestRefused(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"the daemon runs {running} pipelines, its limit (dalid serve "
                f"--max-daemon-pipelines {self.max_pipelines}): wait for jobs to end, or "
                "register a pipeline another job runs already",
            )
        left = self.max_threads - used
        if left < 1:
            raise RequestRefused(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"the daemon's pipelines have all its {self.max_threads} DALI threads (dalid "
                "serve --max-threads): wait for jobs to end",
            )
        return min(self._thread_share, left)

    def add(self, instance_id: int, threads: int) -> None:
        """Pipeline ``instance_id`` starts, its first DALI instance with ``threads`` (as
        :meth:`room` gave)."""
        with self._lock:
            self._threads[instance_id] = self._instance_threads[instance_id] = threads

    def take(self, instance_id: int) -> int:
        """The threads another DALI instance of pipeline ``instance_id`` gets (as many as its
        first), or 0 where it does not fit in the daemon's pipelines and threads."""
        with self._lock:
            threads = self._instance_threads.get(instance_id, 0)
            running = len(self._threads) + sum(self._more_instances.values())
            if not threads or (self.max_pipelines and running >= self.max_pipelines):
                return 0
            if self.max_threads - sum(self._threads.values()) < threads:
                return 0
            self._threads[instance_id] += threads
            self._more_instances[instance_id] = self._more_instances.get(instance_id, 0) + 1
            return threads

    def give(self, instance_id: int, threads: int) -> None:
        """An instance past the first of pipeline ``instance_id`` ended: its threads go back."""
        with self._lock:
            if instance_id in self._threads:
                self._threads[instance_id] -= threads
            if self._more_instances.get(instance_id):
                self._more_instances[instance_id] -= 1

    def forget(self, instance_id: int) -> None:
        """Pipeline ``instance_id`` ended: everything it held goes back."""
        with self._lock:
            self._threads.pop(instance_id, None)
            self._instance_threads.pop(instance_id, None)
            self._more_instances.pop(instance_id, None)
