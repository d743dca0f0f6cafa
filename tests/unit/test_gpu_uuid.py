"""How both sides name a GPU: its UUID, as nvidia-smi writes it (protocol/gpu.py)."""

from __future__ import annotations

import pytest

from dalid.protocol import GpuUnavailable, format_uuid, gpu_uuid
from dalid.protocol import gpu as gpu_module


def test_uuids_are_written_as_nvidia_smi_writes_them() -> None:
    raw = bytes.fromhex("00112233445566778899aabbccddeeff")
    assert format_uuid(raw) == "GPU-00112233-4455-6677-8899-aabbccddeeff"


def test_zero_bytes_are_kept() -> None:
    # CuPy's getDeviceProperties()['uuid'] cuts a UUID at its first zero byte; this must not.
    assert format_uuid(bytes(16)) == "GPU-00000000-0000-0000-0000-000000000000"


@pytest.mark.parametrize("size", [0, 15, 17])
def test_a_uuid_has_16_bytes(size: int) -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        format_uuid(bytes(size))


def test_without_a_driver_the_error_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> None:
        raise GpuUnavailable("the CUDA driver (libcuda.so.1) cannot be loaded: missing")

    monkeypatch.setattr(gpu_module, "_driver", no_driver)
    with pytest.raises(GpuUnavailable, match=r"libcuda\.so\.1"):
        gpu_uuid(0)
