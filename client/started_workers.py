"""The DataLoader workers a trainer's loaders have started and not stopped, as the daemon is
told them (``LoaderWorkers``): ``dalid status`` shows a job's workers from the moment its
loader's iterator starts them, not only once they connect at their first sample."""

from __future__ import annotations

import itertools
import threading


class StartedWorkers:
    """The workers of each loader iterator that started some, under a key, and the count the
    daemon was last told. A loader starts and stops them from the thread that iterates it, a
    finalizer from any thread: the session tells the daemon from its own thread (:meth:`due`,
    :meth:`told`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._running: dict[int, int] = {}
        self._count = 0
        # (the job told, the count told); None: no job was told anything yet.
        self._told: tuple[str, int] | None = None

    @property
    def count(self) -> int:
        """The workers started and not stopped, every loader together."""
        return self._count

    def start(self, workers: int) -> int:
        """Counts ``workers`` started by one iterator; returns the key that :meth:`stop` takes."""
        with self._lock:
            key = next(self._keys)
            self._running[key] = workers
            self._count += workers
            return key

    def stop(self, key: int) -> None:
        """The workers counted under ``key`` stopped. Idempotent."""
        with self._lock:
            self._count -= self._running.pop(key, 0)

    def due(self, job: str) -> int | None:
        """The count to tell the job ``job`` (its token), or None when it knows it already. A
        job never told anything is not told that no workers run: it shows what it sees."""
        with self._lock:
            count = self._count
            told = self._told
        if told == (job, count) or (count == 0 and (told is None or told[0] != job)):
            return None
        return count

    def told(self, job: str, count: int) -> None:
        """The job ``job`` was told ``count``."""
        with self._lock:
            self._told = (job, count)
