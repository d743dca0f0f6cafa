"""Where a daemon listens: the private runtime directory and one socket per device.

Both sides resolve addresses here, so a client finds the daemon that ``dalid serve`` started
with the same arguments and environment.
"""

from __future__ import annotations

import os
from pathlib import Path

from .ownership import check_private_directory

SOCKET_ENV = "DALID_SOCKET"
RUNTIME_DIR_ENV = "DALID_RUNTIME_DIR"
# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH = 107

Device = str | int
"""``"cpu"`` for CPU-only pipelines, or a CUDA device ordinal."""


def parse_device(value: Device) -> Device:
    """``"cpu"`` or a non-negative int from a flag or argument (``"0"``, ``0``, ``"cpu"``)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "cpu":
            return "cpu"
        if text.isdigit():
            return int(text)
    raise ValueError(f"device must be 'cpu' or a GPU ordinal such as 0, got {value!r}")


def device_label(device: Device) -> str:
    """The name of a device in socket paths and messages: ``cpu`` or ``gpu0``."""
    device = parse_device(device)
    return "cpu" if device == "cpu" else f"gpu{device}"


def runtime_dir(create: bool = True, explicit: str | os.PathLike[str] | None = None) -> Path:
    """The per-user directory holding daemon sockets and logs, mode 0700.

    ``explicit``, else ``$DALID_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/dalid``, else
    ``/tmp/dalid-$UID``. An existing directory that is a link, that another user owns or that
    others can enter is refused (:class:`~dalid.protocol.ownership.UnsafePath`): a socket
    there could be someone else's daemon.
    """
    explicit = explicit or os.environ.get(RUNTIME_DIR_ENV)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if explicit:
        path = Path(explicit)
    elif xdg:
        path = Path(xdg) / "dalid"
    else:
        path = Path(f"/tmp/dalid-{os.getuid()}")
    if create and not os.path.lexists(path):  # mkdir would follow a link planted there
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.path.lexists(path):
        check_private_directory(path, "runtime directory")
    return path


def check_socket_directory(socket: Path) -> None:
    """The runtime directory's rule, for a daemon's socket wherever it lies (``--socket`` too):
    its directory, if it exists, is this user's and closed to everyone else (mode 0700). A
    daemon makes a missing one so."""
    if os.path.lexists(socket.parent):
        check_private_directory(socket.parent, "socket directory")


def socket_path(
    device: Device = "cpu",
    explicit: str | os.PathLike[str] | None = None,
    directory: str | os.PathLike[str] | None = None,
) -> Path:
    """The daemon socket for ``device``: ``explicit``, else ``$DALID_SOCKET``, else the default
    (in ``directory``, else the runtime directory)."""
    if explicit is not None:
        path = Path(explicit)
    elif os.environ.get(SOCKET_ENV):
        path = Path(os.environ[SOCKET_ENV])
    else:
        path = runtime_dir(explicit=directory) / f"{device_label(device)}.sock"
    path = path.absolute()
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ValueError(
            f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes, the limit of a Unix "
            f"socket address: choose a shorter --socket or {SOCKET_ENV}"
        )
    return path


def endpoint(path: Path) -> str:
    """The ZeroMQ endpoint of a socket path."""
    return f"ipc://{path}"


def uuid_socket_path(directory: Path, device_uuid: str) -> Path:
    """The link a GPU daemon makes to its socket, named by its GPU's UUID (``GPU-...``)."""
    return directory / f"{device_uuid}.sock"
