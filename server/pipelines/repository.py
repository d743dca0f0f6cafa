"""The pipeline repository: ``@pipeline_def`` functions the daemon loads from a directory.

``dalid serve --pipelines DIR`` imports every ``*.py`` file of DIR (not its subdirectories) at
start, provided no other user can change them (see :mod:`.repository_trust`). Each module-level
function decorated with ``@pipeline_def`` whose name does not start with ``_`` becomes a
pipeline that clients select by that name, with the build arguments and parameters they
choose. Pipelines that cannot be serialized (Python operators, say) run this
way. A file that fails to import is logged and kept as a failure: the daemon runs on, and a
client that asks for an unknown name is told which names exist and which files failed.

``dalid reload`` (or SIGHUP) loads the directory again (:meth:`PipelineRepository.reload`). The
new repository is what the files load as now, with one exception: a file that loaded before
and fails now keeps its last good definitions, so that a half-saved edit does not take away a
pipeline that jobs register. A file that was removed takes its names with it. Pipelines already
built from an older definition run on unchanged: a registration takes its definition from the
repository of the moment it arrives.
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

from dalid.protocol.ownership import UnsafePath

from . import repository_trust

log = logging.getLogger("dalid.server")

_MODULE_PREFIX = "dalid_pipelines_"


@dataclass(frozen=True)
class RepositoryEntry:
    name: str
    function: Callable[..., Any]
    path: Path


class RepositoryUnavailable(Exception):
    """The repository cannot be loaded again (its directory is gone, or the daemon has none);
    the repository in use stays as it is."""


@dataclass
class PipelineRepository:
    """The pipelines of one directory, and the files that could not be loaded (with why).

    ``kept`` names, for each file that failed to load again, the pipelines it still serves
    from its last good load.
    """

    directory: Path | None = None
    entries: dict[str, RepositoryEntry] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    kept: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def load(
        cls, directory: Path, previous: PipelineRepository | None = None
    ) -> PipelineRepository:
        """Imports every ``*.py`` file of ``directory``.

        A file that fails keeps the definitions it had in ``previous`` (the repository this
        one replaces), if it had any: see the module docstring.
        """
        # Code others could change is never run (see repository_trust): raises UnsafePath.
        repository_trust.check_directory(directory)
        repository = cls(directory)
        # Files added since the last load, and siblings that changed, are read afresh.
        importlib.invalidate_caches()
        _forget_modules_of(directory)
        for path in sorted(directory.glob("*.py")):
            try:
                repository_trust.check_file(path)
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
                if previous is None:
                    continue
                functions = {
                    entry.name: entry.function
                    for entry in previous.entries.values()
                    if entry.path == path
                }
                kept = repository._add(path, functions, failed=True)
                if kept:
                    repository.kept[path.name] = kept
                    log.warning(
                        "pipeline repository: %s keeps its previous definitions of %s",
                        path.name,
                        ", ".join(kept),
                    )
                continue
            repository._add(path, functions, failed=False)
        log.info(
            "pipeline repository %s: %s",
            directory,
            ", ".join(sorted(repository.entries)) or "no pipelines",
        )
        return repository

    def reload(self) -> PipelineRepository:
        """The repository as its directory loads now, by the rule of the module docstring.

        Raises :class:`RepositoryUnavailable` when there is nothing to load again; ``self`` is
        left as it was either way.
        """
        if self.directory is None:
            raise RepositoryUnavailable(
                "this daemon has no pipeline repository (start it with `dalid serve "
                "--pipelines DIR`)"
            )
        if not self.directory.is_dir():
            raise RepositoryUnavailable(
                f"{self.directory} is not a directory any more: the pipelines loaded before "
                "stay in use"
            )
        try:
            return PipelineRepository.load(self.directory, previous=self)
        except UnsafePath as error:
            raise RepositoryUnavailable(
                f"{error}; the pipelines loaded before stay in use"
            ) from None

    def _add(
        self, path: Path, functions: Mapping[str, Callable[..., Any]], failed: bool
    ) -> tuple[str, ...]:
        """Adds the pipelines of ``path``, but a name an earlier file has; the names added."""
        added = []
        for name, function in functions.items():
            existing = self.entries.get(name)
            if existing is not None:
                clash = (
                    f"pipeline {name!r} is also defined in {existing.path.name}; the one "
                    f"of {existing.path.name} is kept"
                )
                # A file that failed to load is reported for that first.
                if not failed:
                    self.failures[path.name] = clash
                log.error("pipeline repository: %s: %s", path.name, clash)
                continue
            self.entries[name] = RepositoryEntry(name, function, path)
            added.append(name)
        return tuple(added)

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

    def changes_from(self, previous: PipelineRepository) -> str:
        """What a reload changed, for the daemon's log: the names added and removed (every
        name that loaded again has a new definition, changed or not)."""
        added = sorted(set(self.entries) - set(previous.entries))
        removed = sorted(set(previous.entries) - set(self.entries))
        parts = [
            f"{what} {', '.join(names)}"
            for what, names in (("added", added), ("removed", removed))
            if names
        ]
        return "; ".join(parts) or "no pipeline added or removed"

    def definition(
        self, name: str, build_arguments: Mapping[str, Any], parameters: Mapping[str, Any]
    ) -> Callable[[], Any]:
        """A callable that builds a new (unbuilt) DALI pipeline of ``name`` at each call."""
        entry = self.get(name)
        return functools.partial(entry.function, **build_arguments, **parameters)


def _import(path: Path) -> Any:
    """Imports ``path`` as a module of its own; a file can import its siblings.

    The source is compiled as it is now, not taken from ``__pycache__``: a bytecode file is
    trusted by its source's size and modification second, which an edit and a reload within
    the same second can leave unchanged.
    """
    module_name = _MODULE_PREFIX + path.stem
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    directory = str(path.parent)
    added = directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    # Pipelines still running from an earlier load of the file hold its earlier module.
    earlier = sys.modules.get(module_name)
    sys.modules[module_name] = module
    try:
        exec(compile(path.read_bytes(), str(path), "exec"), vars(module))
    except BaseException:
        if earlier is None:
            sys.modules.pop(module_name, None)
        else:
            sys.modules[module_name] = earlier
        raise
    finally:
        if added:
            sys.path.remove(directory)
    return module


def _forget_modules_of(directory: Path) -> None:
    """Drops the cached modules imported from ``directory`` (siblings the files import), so
    that a load imports them as they are now, and those of repository files that are gone.
    Code loaded earlier keeps the modules it has.

    A repository file's own module stays while the file is there: :func:`_import` replaces
    it, or keeps it when the file fails to load again.
    """
    resolved = directory.resolve()
    names = {directory.name, resolved.name}
    for name, module in list(sys.modules.items()):
        location = getattr(module, "__file__", None)
        if not isinstance(location, str):
            continue
        path = Path(location)
        if path.parent.name not in names or path.parent.resolve() != resolved:
            continue
        if not (name.startswith(_MODULE_PREFIX) and path.exists()):
            del sys.modules[name]


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
