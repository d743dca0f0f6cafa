"""Which files and directories a dalid process trusts: those no other user can change.

A path is only as safe as every directory on the way to it: whoever can write to one of them
can rename what lies below and put something of theirs in its place. So each check here also
walks the path's directories from the root, which must belong to this user or to root and be
writable by no one else (a sticky directory such as ``/tmp`` is fine: there only the owner of
an entry can rename or remove it). Nothing here follows a link where a link is refused.

Each refusal is an :class:`UnsafePath` (a ``PermissionError``) that says what to do.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafePath(PermissionError):
    """A path that another user could have planted or could change."""


def check_private_directory(path: Path, what: str) -> None:
    """``path`` is a directory (not a link to one) of this user, closed to everyone else."""
    info = _lstat_not_link(path, what)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePath(f"{what} {path} is not a directory: remove it or choose another")
    _check_owner(path, info, what, allow_root=False)
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise UnsafePath(
            f"{what} {path} is open to other users (mode {mode:o}): run `chmod 700 {path}`"
        )
    check_ancestors(path, what)


def check_owned_directory(path: Path, what: str) -> None:
    """``path`` is a directory (not a link to one) of this user that no one else can write to."""
    info = _lstat_not_link(path, what)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePath(f"{what} {path} is not a directory")
    _check_owner(path, info, what, allow_root=False)
    _check_not_writable(path, info, what)
    check_ancestors(path, what)


def check_unwritable(path: Path, what: str) -> None:
    """``path`` (a link is followed) and every directory on the way to it can be changed by no
    one but this user and root: what dalid may execute."""
    real = Path(os.path.realpath(path))
    info = os.stat(real)
    shown = path if real == path else f"{path} (a link to {real})"
    _check_owner(shown, info, what, allow_root=True)
    _check_not_writable(shown, info, what)
    check_ancestors(real, what)


def check_ancestors(path: Path, what: str) -> None:
    """No other user can rename or replace anything in the directories leading to ``path``."""
    me = os.getuid()
    parent = Path(os.path.realpath(path.parent))
    for directory in [*reversed(parent.parents), parent]:
        info = os.stat(directory)
        if info.st_uid not in (me, 0):
            raise UnsafePath(
                f"{what} {path} lies in {directory}, which belongs to uid {info.st_uid}: another "
                "user could replace what it holds; choose a place of your own"
            )
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o022 and not mode & stat.S_ISVTX:
            raise UnsafePath(
                f"{what} {path} lies in {directory}, which other users can write to (mode "
                f"{mode:o}): run `chmod go-w {directory}` or choose a place of your own"
            )


def _lstat_not_link(path: Path, what: str) -> os.stat_result:
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafePath(
            f"{what} {path} is a symbolic link (to {os.readlink(path)}, owned by uid "
            f"{info.st_uid}), which anyone who can write beside it may have planted or may "
            f"point elsewhere later: remove it (`rm {path}`) and let dalid create a directory "
            "there, or choose another"
        )
    return info


def _check_owner(path: object, info: os.stat_result, what: str, *, allow_root: bool) -> None:
    me = os.getuid()
    if info.st_uid == me or (allow_root and info.st_uid == 0):
        return
    owners = "you or root" if allow_root and me != 0 else "you"
    raise UnsafePath(
        f"{what} {path} belongs to uid {info.st_uid}, not {owners} (uid {me}): another user "
        f"could change it; `chown {me} {path}` if it is yours, or choose another"
    )


def _check_not_writable(path: object, info: os.stat_result, what: str) -> None:
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise UnsafePath(
            f"{what} {path} can be written by other users (mode {mode:o}): run `chmod go-w {path}`"
        )
