"""A fake of the daemon's CUDA calls (``DeviceApi``) for unit tests of the bookkeeping above
them; what runs on a real GPU is in tests/integration/test_gpu.py."""

from __future__ import annotations

from typing import Any

from dalid.server.pool import PAGE

DEVICE_UUID = "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


class FakeApi:
    """Records the CUDA calls a backend makes; memory is plain numbers."""

    def __init__(self) -> None:
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
