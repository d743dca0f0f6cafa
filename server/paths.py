"""Samples that are file paths: the daemon opens the files, so it checks that it can first.

A pipeline that reads files (``fn.io.file.read`` fed by an external_source) has the daemon,
not the trainer, open them. The client makes relative paths absolute from the trainer's working
directory (as DALI's proxy, whose pipeline runs in the trainer, would read them), and names the
samples whose file it could not read itself (``SubmitBatch.unreadable``). Before a batch runs,
the daemon checks every path sample:

- a file the trainer could not read either is a bad sample (a missing file, a wrong path),
  handled by the pipeline's ``on_error`` like any other;
- a file the trainer reads and the daemon cannot means the daemon does not see the trainer's
  files (another container, another mount namespace, another user): the batch fails with
  :class:`FilesUnseen`, which says what to mount, whatever ``on_error`` says, since every later
  batch would fail the same way.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import PurePosixPath

import numpy as np

# The dtypes DALI's file reader takes a path in.
PATH_DTYPES = frozenset({np.dtype(np.int8), np.dtype(np.uint8)})


class FilesUnseen(Exception):
    """The daemon cannot open a file that the trainer can: it does not see the trainer's
    files. The message says which and what to mount."""


def check_paths(
    arrays: Mapping[str, np.ndarray | Sequence[np.ndarray]],
    path_inputs: Collection[str],
    unreadable: Collection[int],
) -> dict[int, str]:
    """The bad samples among the path samples of a batch, with why; raises FilesUnseen."""
    bad: dict[int, str] = {}
    for name in path_inputs:
        for position, sample in enumerate(arrays.get(name, ())):
            if sample.dtype not in PATH_DTYPES or sample.ndim != 1 or position in bad:
                continue
            path = sample.tobytes()
            shown = os.fsdecode(path)
            if not path or b"\0" in path:
                bad[position] = f"input {name!r}: {shown!r} is not a file path"
            elif position in unreadable:
                bad[position] = (
                    f"input {name!r}: cannot read {shown}, in the trainer either (a missing "
                    "file, or a wrong path)"
                )
            elif not os.access(path, os.R_OK):
                raise FilesUnseen(unseen_message(shown))
    return bad


def unseen_message(path: str) -> str:
    """Why the daemon cannot open ``path``, which the trainer reads, and what to do."""
    where = f"the dalid daemon (pid {os.getpid()}, uid {os.getuid()})"
    if os.path.exists(path):
        return (
            f"{where} may not read {path}, which the trainer reads: the daemon opens the files "
            "itself, so run it as the trainer's user, or let its user read the dataset"
        )
    missing = first_missing(path)
    return (
        f"{where} cannot open {path}, which the trainer reads: the daemon opens the files "
        f"itself, and it does not see the trainer's files ({missing} does not exist where the "
        "daemon runs: another container, or another mount namespace). Mount the dataset's "
        f"directory ({missing}, or one above it) into the daemon's container at the same path "
        "as in the trainer's (see docs/deployment.md, Files)"
    )


def first_missing(path: str) -> str:
    """The outermost directory (or file) of ``path`` that does not exist here."""
    pure = PurePosixPath(path)
    for ancestor in [*reversed(pure.parents), pure]:
        if not os.path.exists(ancestor):
            return str(ancestor)
    return path
