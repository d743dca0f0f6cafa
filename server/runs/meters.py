"""What the DALI instance controller (``instances.py``) is shown of the load: the busy cores
among those the daemon may use, the daemon's own CPU time, and the GPU's utilisation."""

from __future__ import annotations

import ctypes
import os
import time


class CpuMeter:
    """Since the previous reading: the busy cores among those the daemon may use (any process
    on them, from the kernel's per-CPU counters in /proc/stat; without them, the daemon's own
    figure stands in), and the daemon process's own (all its threads, DALI's included)."""

    def __init__(self) -> None:
        self._allowed = sorted(os.sched_getaffinity(0))
        self.cores = len(self._allowed)
        # Where the daemon may use every CPU, /proc/stat's first line is their sum: read
        # alone, not each CPU's line (a look comes four times a second).
        if self._allowed == list(range(os.cpu_count() or 0)):
            self._allowed = []
        self._last = (time.monotonic(), time.process_time(), _busy_ticks(self._allowed))

    def read(self) -> tuple[float, float] | None:
        """(busy cores, the daemon's cores), or None right after the previous reading."""
        wall, cpu, ticks = time.monotonic(), time.process_time(), _busy_ticks(self._allowed)
        last_wall, last_cpu, last_ticks = self._last
        if wall - last_wall < 0.2:
            return None  # too short a time to say
        self._last = (wall, cpu, ticks)
        own = (cpu - last_cpu) / (wall - last_wall)
        if ticks is None or last_ticks is None:
            return own, own
        busy = (ticks - last_ticks) / _TICKS_PER_S / (wall - last_wall)
        return min(max(busy, own), float(self.cores)), own


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_ticks(cpus: list[int]) -> int | None:
    """The clock ticks the CPUs ``cpus`` (empty: all of them) spent busy (not idle, not
    waiting for I/O) since boot; None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat", "rb") as stat:
            text = stat.read()
        if not cpus:
            return _busy(text[: text.index(b"\n")].split())
        wanted = {f"cpu{number}".encode() for number in cpus}
        busy = 0
        for line in text.splitlines():
            fields = line.split()
            if fields and fields[0] in wanted:
                busy += _busy(fields)
    except (OSError, ValueError, IndexError):
        return None
    return busy


def _busy(fields: list[bytes]) -> int:
    """Busy ticks of a /proc/stat CPU line's fields: all but idle and iowait of the first 7."""
    ticks = [int(value) for value in fields[1:8]]
    return sum(ticks) - ticks[3] - ticks[4]


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class GpuMeter:
    """A GPU's utilisation (0..1) over NVML's last sample period, read through
    ``libnvidia-ml.so.1`` (the driver's; none on a machine without an NVIDIA driver: then
    ``read`` returns None)."""

    def __init__(self, device_id: int | None) -> None:
        self._handle: ctypes.c_void_p | None = None
        self._nvml: ctypes.CDLL | None = None
        if device_id is None:
            return
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if nvml.nvmlInit_v2() != 0:
                return
            handle = ctypes.c_void_p()
            # CUDA's device order and NVML's agree unless CUDA_VISIBLE_DEVICES reorders them.
            index = _visible_index(device_id)
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                return
        except (OSError, AttributeError):
            return
        self._nvml, self._handle = nvml, handle

    @property
    def available(self) -> bool:
        return self._handle is not None

    def read(self) -> float | None:
        if self._nvml is None or self._handle is None:
            return None
        rates = _Utilization()
        if self._nvml.nvmlDeviceGetUtilizationRates(self._handle, ctypes.byref(rates)) != 0:
            return None
        return float(rates.gpu) / 100.0


def _visible_index(device_id: int) -> int:
    """NVML's index of CUDA's device ``device_id``, where CUDA_VISIBLE_DEVICES lists indices."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if device_id < len(visible) and visible[device_id].strip().isdigit():
        return int(visible[device_id])
    return device_id
