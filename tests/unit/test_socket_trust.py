"""Where a client may connect and a daemon may listen: links, owners, modes, listeners, for real.

Another user is played by root changing the owner of what it planted (``needs_root``), and by
a process that listens as another uid (:class:`tests.impostor.Impostor`).
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from dalid.protocol import RUNTIME_DIR_ENV, runtime_dir, socket_path
from dalid.protocol.daemon_socket import (
    listener_credentials,
    socket_target,
    verified_socket,
)
from dalid.protocol.ownership import UnsafePath
from tests.impostor import OTHER_UID, Impostor, needs_root


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A directory every user may write to, sticky like /tmp."""
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(0o1777)
    return path


@pytest.fixture
def private(tmp_path: Path) -> Path:
    path = tmp_path / "private"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def listening(private: Path) -> Iterator[Path]:
    """A socket of this user's, listened on by this process."""
    path = private / "d.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    yield path
    server.close()
    path.unlink()


# --- The runtime directory ----------------------------------------------------------------------


def test_a_runtime_directory_planted_as_a_link_is_refused(
    shared: Path, private: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The attack: before the user's first run, another user links the runtime directory's
    # name in a shared directory to a private directory of the user's (so every check of the
    # target passes), to point it at a directory of theirs later.
    planted = shared / "dalid-rt"
    planted.symlink_to(private)
    if os.getuid() == 0:
        os.lchown(planted, OTHER_UID, OTHER_UID)
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(planted))
    for create in (True, False):
        with pytest.raises(UnsafePath, match=f"{planted} is a symbolic link") as caught:
            runtime_dir(create=create)
        assert f"rm {planted}" in str(caught.value)
    with pytest.raises(PermissionError, match="symbolic link"):
        socket_path("cpu")
    assert planted.is_symlink() and not list(private.iterdir())  # nothing made or followed


def test_a_dangling_link_as_runtime_directory_is_refused(
    shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planted = shared / "dalid-rt"
    planted.symlink_to(shared / "not-yet")
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(planted))
    with pytest.raises(UnsafePath, match="symbolic link"):
        runtime_dir()
    assert not (shared / "not-yet").exists()


@needs_root
def test_a_runtime_directory_of_another_user_is_refused(
    shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    theirs = shared / "dalid-rt"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(theirs))
    with pytest.raises(UnsafePath, match=f"belongs to uid {OTHER_UID}"):
        runtime_dir()


def test_a_runtime_directory_inside_a_directory_others_can_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not sticky: anyone could rename the private directory away and put theirs in its place.
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    inside = open_dir / "dalid-rt"
    inside.mkdir(mode=0o700)
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(inside))
    with pytest.raises(UnsafePath, match=f"lies in {open_dir}, which other users can write to"):
        runtime_dir()
    # Sticky, as /tmp is: only the owner of an entry may rename it, so the directory is safe.
    open_dir.chmod(0o1777)
    assert runtime_dir() == inside


# --- Socket paths a client connects to ------------------------------------------------------------


def test_a_socket_of_the_user_is_its_own_target(listening: Path) -> None:
    assert socket_target(listening) == listening
    assert verified_socket(listening) == listening
    assert listener_credentials(listening).uid == os.getuid()
    assert listener_credentials(listening).pid == os.getpid()


def test_the_daemons_uuid_link_leads_to_its_socket(listening: Path) -> None:
    link = listening.parent / "GPU-00000000-1111-2222-3333-444444444444.sock"
    link.symlink_to(listening.name)  # as the daemon makes it: a bare name beside the link
    assert verified_socket(link) == listening


@pytest.mark.parametrize("target", ["../elsewhere/d.sock", "/tmp/d.sock", "..", "sub/d.sock"])
def test_a_link_anywhere_else_is_refused(listening: Path, target: str) -> None:
    link = listening.parent / "GPU-x.sock"
    link.symlink_to(target)
    with pytest.raises(UnsafePath, match="follows only a GPU daemon's own link"):
        socket_target(link)


@needs_root
def test_a_link_planted_by_another_user_is_refused(listening: Path) -> None:
    link = listening.parent / "GPU-x.sock"
    link.symlink_to(listening.name)
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePath, match=f"owned by uid {OTHER_UID}"):
        socket_target(link)


def test_a_file_that_is_not_a_socket_is_refused(private: Path) -> None:
    path = private / "d.sock"
    path.write_text("")
    with pytest.raises(UnsafePath, match="is not a socket"):
        socket_target(path)


def test_no_socket_and_a_dead_socket_are_not_unsafe(private: Path) -> None:
    with pytest.raises(FileNotFoundError):
        verified_socket(private / "none.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(private / "dead.sock"))
    dead.close()  # the file stays, with no listener: a killed daemon's
    with pytest.raises(ConnectionRefusedError):
        verified_socket(private / "dead.sock")
    (private / "dead.sock").unlink()


def test_a_socket_in_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(open_dir / "d.sock"))
        server.listen(1)
        for mode in (0o777, 0o1777, 0o775):
            open_dir.chmod(mode)
            with pytest.raises(UnsafePath, match="can be written by other users"):
                verified_socket(open_dir / "d.sock")
    finally:
        server.close()
        (open_dir / "d.sock").unlink(missing_ok=True)


@needs_root
def test_a_socket_of_another_user_is_refused(listening: Path) -> None:
    os.chown(listening, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePath, match=f"belongs to uid {OTHER_UID}"):
        verified_socket(listening)


@needs_root
def test_a_listener_of_another_user_is_refused_and_sent_nothing(private: Path) -> None:
    # The socket file is the user's (bound before the impostor changed uid): only the
    # listener's credentials tell.
    impostor = Impostor(private / "d.sock")
    try:
        assert stat.S_ISSOCK(os.lstat(impostor.path).st_mode)
        assert os.lstat(impostor.path).st_uid == os.getuid()
        with pytest.raises(UnsafePath, match=f"runs as uid {OTHER_UID}, not as you"):
            verified_socket(impostor.path)
        assert impostor.received() == b""
    finally:
        impostor.kill()
