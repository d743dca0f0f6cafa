"""What the daemon's pipelines hold of its DALI threads and of its room for pipelines.

:class:`PipelineBudget` owns the count: each pipeline's threads (all its DALI instances'), what
one instance of it has, and its instances past the first. A new pipeline asks for
:meth:`~PipelineBudget.room`, which refuses one that does not fit; an executor asks for another
instance's threads with :meth:`~PipelineBudget.take` and gives them back with
:meth:`~PipelineBudget.give` (it is the executor's ``InstanceRoom``).
"""

from __future__ import annotations

import enum
import math
import os
import threading
from collections.abc import Iterable

from dalid.protocol import ErrorCode

from ..errors import RequestRefused
from ..jobs.quotas import Full


class Holding(enum.Enum):
    """What of the daemon a limit on pipelines counts."""

    PIPELINES = enum.auto()  # DALI instances: --max-daemon-pipelines
    THREADS = enum.auto()  # DALI threads: --max-threads


class BudgetFull(RequestRefused):
    """A new pipeline that does not fit: ``what`` is full (in words), of the daemon's limits or
    of the uid's share (``full``), counting ``holding``; the message adds what to do."""

    def __init__(self, what: str, to_do: str, full: Full, holding: Holding) -> None:
        super().__init__(ErrorCode.RESOURCE_EXHAUSTED, f"{what}: {to_do}")
        self.what = what
        self.full = full
        self.holding = holding


class PipelineBudget:
    """DALI threads and pipelines of the daemon: ``max_threads`` threads of all pipelines together
    (0: 8 a core, at least 128), at most the cores for one pipeline, and ``max_pipelines`` DALI
    instances at once (0: no limit); of those, one uid's pipelines (those its jobs started) hold
    at most ``user_share`` (0: no per-user limit), so that another uid finds room. Thread-safe:
    the I/O thread adds and forgets pipelines, executors take and give back their instances'
    threads."""

    def __init__(
        self, max_threads: int = 0, max_pipelines: int = 0, user_share: float = 0.0
    ) -> None:
        # Threads past the cores only wait (one registration of 1,024 threads used to exhaust
        # the system's).
        cores = len(os.sched_getaffinity(0))
        self.max_threads = max_threads or max(128, 8 * cores)
        self._thread_share = cores
        self.max_pipelines = max_pipelines
        # What one uid's pipelines may hold (0: no limit; a share of all is none but the
        # daemon's, whose refusal says so).
        share = user_share if user_share < 1 else 0.0
        self.user_threads = math.ceil(self.max_threads * share)
        self.user_pipelines = math.ceil(max_pipelines * share)
        self._lock = threading.Lock()
        # The threads each running pipeline may have, by instance id (all its DALI instances'),
        # what one DALI instance of it has, and its instances past the first.
        self._threads: dict[int, int] = {}
        self._instance_threads: dict[int, int] = {}
        self._more_instances: dict[int, int] = {}
        # The uid whose job started each pipeline (-1: unknown, counted as no one's).
        self._owners: dict[int, int] = {}

    @property
    def threads(self) -> dict[int, int]:
        """The threads each pipeline holds now, by its instance id (a copy)."""
        with self._lock:
            return dict(self._threads)

    def _of_user(self, uid: int) -> tuple[int, int]:
        """The pipelines (instances) and threads that ``uid``'s pipelines hold; under the lock."""
        return self._holdings([i for i, owner in self._owners.items() if owner == uid])

    def _holdings(self, instance_ids: Iterable[int]) -> tuple[int, int]:
        """The DALI instances and threads of pipelines ``instance_ids``; under the lock."""
        ids = list(instance_ids)
        return (
            sum(1 + self._more_instances.get(i, 0) for i in ids),
            sum(self._threads.get(i, 0) for i in ids),
        )

    def room(self, uid: int = -1) -> int:
        """The DALI threads a new pipeline of a job of ``uid`` may have; refuses one that does
        not fit (:class:`BudgetFull`: which limit, for reclaim.py). The uid's share is checked
        before the daemon's limits: ending one of the uid's jobs frees both."""
        with self._lock:
            running = len(self._threads) + sum(self._more_instances.values())
            used = sum(self._threads.values())
            user_running, user_used = self._of_user(uid) if uid >= 0 else (0, 0)
        if uid >= 0 and self.user_pipelines and user_running >= self.user_pipelines:
            raise BudgetFull(
                f"uid {uid} already runs {user_running} pipelines on this daemon, the share of one "
                f"user of its {self.max_pipelines} (dalid serve --max-daemon-pipelines and "
                "--max-jobs-per-user), kept so that other users find room",
                "end a job or pipeline of yours first, or register one another job runs already",
                Full.USER,
                Holding.PIPELINES,
            )
        user_left = self.user_threads - user_used
        if uid >= 0 and self.user_threads and user_left < 1:
            raise BudgetFull(
                f"uid {uid}'s pipelines already have {user_used} DALI threads, the share of one "
                f"user of the daemon's {self.max_threads} (dalid serve --max-threads and "
                "--max-jobs-per-user), kept so that other users find room",
                "end a job or pipeline of yours first",
                Full.USER,
                Holding.THREADS,
            )
        if self.max_pipelines and running >= self.max_pipelines:
            raise BudgetFull(
                f"the daemon runs {running} pipelines, its limit (dalid serve "
                f"--max-daemon-pipelines {self.max_pipelines})",
                "wait for jobs to end, or register a pipeline another job runs already",
                Full.DAEMON,
                Holding.PIPELINES,
            )
        left = self.max_threads - used
        if left < 1:
            raise BudgetFull(
                f"the daemon's pipelines have all its {self.max_threads} DALI threads (dalid "
                "serve --max-threads)",
                "wait for jobs to end",
                Full.DAEMON,
                Holding.THREADS,
            )
        if uid >= 0 and self.user_threads:
            left = min(left, user_left)
        return min(self._thread_share, left)

    def held(self, instance_ids: Iterable[int], holding: Holding, uid: int | None = None) -> int:
        """What pipelines ``instance_ids`` hold of the daemon's pipelines (their DALI
        instances) or of its threads; with ``uid``, of that uid's share (those its jobs
        started)."""
        with self._lock:
            mine = [
                i
                for i in instance_ids
                if i in self._threads and (uid is None or self._owners.get(i) == uid)
            ]
            instances, threads = self._holdings(mine)
        return instances if holding is Holding.PIPELINES else threads

    def add(self, instance_id: int, threads: int, uid: int = -1) -> None:
        """Pipeline ``instance_id`` starts for a job of ``uid``, its first DALI instance with
        ``threads`` (as :meth:`room` gave)."""
        with self._lock:
            self._threads[instance_id] = self._instance_threads[instance_id] = threads
            self._owners[instance_id] = uid

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
            uid = self._owners.get(instance_id, -1)
            if uid >= 0 and (self.user_pipelines or self.user_threads):
                user_running, user_used = self._of_user(uid)
                if self.user_pipelines and user_running >= self.user_pipelines:
                    return 0
                if self.user_threads and self.user_threads - user_used < threads:
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
            self._owners.pop(instance_id, None)
