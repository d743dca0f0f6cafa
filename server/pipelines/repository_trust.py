"""What of a pipeline repository the daemon may execute: only what no other user can change.

The daemon imports the repository's files with its own rights (root's, when it runs as root),
so a file another user can write is a way for that user to run code as the daemon's user.
The rule is the one of the runtime directory (:mod:`dalid.protocol.ownership`), with root
allowed as an owner (root can change anything anyway):

- the directory, every directory on the way to it and every directory below it (a file may
  import a sibling package, and Python keeps bytecode in ``__pycache__``), and every ``*.py``
  and ``*.pyc`` file below it, must belong to the daemon's user or root and be writable by no
  one else, or the whole repository is refused: the daemon does not start, and a reload keeps
  the repository in use (:func:`check_directory`);
- each ``*.py`` file of the directory itself must too, or that file is refused as a file that
  fails to load is, and the others load (:func:`check_file`).

Links are followed, and what they lead to is checked. Each refusal is an ``UnsafePath`` that
says what to ``chmod`` or ``chown``.
"""

from __future__ import annotations

import os
from pathlib import Path

from dalid.protocol.ownership import check_unwritable


def check_directory(directory: Path) -> None:
    """Raises UnsafePath unless the directory and everything of it that may run is safe."""
    check_unwritable(directory, "pipeline repository")
    seen = {os.path.realpath(directory)}
    for root, directories, files in os.walk(directory, followlinks=True):
        for name in list(directories):
            path = Path(root) / name
            real = os.path.realpath(path)
            if real in seen:
                directories.remove(name)  # a link back up: walked already
                continue
            seen.add(real)
            check_unwritable(path, "pipeline repository directory")
        if Path(root) == directory:
            continue  # its own files are checked one by one (check_file)
        for name in files:
            if name.endswith((".py", ".pyc")):
                check_unwritable(Path(root) / name, "pipeline repository module")


def check_file(path: Path) -> None:
    """Raises UnsafePath unless the repository file ``path`` may be imported."""
    check_unwritable(path, "pipeline repository file")
