"""What ``dalid serve`` supervises: one daemon per device, each with its command line, socket
and log (:class:`~.supervisor.ChildSpec`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from dalid.protocol import (
    SOCKET_ENV,
    Device,
    GpuUnavailable,
    device_label,
    parse_device,
    runtime_dir,
    socket_path,
)

from .supervisor import ChildSpec


class DeviceListError(ValueError):
    """A ``--devices`` value that names no device, or devices this machine lacks."""


def parse_devices(text: str, gpu_count: Callable[[], int]) -> list[Device]:
    """``--devices``: ``all`` (every GPU that ``gpu_count()`` reports), or a comma-separated
    list of ``cpu`` and GPU ordinals such as ``0,1``."""
    text = text.strip().lower()
    if text == "all":
        try:
            count = gpu_count()
        except GpuUnavailable as error:
            raise DeviceListError(
                f"--devices all: this machine has no usable GPU ({error}); use --devices cpu "
                "for CPU pipelines"
            ) from None
        if count == 0:
            raise DeviceListError(
                "--devices all: the CUDA driver reports no GPU (check CUDA_VISIBLE_DEVICES); "
                "use --devices cpu for CPU pipelines"
            )
        return list(range(count))
    devices: list[Device] = []
    for item in text.split(","):
        try:
            device = parse_device(item)
        except ValueError as error:
            raise DeviceListError(f"--devices {text!r}: {error}") from None
        if device in devices:
            raise DeviceListError(f"--devices {text!r} names {device_label(device)} twice")
        devices.append(device)
    return devices


def child_specs(
    devices: Sequence[Device], socket: str | None, daemon_options: Sequence[str]
) -> list[ChildSpec]:
    """One child per device. A single daemon logs to the supervisor's output and may take
    ``socket``; several each get ``<runtime dir>/<device>.sock`` and a log file beside it."""
    if len(devices) == 1:
        device = devices[0]
        path = socket_path(device, socket)
        command = _daemon_command(device, path, daemon_options)
        return [ChildSpec(device_label(device), command, socket=path)]
    if socket is not None or os.environ.get(SOCKET_ENV):
        raise DeviceListError(
            f"several devices need a socket each: drop --socket and ${SOCKET_ENV}; each daemon "
            "listens on <runtime dir>/<device>.sock"
        )
    directory = runtime_dir()
    specs = []
    for device in devices:
        label = device_label(device)
        path = directory / f"{label}.sock"
        command = _daemon_command(device, path, daemon_options)
        specs.append(ChildSpec(label, command, path.with_name(path.name + ".log"), path))
    return specs


def _daemon_command(device: Device, socket: Path, options: Sequence[str]) -> tuple[str, ...]:
    return (
        sys.executable, "-m", "dalid.server", "serve", "--no-supervisor",
        "--device", str(device), "--socket", str(socket), *options,
    )  # fmt: skip
