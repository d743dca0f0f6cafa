"""The CUDA calls the daemon's GPU outputs make, and their implementation through CuPy.

:class:`~dalid.server.outputs.cuda.CudaBackend` (and the staged outputs of ``cuda_staged.py``) make
every call through a :class:`DeviceApi`; :class:`CupyApi` makes them on a device, and unit tests
pass a fake one, so the bookkeeping of Note [GPU output lifetime] runs without a GPU. CuPy is
imported only when a :class:`CupyApi` is made, so a CPU daemon never needs CUDA. The daemon
makes its ``CupyApi`` through this module's attribute (``cuda_api.CupyApi``), which a simulated
GPU in the tests replaces.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol


class DeviceApi(Protocol):
    """The CUDA calls a :class:`CudaBackend` makes: memory, one stream, interprocess events.

    :class:`CupyApi` makes them on a device; unit tests pass a fake, so the bookkeeping above
    runs without a GPU. Streams and events are raw handles (ints).
    """

    def malloc(self, size: int) -> int: ...

    def free(self, ptr: int) -> None: ...

    def export_memory(self, ptr: int) -> bytes: ...

    def create_stream(self) -> int: ...

    def destroy_stream(self, stream: int) -> None: ...

    def create_event(self) -> tuple[int, bytes]: ...

    def create_private_event(self) -> int: ...

    def open_event(self, handle: bytes) -> int: ...

    def destroy_event(self, event: int) -> None: ...

    def record(self, event: int, stream: int) -> None: ...

    def wait(self, stream: int, event: int) -> None: ...

    def synchronize(self, stream: int) -> None: ...

    def copy(self, ptr: int, source: Any, stream: int) -> None: ...

    def copy_range(self, ptr: int, source: int, nbytes: int, stream: int) -> None: ...

    def copy_to_host(self, ptr: int, source: int, nbytes: int, stream: int) -> None: ...

    def write(self, ptr: int, data: bytes) -> None: ...

    def register_host(self, ptr: int, size: int) -> None: ...

    def unregister_host(self, ptr: int) -> None: ...


class CupyApi:
    """:class:`DeviceApi` through CuPy's runtime bindings, on one device from any thread."""

    def __init__(self, device_id: int) -> None:
        import cupy

        self._device = cupy.cuda.Device(device_id)
        self._runtime = cupy.cuda.runtime

    def malloc(self, size: int) -> int:
        with self._device:
            return int(self._runtime.malloc(size))

    def free(self, ptr: int) -> None:
        # cudaFree waits for the device's pending work, the copies into this slab included.
        with self._device:
            self._runtime.free(ptr)

    def export_memory(self, ptr: int) -> bytes:
        with self._device:
            return bytes(self._runtime.ipcGetMemHandle(ptr))

    def create_stream(self) -> int:
        with self._device:
            return int(self._runtime.streamCreateWithFlags(self._runtime.streamNonBlocking))

    def destroy_stream(self, stream: int) -> None:
        # Returns at once; CUDA releases the stream when its pending work is done.
        with self._device:
            self._runtime.streamDestroy(stream)

    def create_event(self) -> tuple[int, bytes]:
        rt = self._runtime
        with self._device:
            event = int(rt.eventCreateWithFlags(rt.eventDisableTiming | rt.eventInterprocess))
            return event, bytes(rt.ipcGetEventHandle(event))

    def create_private_event(self) -> int:
        rt = self._runtime
        with self._device:
            return int(rt.eventCreateWithFlags(rt.eventDisableTiming))

    def open_event(self, handle: bytes) -> int:
        with self._device:
            return int(self._runtime.ipcOpenEventHandle(handle))

    def destroy_event(self, event: int) -> None:
        with self._device:
            self._runtime.eventDestroy(event)

    def record(self, event: int, stream: int) -> None:
        with self._device:
            self._runtime.eventRecord(event, stream)

    def wait(self, stream: int, event: int) -> None:
        with self._device:
            self._runtime.streamWaitEvent(stream, event, 0)

    def synchronize(self, stream: int) -> None:
        with self._device:
            self._runtime.streamSynchronize(stream)

    def copy(self, ptr: int, source: Any, stream: int) -> None:
        """Copies a DALI GPU tensor to ``ptr``, asynchronously on ``stream``."""
        with self._device:
            # ctypes pointers: DALI takes them (a plain int address crashes its CPU twin).
            source.copy_to_external(
                ctypes.c_void_p(ptr), cuda_stream=ctypes.c_void_p(stream), non_blocking=True
            )

    def copy_range(self, ptr: int, source: int, nbytes: int, stream: int) -> None:
        """Copies ``nbytes`` of device memory, asynchronously on ``stream``."""
        with self._device:
            self._runtime.memcpyAsync(
                ptr, source, nbytes, self._runtime.memcpyDeviceToDevice, stream
            )

    def copy_to_host(self, ptr: int, source: int, nbytes: int, stream: int) -> None:
        """Copies ``nbytes`` of device memory at ``source`` to host memory at ``ptr`` (page-locked
        for the copy to be asynchronous), on ``stream``."""
        with self._device:
            self._runtime.memcpyAsync(ptr, source, nbytes, self._runtime.memcpyDeviceToHost, stream)

    def write(self, ptr: int, data: bytes) -> None:
        """Copies ``data`` to device memory at ``ptr``, waiting for the copy."""
        buffer = ctypes.create_string_buffer(data, len(data))
        with self._device:
            self._runtime.memcpy(
                ptr, ctypes.addressof(buffer), len(data), self._runtime.memcpyHostToDevice
            )

    def register_host(self, ptr: int, size: int) -> None:
        """Page-locks host memory (``cudaHostRegister``), a mapping of shared memory included."""
        with self._device:
            self._runtime.hostRegister(ptr, size, 0)

    def unregister_host(self, ptr: int) -> None:
        with self._device:
            self._runtime.hostUnregister(ptr)
