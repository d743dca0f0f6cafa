"""Peer credentials and shutting a connection down, on real Unix sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile

from dalid.server.intake.credentials import PeerCredentials, read_peer, shut_down


def test_the_peer_of_a_socket_is_the_process_that_connected_it() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        found = read_peer(ours.fileno())
        assert found is not None
        socket_id, credentials = found
        assert credentials == PeerCredentials(os.getpid(), os.getuid(), os.getgid())
        assert socket_id.inode == os.fstat(ours.fileno()).st_ino


def test_another_process_that_connects_is_seen_by_its_own_pid() -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "s")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen()
            code = (
                "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
                "s.recv(1)"
            )
            child = subprocess.Popen([sys.executable, "-c", code, path])
            try:
                connection, _ = listener.accept()
                with connection:
                    found = read_peer(connection.fileno())
                    assert found is not None and found[1].pid == child.pid
            finally:
                child.wait(10)


def test_shutting_down_ends_the_connection_for_both_sides() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        found = read_peer(ours.fileno())
        assert found is not None
        assert shut_down(ours.fileno(), found[0])
        assert theirs.recv(1) == b""  # end of file


def test_a_reused_descriptor_number_is_not_shut_down() -> None:
    first, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    other, other_peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with peer, other, other_peer:
        number = first.fileno()
        found = read_peer(number)
        assert found is not None
        # The number now names another socket, as when ZeroMQ closes a connection and accepts
        # the next one.
        os.dup2(other.fileno(), number)
        first.detach()
        try:
            assert not shut_down(number, found[0])
            other_peer.sendall(b"x")
            assert os.read(number, 1) == b"x"  # still connected
        finally:
            os.close(number)


def test_what_is_no_socket_has_no_peer() -> None:
    read, write = os.pipe()
    try:
        assert read_peer(read) is None
    finally:
        os.close(read)
        os.close(write)
    assert read_peer(read) is None  # closed
