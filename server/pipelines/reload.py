"""The daemon's pipeline repository as it is now, and loading it again (``dalid reload``,
SIGHUP) while batches go on."""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable

from dalid.protocol import (
    Error,
    ErrorCode,
    Message,
    ReloadRepository,
    RepositoryFailure,
    RepositoryReport,
)

from .repository import PipelineRepository, RepositoryUnavailable

log = logging.getLogger("dalid.server")

# A failure's message in a repository report is cut to this many characters (the daemon's log
# has the whole traceback).
MAX_FAILURE_MESSAGE = 1000


class LiveRepository:
    """Holds the repository that registrations read; a reload replaces it whole.

    A registration reads ``current`` once, at its arrival, and builds from the definition it
    found, so a reload never changes a pipeline being built.
    """

    def __init__(self, repository: PipelineRepository | None = None) -> None:
        self.current = repository or PipelineRepository()
        # One reload at a time, each reading the directory as it is when it starts.
        self._lock = threading.Lock()

    def reload(self, answer: Callable[[Message], None] | None = None) -> None:
        """Loads the repository again, in a thread of its own: importing user files may take
        seconds. ``answer`` gets the :class:`RepositoryReport`, or an ``Error`` when nothing
        could be loaded."""

        def reload() -> None:
            with self._lock:
                reply = self._reload()
            if answer is not None:
                answer(reply)

        threading.Thread(target=reload, name="dalid-reload", daemon=True).start()

    def _reload(self) -> Message:
        previous = self.current
        try:
            repository = previous.reload()
        except RepositoryUnavailable as error:
            log.error("pipeline repository not reloaded: %s", error)
            return Error(ErrorCode.UNKNOWN_PIPELINE, str(error), op=ReloadRepository.OP)
        except Exception as error:
            log.exception("pipeline repository not reloaded")
            return Error(
                ErrorCode.INTERNAL_ERROR,
                f"the pipeline repository was not reloaded: {type(error).__name__}: {error}",
                traceback=traceback.format_exc(),
                op=ReloadRepository.OP,
            )
        self.current = repository
        failed = "; ".join(f"{file}: {why}" for file, why in sorted(repository.failures.items()))
        log.info(
            "pipeline repository %s reloaded: %s. Pipelines: %s%s",
            repository.directory,
            repository.changes_from(previous),
            ", ".join(sorted(repository.entries)) or "none",
            f". Failed: {failed}" if failed else "",
        )
        return repository_report(repository)


def repository_report(repository: PipelineRepository) -> RepositoryReport:
    """What the repository serves and which of its files failed, as ``dalid reload`` shows."""
    return RepositoryReport(
        directory=str(repository.directory or ""),
        pipelines=tuple(sorted(repository.entries)),
        failures=tuple(
            RepositoryFailure(
                file,
                why if len(why) <= MAX_FAILURE_MESSAGE else why[: MAX_FAILURE_MESSAGE - 3] + "...",
                kept_pipelines=repository.kept.get(file, ()),
            )
            for file, why in sorted(repository.failures.items())
        ),
    )
