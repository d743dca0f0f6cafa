"""The pipeline repository: ``@pipeline_def`` functions the daemon loads from a directory.

``dalid serve --pipelines DIR`` imports every ``*.py`` file of DIR (not its subdirectories) at
start. Each module-level function decorated with ``@pipeline_def`` whose name does not start
with ``_`` becomes a pipeline that clients select by that name, with the build arguments and
parameters they choose. Pipelines that cannot be serialized (Python operators, say) run this
way. A file that fails to import is logged and kept as a failure: the daemon runs on, and a
client that asks for an unknown name is told which names exist and which files failed.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("dalid.server")

_MODULE_PREFIX = "dalid_pipelines_"


@dataclass(frozen=True)
class RepositoryEntry:
    name: str
    function: Callable[..., Any]
    path: Path


@dataclass
class PipelineRepository:
    """The pipelines of one directory, and the files that could not be loaded (with why)."""

    directory: Path | None = None
    entries: dict[str, RepositoryEntry] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, directory: Path) -> PipelineRepository:
        repository = cls(directory)
        for path in sorted(directory.glob("*.py")):
            try:
                functions = _pipeline_functions(_import(path))
            except BaseException as error:  # a SystemExit or KeyboardInterrupt in user code too
                if isinstance(error, KeyboardInterrupt):
                    raise
                summary = f"{type(error).__name__}: {error}"
                repository.failures[path.name] = summary
                log.error(
                    "pipeline repository: %s could not be loaded: %s\n%s",
                    path,
                    summary,
                    traceback.format_exc(),
                )
                continue
            for name, function in functions.items():
                existing = repository.entries.get(name)
                if existing is not None:
                    repository.failures[path.name] = (
                        f"pipeline {name!r} is also defined in {existing.path.name}; the one "
                        f"of {existing.path.name} is kept"
                    )
                    log.error("pipeline repository: %s", repository.failures[path.name])
                    continue
                repository.entries[name] = RepositoryEntry(name, function, path)
        log.info(
            "pipeline repository %s: %s",
            directory,
            ", ".join(sorted(repository.entries)) or "no pipelines",
        )
        return repository

    def get(self, name: str) -> RepositoryEntry:
        """The entry for ``name``; a KeyError whose message says what there is instead."""
        entry = self.entries.get(name)
        if entry is not None:
            return entry
        if self.directory is None:
            raise KeyError(
                f"no pipeline named {name!r}: this daemon has no pipeline repository (start it "
                "with `dalid serve --pipelines DIR`)"
            )
        available = ", ".join(sorted(self.entries)) or "none"
        text = f"no pipeline named {name!r} in {self.directory}; available: {available}"
        if self.failures:
            failed = "; ".join(f"{file}: {why}" for file, why in sorted(self.failures.items()))
            text += f". Files that failed to load: {failed}"
        raise KeyError(text)

    def definition(
        self, name: str, build_arguments: Mapping[str, Any], parameters: Mapping[str, Any]
    ) -> Callable[[], Any]:
        """A callable that builds a new (unbuilt) DALI pipeline of ``name`` at each call."""
        entry = self.get(name)
        return functools.partial(entry.function, **build_arguments, **parameters)


def _import(path: Path) -> Any:
    """Imports ``path`` as a module of its own; a file can import its siblings."""
    module_name = _MODULE_PREFIX + path.stem
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    directory = str(path.parent)
    added = directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    finally:
        if added:
            sys.path.remove(directory)
    return module


def _pipeline_functions(module: Any) -> dict[str, Callable[..., Any]]:
    """The module's public ``@pipeline_def`` functions (not those it imports from elsewhere)."""
    return {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("_")
        and callable(value)
        and getattr(value, "_is_pipeline_def", False)
        and getattr(value, "__module__", None) == module.__name__
    }
