"""How both sides name a GPU on the wire: its UUID, read from the CUDA driver.

Ordinals do not identify a GPU across processes (``CUDA_VISIBLE_DEVICES`` renumbers them), so the
daemon's ``welcome`` carries the UUID of its GPU and the trainer looks for the device with the
same UUID among its own. Both sides read it here, the same way, so the strings compare equal.

The UUID comes from the driver API through ctypes (``cuDeviceGetUuid_v2``): CuPy's
``getDeviceProperties()['uuid']`` goes through a Cython char-array conversion that stops at the
first zero byte, and torch reports it in another format. Nothing is imported until asked.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

UUID_BYTES = 16


class GpuUnavailable(RuntimeError):
    """The CUDA driver is missing or cannot report the asked device."""


def format_uuid(raw: bytes) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``, as nvidia-smi writes a GPU's UUID."""
    if len(raw) != UUID_BYTES:
        raise ValueError(f"a GPU UUID has {UUID_BYTES} bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def gpu_uuid(ordinal: int) -> str:
    """The UUID of CUDA device ``ordinal`` as this process numbers it (after
    ``CUDA_VISIBLE_DEVICES``). Raises :class:`GpuUnavailable`."""
    cuda = _driver()
    _call(cuda, cuda.cuInit(0), "cuInit")
    device = ctypes.c_int()
    _call(cuda, cuda.cuDeviceGet(ctypes.byref(device), ordinal), f"cuDeviceGet({ordinal})")
    raw = (ctypes.c_ubyte * UUID_BYTES)()
    # _v2 (CUDA 11.4+) gives MIG instances their own UUID; the first version does not.
    get_uuid = getattr(cuda, "cuDeviceGetUuid_v2", None) or cuda.cuDeviceGetUuid
    _call(cuda, get_uuid(raw, device), f"cuDeviceGetUuid({ordinal})")
    return format_uuid(bytes(raw))


def gpu_count() -> int:
    """How many CUDA devices this process sees (after ``CUDA_VISIBLE_DEVICES``), with no CUDA
    context made. Raises :class:`GpuUnavailable` without a driver."""
    cuda = _driver()
    _call(cuda, cuda.cuInit(0), "cuInit")
    count = ctypes.c_int()
    _call(cuda, cuda.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    return count.value


@functools.cache
def _driver() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise GpuUnavailable(f"the CUDA driver (libcuda.so.1) cannot be loaded: {error}") from None


def _call(cuda: Any, status: int, what: str) -> None:
    if status == 0:
        return
    text = ctypes.c_char_p()
    cuda.cuGetErrorString(status, ctypes.byref(text))
    reason = text.value.decode(errors="replace") if text.value else f"CUresult {status}"
    raise GpuUnavailable(f"{what} failed: {reason}")
