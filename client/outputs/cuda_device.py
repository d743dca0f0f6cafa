"""This process's CUDA devices as the GPU output backends use them, through torch and CuPy.

:class:`Device` is the calls the backends make (``cuda.py``, ``cuda_staged.py``);
:class:`TorchDevice` makes them on a real GPU. :func:`local_device` finds the daemon's GPU
among this process's, by its UUID. :data:`DEVICES` is what the backends open devices through:
tests put a simulated GPU in its place. torch is imported, but no CUDA call is made until a
device is opened, so CPU-only users never need CUDA.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from dalid.protocol import GpuUnavailable, gpu_uuid

from ..errors import DeviceMismatch


class Device(Protocol):
    """The CUDA calls :class:`CudaOutputs` makes; :class:`TorchDevice` on a real GPU."""

    def open_memory(self, handle: bytes) -> int: ...

    def close_memory(self, ptr: int) -> None: ...

    def current_stream(self) -> Any: ...

    def open_event(self, handle: bytes) -> Any: ...

    def wait(self, stream: Any, event: Any) -> None: ...

    def new_fence(self) -> Any: ...

    def record(self, event: Any, stream: Any) -> None: ...

    def fence_handle(self, event: Any) -> bytes: ...

    def marker(self, stream: Any) -> Any: ...

    def done(self, event: Any) -> bool: ...

    def synchronize(self, event: Any) -> None: ...

    def tensor(self, region: Any) -> torch.Tensor: ...

    def upload(self, host: torch.Tensor, stream: Any = None) -> torch.Tensor: ...

    def copy(self, tensor: torch.Tensor, stream: Any) -> torch.Tensor: ...


class TorchDevice:
    """:class:`Device` on CUDA device ``index`` of this process: memory handles through CuPy
    (torch has no public call for a foreign cudaIpcMemHandle), streams, events and the uploads of
    staged outputs (``cuda_staged.py``) through torch.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.torch_device = torch.device("cuda", index)

    @contextlib.contextmanager
    def _runtime(self) -> Iterator[Any]:
        """CuPy's runtime, with this device current meanwhile. CuPy is imported here: only IPC
        memory needs it, so a trainer that gets staged outputs does without it."""
        import cupy

        with cupy.cuda.Device(self.index):
            yield cupy.cuda.runtime

    def open_memory(self, handle: bytes) -> int:
        with self._runtime() as runtime:
            return int(runtime.ipcOpenMemHandle(handle))

    def close_memory(self, ptr: int) -> None:
        with self._runtime() as runtime:
            runtime.ipcCloseMemHandle(ptr)

    def read(self, ptr: int, nbytes: int) -> bytes:
        """``nbytes`` of device memory at ``ptr``, copied to the host (waits for the copy)."""
        buffer = ctypes.create_string_buffer(nbytes)
        with self._runtime() as runtime:
            runtime.memcpy(ctypes.addressof(buffer), ptr, nbytes, runtime.memcpyDeviceToHost)
        return buffer.raw

    def upload(self, host: torch.Tensor, stream: Any = None) -> torch.Tensor:
        """A copy of the CPU tensor ``host`` on this device, ordered on ``stream`` (default:
        the current stream), without a host wait where ``host`` is page-locked."""
        with torch.cuda.stream(stream if stream is not None else self.current_stream()):
            return host.to(self.torch_device, non_blocking=True)

    def copy(self, tensor: torch.Tensor, stream: Any) -> torch.Tensor:
        """A copy of the device tensor ``tensor`` in memory of this process's own (torch's
        caching allocator, for ``stream``), made on ``stream``: device to device, no host wait."""
        with torch.cuda.stream(stream):
            return tensor.clone()

    def pin(self, ptr: int, size: int) -> bool:
        """Page-locks host memory (``cudaHostRegister``); whether it could."""
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.index):
            return int(cudart.cudaHostRegister(ptr, size, 0)) == 0

    def unpin(self, ptr: int) -> None:
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.index):
            cudart.cudaHostUnregister(ptr)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.torch_device)

    def open_event(self, handle: bytes) -> Any:
        return torch.cuda.Event.from_ipc_handle(self.torch_device, handle)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def new_fence(self) -> Any:
        return torch.cuda.Event(interprocess=True)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def fence_handle(self, event: Any) -> bytes:
        return bytes(event.ipc_handle())

    def marker(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def tensor(self, region: Any) -> torch.Tensor:
        # torch keeps `region` alive for as long as any tensor shares this storage.
        return torch.as_tensor(region, device=self.torch_device)


def pick_device(daemon_uuid: str, uuids: Sequence[str], current: int) -> int:
    """The index among this process's devices (``uuids``) of the daemon's GPU: the current
    device if it is that GPU, else another one that is. Raises :class:`DeviceMismatch`."""
    if 0 <= current < len(uuids) and uuids[current] == daemon_uuid:
        return current
    for index, uuid in enumerate(uuids):
        if uuid == daemon_uuid:
            return index
    here = uuids[current] if 0 <= current < len(uuids) else "no GPU"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    raise DeviceMismatch(
        f"the dalid daemon runs on GPU {daemon_uuid}, which this process cannot see{where}: its "
        f"current device cuda:{current} is {here}, and it sees {len(uuids)} GPUs. GPU outputs "
        "stay on the daemon's GPU: connect to the daemon of your GPU (`dalid serve --device N` "
        "with N its ordinal as the daemon counts), or make the daemon's GPU visible"
    )


def local_device(daemon_uuid: str) -> int:
    """The torch device index of the daemon's GPU in this process (see :func:`pick_device`)."""
    if not torch.cuda.is_available():
        raise DeviceMismatch(
            f"the dalid daemon delivers outputs on GPU {daemon_uuid}, and torch in this process "
            "has no CUDA (torch.cuda.is_available() is False): use a CUDA build of torch, or "
            "move those outputs to the CPU in the pipeline (`.cpu()`)"
        )
    try:
        uuids = [gpu_uuid(index) for index in range(torch.cuda.device_count())]
    except GpuUnavailable as error:
        raise DeviceMismatch(f"cannot tell which GPU this process uses: {error}") from None
    return pick_device(daemon_uuid, uuids, torch.cuda.current_device())


class TorchDevices:
    """This process's CUDA devices as the GPU output backends open them, through torch. The one
    instance is :data:`DEVICES`, which the backends look up when they open a device, so that
    tests can put a simulated GPU in its place."""

    def available(self) -> bool:
        return torch.cuda.is_available()

    def local(self, daemon_uuid: str) -> int:
        """The index of the daemon's GPU here (see :func:`local_device`)."""
        return local_device(daemon_uuid)

    def current(self) -> int:
        return torch.cuda.current_device()

    def open(self, index: int) -> TorchDevice:
        return TorchDevice(index)


DEVICES = TorchDevices()
