"""A fake of the daemon's CUDA calls (``DeviceApi``) for unit tests of the bookkeeping above
them; what runs on a real GPU is in tests/integration/test_gpu.py."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from dalid.server.outputs.pool import PAGE

DEVICE_UUID = "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


class FakeApi:
    """Records the CUDA calls a backend makes; memory is plain numbers. With ``host_memory``,
    the sources of device-to-host copies are host addresses (``TensorListGPU`` below), and the
    copies move their bytes."""

    def __init__(self, host_memory: bool = False) -> None:
        self.host_memory = host_memory
        self.registered: dict[int, int] = {}  # page-locked host memory: address -> size
        self.written: dict[int, bytes] = {}
        self.fail_register = False
        self.fail_export = False  # as on a MIG instance, which has no CUDA IPC
        self.calls: list[tuple[Any, ...]] = []
        self.allocated: dict[int, int] = {}
        self.freed: list[int] = []
        self._next_ptr = 1 << 32
        self.events: list[int] = []
        self.opened: dict[int, bytes] = {}
        self.destroyed: list[int] = []
        self.on_wait: list[Any] = []
        self.private: list[int] = []

    def malloc(self, size: int) -> int:
        ptr = self._next_ptr
        self._next_ptr += size + PAGE
        self.allocated[ptr] = size
        return ptr

    def free(self, ptr: int) -> None:
        assert ptr in self.allocated, "freed twice or never allocated"
        del self.allocated[ptr]
        self.freed.append(ptr)

    def export_memory(self, ptr: int) -> bytes:
        if self.fail_export:
            raise RuntimeError("cudaErrorNotSupported: operation not supported")
        return ptr.to_bytes(64, "little")

    def create_stream(self) -> int:
        return 7

    def destroy_stream(self, stream: int) -> None:
        self.calls.append(("destroy_stream", stream))

    def create_event(self) -> tuple[int, bytes]:
        event = 100 + len(self.events)
        self.events.append(event)
        return event, event.to_bytes(64, "little")

    def create_private_event(self) -> int:
        event = 500 + len(self.private)
        self.private.append(event)
        return event

    def open_event(self, handle: bytes) -> int:
        event = 1000 + len(self.opened)
        self.opened[event] = handle
        return event

    def destroy_event(self, event: int) -> None:
        self.destroyed.append(event)

    def record(self, event: int, stream: int) -> None:
        self.calls.append(("record", event, stream))

    def wait(self, stream: int, event: int) -> None:
        self.calls.append(("wait", stream, event))
        for hook in self.on_wait:
            hook()

    def synchronize(self, stream: int) -> None:
        self.calls.append(("synchronize", stream))

    def copy(self, ptr: int, source: Any, stream: int) -> None:
        self.calls.append(("copy", ptr, stream))

    def copy_range(self, ptr: int, source: int, nbytes: int, stream: int) -> None:
        self.calls.append(("copy_range", ptr, source, nbytes, stream))

    def copy_to_host(self, ptr: int, source: int, nbytes: int, stream: int) -> None:
        self.calls.append(("copy_to_host", ptr, source, nbytes, stream))
        if self.host_memory:
            ctypes.memmove(ptr, source, nbytes)

    def write(self, ptr: int, data: bytes) -> None:
        assert ptr in self.allocated and len(data) <= self.allocated[ptr]
        self.written[ptr] = bytes(data)

    def register_host(self, ptr: int, size: int) -> None:
        if self.fail_register:
            raise RuntimeError("cudaErrorNotSupported: operation not supported")
        assert ptr not in self.registered, "page-locked twice"
        self.registered[ptr] = size
        self.calls.append(("register_host", ptr, size))

    def unregister_host(self, ptr: int) -> None:
        assert ptr in self.registered, "unregistered memory that was not page-locked"
        del self.registered[ptr]
        self.calls.append(("unregister_host", ptr))


class _HostTensor:
    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def shape(self) -> list[int]:
        return list(self.array.shape)


class TensorListGPU:
    """Stands for DALI's GPU TensorList, its samples in host memory, for a :class:`FakeApi` with
    ``host_memory``: the calls the stores make."""

    def __init__(self, samples: list[np.ndarray], layout: str = "") -> None:
        from nvidia.dali import types

        self._samples = [np.ascontiguousarray(sample) for sample in samples]
        self.dtype = types.to_dali_type(self._samples[0].dtype)
        self._layout = layout
        shapes = {sample.shape for sample in self._samples}
        self._dense = np.stack(self._samples) if len(shapes) == 1 else None

    def is_dense_tensor(self) -> bool:
        return self._dense is not None

    def as_tensor(self) -> _HostTensor:
        assert self._dense is not None
        return _HostTensor(self._dense)

    def shape(self) -> list[tuple[int, ...]]:
        return [sample.shape for sample in self._samples]

    def layout(self) -> str:
        return self._layout

    def __getitem__(self, index: int) -> _HostTensor:
        return _HostTensor(self._samples[index])
