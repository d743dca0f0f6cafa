"""The daemon process: one ROUTER socket, one I/O loop, and the core behind it.

The I/O thread alone touches the socket. Executors hand their results to :meth:`Daemon.push`,
which queues them and wakes the loop through an eventfd that the poller watches beside the
socket. Signals wake it the same way.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from dalid.protocol import (
    Device,
    GpuUnavailable,
    Limits,
    Message,
    ProtocolError,
    decode,
    device_label,
    endpoint,
    gpu_uuid,
    transport,
    uuid_socket_path,
)

from .core import DaemonCore, process_alive
from .cuda import CudaBackend
from .memory import SHM_DIR, SLAB_PREFIX, SharedMemoryBackend
from .repository import PipelineRepository

log = logging.getLogger("dalid.server")

GiB = 1 << 30
MiB = 1 << 20
EXIT_ALREADY_RUNNING = 3
EXIT_NO_DEVICE = 4


@dataclass(frozen=True)
class DaemonConfig:
    device: Device
    socket: Path
    idle_timeout: float | None = None
    pool_bytes: int = 2 * GiB
    slab_bytes: int = 64 * MiB
    max_batch_size: int = 4096
    # A pipeline repository: Python files of @pipeline_def functions clients select by name.
    pipelines: Path | None = None


class AlreadyRunning(RuntimeError):
    """Another live daemon holds the socket."""


class Daemon:
    """Serves one device until SIGTERM, SIGINT, a shutdown request or the idle timeout."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self._outbox: collections.deque[tuple[bytes, Message, int | None]] = collections.deque()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stop = threading.Event()
        self._context: zmq.Context[Any] | None = None
        self._socket: zmq.Socket[Any] | None = None
        self._lock_fd: int | None = None
        self._uuid_link: Path | None = None
        self.core: DaemonCore | None = None

    # --- wake-ups from other threads and signals ------------------------------------------------

    def push(self, identity: bytes, message: Message, request_id: int | None = None) -> None:
        """Queues ``message`` for ``identity``; safe from any thread."""
        self._outbox.append((identity, message, request_id))
        self._wake()

    def request_stop(self, *_: object) -> None:
        self._stop.set()
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_write(self._wake_fd, 1)

    # --- lifecycle ------------------------------------------------------------------------------

    def serve(self) -> int:
        """Runs the daemon in the calling (main) thread; returns the exit status."""
        try:
            self._acquire_socket()
        except AlreadyRunning as error:
            log.error("%s", error)
            self.close()
            return EXIT_ALREADY_RUNNING
        try:
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
            try:
                self._start()
            except GpuUnavailable as error:
                log.error("cannot serve GPU %s: %s", self.config.device, error)
                return EXIT_NO_DEVICE
            log.info(
                "dalid daemon pid %d serving %s on %s",
                os.getpid(),
                device_label(self.config.device),
                endpoint(self.config.socket),
            )
            self._loop()
        finally:
            self.close()
        log.info("dalid daemon pid %d stopped", os.getpid())
        return 0

    def _acquire_socket(self) -> None:
        """Takes the socket's lock file; a live daemon holding it means we must not start."""
        path = self.config.socket
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_path = path.with_name(path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise AlreadyRunning(
                f"a dalid daemon (pid {owner}) already serves {endpoint(path)}; stop it with "
                f"`dalid stop --socket {path}` or choose another --socket"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        # We hold the lock, so a socket file here was left by a daemon that died.
        if path.exists() or path.is_symlink():
            log.info("removing stale socket %s", path)
            path.unlink()
        _remove_stale_segments()

    def _start(self) -> None:
        config = self.config
        limits = Limits(
            max_batch_size=config.max_batch_size,
            max_message_bytes=transport.MAX_MESSAGE_BYTES,
            pool_bytes=config.pool_bytes,
            slab_bytes=config.slab_bytes,
        )
        device_uuid = ""
        cuda_backend = None
        if config.device != "cpu":
            device_id = int(config.device)
            device_uuid = gpu_uuid(device_id)
            # Each job gets its own GPU memory, stream and events (Note [GPU output lifetime]).
            cuda_backend = functools.partial(CudaBackend, device_id)
            log.info("GPU %d is %s", device_id, device_uuid)
        # Before the socket is bound: a client never finds a daemon whose repository is missing.
        repository = (
            PipelineRepository.load(config.pipelines) if config.pipelines is not None else None
        )
        self.core = DaemonCore(
            config.device,
            SharedMemoryBackend(),
            self.push,
            limits,
            device_uuid=device_uuid,
            cuda_backend=cuda_backend,
            repository=repository,
        )
        self._context = zmq.Context()
        previous = os.umask(0o177)  # the socket file is created 0600
        try:
            self._socket = transport.make_socket(
                self._context, zmq.ROUTER, endpoint(config.socket), bind=True
            )
        finally:
            os.umask(previous)
        if device_uuid:
            self._link_by_uuid(device_uuid)

    def _link_by_uuid(self, device_uuid: str) -> None:
        """``<socket dir>/<GPU UUID>.sock``, a link to the socket: a trainer finds the daemon
        of the GPU it was given by the GPU's UUID, whatever ordinal it has there."""
        link = uuid_socket_path(self.config.socket.parent, device_uuid)
        try:
            if link.is_symlink():
                link.unlink()  # a daemon of this GPU that died; we serve it now
            link.symlink_to(self.config.socket.name)
        except OSError as error:
            log.warning("cannot link %s to the socket: %s", link, error)
            return
        self._uuid_link = link

    def close(self) -> None:
        """Frees every job, closes the socket and removes its file. Idempotent."""
        if self.core is not None:
            self.core.close()
            self.core = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None
        if self._uuid_link is not None:
            with contextlib.suppress(OSError):
                if os.readlink(self._uuid_link) == self.config.socket.name:
                    self._uuid_link.unlink()
            self._uuid_link = None
        if self._lock_fd is not None:
            self.config.socket.unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._wake_fd >= 0:
            os.close(self._wake_fd)
            self._wake_fd = -1

    # --- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        assert self._socket is not None and self.core is not None
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_fd, zmq.POLLIN)
        next_reap = time.monotonic() + 1.0
        idle_since: float | None = time.monotonic()
        while not self._stop.is_set() and not self.core.stop_requested:
            events = dict(poller.poll(timeout=500))
            if self._wake_fd in events:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake_fd)
            if self._socket in events:
                self._receive_all()
            self._flush_outbox()
            now = time.monotonic()
            if now >= next_reap:
                self.core.reap()
                next_reap = now + 1.0
            if self.core.jobs:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            timeout = self.config.idle_timeout
            if timeout is not None and idle_since is not None and now - idle_since >= timeout:
                log.info("no jobs for %.0f s: exiting", timeout)
                break
        self._flush_outbox()

    def _receive_all(self) -> None:
        assert self._socket is not None and self.core is not None
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            try:
                envelope = decode(frames[1:])
            except ProtocolError as error:
                log.warning("malformed message from %s: %s", identity.hex(), error.message)
                self._send(identity, self.core.malformed(error), error.request_id)
                continue
            reply = self.core.handle(identity, envelope.message, envelope.request_id)
            if reply is not None:
                self._send(identity, reply, envelope.request_id)

    def _flush_outbox(self) -> None:
        assert self.core is not None
        while self._outbox:
            identity, message, request_id = self._outbox.popleft()
            if self.core.job_for(identity) is None:
                continue  # the job ended while the batch ran; its pool is already freed
            self._send(identity, message, request_id)

    def _send(self, identity: bytes, message: Message, request_id: int | None) -> None:
        assert self._socket is not None and self.core is not None
        try:
            transport.send_to(self._socket, identity, message, request_id)
        except zmq.ZMQError as error:
            if error.errno != zmq.EHOSTUNREACH:
                raise
            self.core.trainer_unreachable(identity)


def _remove_stale_segments() -> None:
    """Unlinks shared-memory slabs left by daemons of this user that died without cleaning up."""
    uid = os.getuid()
    for path in SHM_DIR.glob(SLAB_PREFIX + "*"):
        parts = path.name.split("-")
        if len(parts) < 3 or not parts[1].isdigit():
            continue
        try:
            if path.stat().st_uid != uid or process_alive(int(parts[1])):
                continue
            path.unlink()
            log.info("removed stale shared memory %s", path.name)
        except FileNotFoundError:
            continue
