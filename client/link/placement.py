"""Which daemon a trainer uses when it names none: the daemon of its own GPU.

``connect()`` without a device takes ``LOCAL_RANK`` (set by torchrun and most launchers), else
the current torch CUDA device when torch has initialised CUDA, else the CPU daemon. The index
is this process's CUDA ordinal; where ``CUDA_VISIBLE_DEVICES`` (or, in a container,
``NVIDIA_VISIBLE_DEVICES``) lists the GPUs, the entry at that index names the GPU as the
daemons see it: an ordinal, or a UUID that a GPU daemon's ``<GPU UUID>.sock`` link answers to.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from dalid.protocol import Device, runtime_dir, uuid_socket_path

from ..errors import InputError


def current_index(environ: Mapping[str, str]) -> int | None:
    """This process's GPU index: ``LOCAL_RANK``, else torch's current CUDA device when CUDA
    is initialised (never initialising it here), else None."""
    rank = environ.get("LOCAL_RANK", "").strip()
    if rank:
        if not rank.isdigit():
            raise InputError(f"LOCAL_RANK={rank!r} is not a GPU index: pass connect(device=...)")
        return int(rank)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    return None


def visible_entry(environ: Mapping[str, str], index: int) -> str | None:
    """The visible-devices entry for ``index`` (an ordinal or a ``GPU-...`` UUID), if listed."""
    for variable in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        value = environ.get(variable)
        if value is None or value.strip().lower() in {"", "all", "none", "void"}:
            continue
        entries = [entry.strip() for entry in value.split(",")]
        return entries[index] if index < len(entries) else None
    return None


def default_daemon(
    environ: Mapping[str, str] | None = None, directory: Path | None = None
) -> tuple[Device, Path | None]:
    """The device of this process's daemon, and its socket when found by GPU UUID (None:
    the device's default socket)."""
    environ = os.environ if environ is None else environ
    index = current_index(environ)
    if index is None:
        return "cpu", None
    entry = visible_entry(environ, index)
    if entry is None:
        return index, None
    if entry.isdigit():
        return int(entry), None
    if entry.startswith("GPU-"):
        link = uuid_socket_path(directory or runtime_dir(), entry)
        if link.exists():
            return index, link
    return index, None
