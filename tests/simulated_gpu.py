"""A GPU simulated in host memory, so that the daemon's GPU output paths run on a machine without
one: a real daemon process, real sockets and real shared memory, with only the CUDA calls
simulated, on both sides.

- The daemon (``python -m tests.simulated_gpu serve ...``, the arguments of ``dalid serve``):
  its CUDA calls (``dalid.server.outputs.cuda_api.CupyApi``) are :class:`SimulatedApi`, whose
  "device memory" is shared-memory segments (``dalid-<pid>-simgpu-<n>``, so the leak checks see
  them) and whose IPC handles are their names; copies are ``memmove``, and streams and events are
  numbers, since every copy is done when it returns. Its GPU is :data:`SIMULATED_UUID`. DALI
  cannot make GPU tensors without a GPU, so pipelines run on the CPU and the first output of
  each run stands for a GPU output (as in ``helpers.gpu_pipeline`` on a real GPU, whose first
  output is computed on the GPU and the second on the CPU). Every copy of "device" memory to
  the host, through the CUDA calls or DALI's ``as_cpu()``, says so in the daemon's log
  (:data:`TO_HOST`), for tests to count.
- The trainer (:class:`SimulatedDevices`, installed as
  ``dalid.client.outputs.cuda_device.DEVICES``): it opens the daemon's "IPC handles" by mapping
  the segments they name, or refuses as CUDA does where IPC cannot work (``ipc=False``), and
  sees the daemon's GPU or not (``sees_daemon``). Tensors it hands out are CPU tensors: views
  of the mapping for CUDA IPC, copies for uploads and device-to-device copies (counted:
  ``uploads``, ``copies``).

What CUDA itself does (streams, events, page-locking, IPC between processes) is tested on a GPU:
tests/integration/test_gpu.py.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

SIMULATED_UUID = "GPU-51a1a7ed-0000-4000-8000-00000000cafe"
TO_HOST = "simulated GPU: device-to-host copy"
"""What the simulated daemon logs for each copy of device memory to the host."""
SHM = Path("/dev/shm")
PAGE = mmap.PAGESIZE
HANDLE_BYTES = 64
_names = itertools.count(1)


def _address(mapping: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(view)
    del view  # the mapping may be closed once no export of it is left
    return address


# --- the daemon's side --------------------------------------------------------------------------


class SimulatedApi:
    """``DeviceApi`` of a GPU whose memory is shared-memory segments (see the module)."""

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self._lock = threading.Lock()
        self._memory: dict[int, tuple[str, mmap.mmap]] = {}
        self._numbers = itertools.count(1)
        self.registered: set[int] = set()

    def malloc(self, size: int) -> int:
        name = f"dalid-{os.getpid()}-simgpu-{next(_names)}"
        fd = os.open(SHM / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, -(-size // PAGE) * PAGE)
            mapping = mmap.mmap(fd, -(-size // PAGE) * PAGE)
        finally:
            os.close(fd)
        ptr = _address(mapping)
        with self._lock:
            self._memory[ptr] = (name, mapping)
        return ptr

    def free(self, ptr: int) -> None:
        with self._lock:
            name, mapping = self._memory.pop(ptr)
        (SHM / name).unlink()
        mapping.close()

    def export_memory(self, ptr: int) -> bytes:
        with self._lock:
            name, _ = self._memory[ptr]
        return name.encode().ljust(HANDLE_BYTES, b"\0")

    def create_stream(self) -> int:
        return next(self._numbers)

    def destroy_stream(self, stream: int) -> None:
        pass

    def create_event(self) -> tuple[int, bytes]:
        event = next(self._numbers)
        return event, f"simevent-{os.getpid()}-{event}".encode().ljust(HANDLE_BYTES, b"\0")

    def create_private_event(self) -> int:
        return next(self._numbers)

    def open_event(self, handle: bytes) -> int:
        return next(self._numbers)

    def destroy_event(self, event: int) -> None:
        pass

    def record(self, event: int, stream: int) -> None:
        pass

    def wait(self, stream: int, event: int) -> None:
        pass

    def synchronize(self, stream: int) -> None:
        pass

    def copy(self, ptr: int, source: Any, stream: int) -> None:
        source.copy_to_external(ctypes.c_void_p(ptr))

    def copy_range(self, ptr: int, source: int, nbytes: int, stream: int) -> None:
        ctypes.memmove(ptr, source, nbytes)

    def copy_to_host(self, ptr: int, source: int, nbytes: int, stream: int) -> None:
        logging.getLogger("dalid.server").info("%s of %d bytes", TO_HOST, nbytes)
        ctypes.memmove(ptr, source, nbytes)

    def write(self, ptr: int, data: bytes) -> None:
        ctypes.memmove(ptr, data, len(data))

    def register_host(self, ptr: int, size: int) -> None:
        assert ptr not in self.registered, "page-locked twice"
        self.registered.add(ptr)

    def unregister_host(self, ptr: int) -> None:
        self.registered.remove(ptr)


class TensorGPU:
    """A DALI CPU tensor standing for a GPU one (a dense GPU output, ``as_tensor()``): what the
    output stores read of it; ``as_cpu()`` is a device-to-host copy, logged."""

    def __init__(self, tensor: Any) -> None:
        self._tensor = tensor

    def shape(self) -> Any:
        return self._tensor.shape()

    def data_ptr(self) -> int:
        return int(self._tensor.data_ptr())

    def copy_to_external(self, ptr: Any, **kw: Any) -> None:
        self._tensor.copy_to_external(ptr)

    def as_cpu(self) -> Any:
        nbytes = int(np.prod(self._tensor.shape())) * np.dtype(self._tensor.dtype()).itemsize
        logging.getLogger("dalid.server").info("%s of %d bytes", TO_HOST, nbytes)
        return self._tensor


class TensorListGPU:
    """A DALI CPU TensorList standing for a GPU one: what the output stores read of it."""

    def __init__(self, tensors: Any) -> None:
        self._tensors = tensors
        self.dtype = tensors.dtype

    def shape(self) -> Any:
        return self._tensors.shape()

    def layout(self) -> Any:
        return self._tensors.layout()

    def is_dense_tensor(self) -> bool:
        return bool(self._tensors.is_dense_tensor())

    def as_tensor(self) -> TensorGPU:
        return TensorGPU(self._tensors.as_tensor())

    def __getitem__(self, index: int) -> Any:
        return self._tensors[index]


def _simulate_daemon() -> None:
    """Puts the simulated GPU in the daemon's place of CUDA (see the module)."""
    import dalid.server.intake.daemon
    import dalid.server.outputs.cuda_api
    from dalid.server.pipelines.runner import PipelineRunner

    dalid.server.outputs.cuda_api.CupyApi = SimulatedApi  # type: ignore[misc,assignment]
    dalid.server.intake.daemon.gpu_uuid = lambda ordinal: SIMULATED_UUID  # type: ignore[attr-defined]
    build, collect = PipelineRunner.__init__, PipelineRunner.collect

    def cpu_build(self: PipelineRunner, spec: Any, _device: Any, *args: Any, **kw: Any) -> None:
        build(self, spec, None, *args, **kw)

    def gpu_first(self: PipelineRunner, cuda_stream: int | None = None) -> tuple[Any, ...]:
        first, *others = collect(self, None)
        return (TensorListGPU(first), *others)

    PipelineRunner.__init__ = cpu_build  # type: ignore[method-assign,assignment]
    PipelineRunner.collect = gpu_first  # type: ignore[method-assign]


def serve(argv: Sequence[str]) -> int:
    """``dalid serve`` on the simulated GPU."""
    _simulate_daemon()
    from dalid.server.operations.cli import main

    return main(list(argv))


# --- the trainer's side -------------------------------------------------------------------------


@dataclass(frozen=True)
class SimulatedStream:
    cuda_stream: int = 1
    device_index: int = 0


@dataclass(eq=False)
class SimulatedEvent:
    handle: bytes = b""


class _HostView:
    """A GPU region (``__cuda_array_interface__``) as numpy sees host memory, holding the region
    as torch would."""

    def __init__(self, region: Any) -> None:
        self.region = region
        self.__array_interface__ = dict(region.__cuda_array_interface__)


@dataclass
class SimulatedDevice:
    """The trainer's calls to the simulated GPU (``Device`` and ``StagingDevice``)."""

    ipc: bool = True
    refusal: str = "cudaErrorNotSupported: operation not supported (simulated)"
    mapped: dict[int, mmap.mmap] = field(default_factory=dict)
    # The daemon's segment each mapping is of (its "IPC handle"), by address.
    names: dict[int, str] = field(default_factory=dict)
    pinned: set[int] = field(default_factory=set)
    uploads: int = 0
    copies: int = 0
    _fences: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def open_memory(self, handle: bytes) -> int:
        if not self.ipc:
            raise RuntimeError(self.refusal)
        name = handle.rstrip(b"\0").decode()
        fd = os.open(SHM / name, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        ptr = _address(mapping)
        self.mapped[ptr] = mapping
        self.names[ptr] = name
        return ptr

    def close_memory(self, ptr: int) -> None:
        self.names.pop(ptr)
        self.mapped.pop(ptr).close()

    def region_of(self, tensor: torch.Tensor) -> tuple[str, int]:
        """Which of the daemon's device memory a tensor views: (the slab's handle, offset).
        Two trainers' tensors with the same answer view one region, neither a copy."""
        address = tensor.data_ptr()
        for ptr, mapping in self.mapped.items():
            if ptr <= address < ptr + len(mapping):
                return self.names[ptr], address - ptr
        raise ValueError("the tensor views none of the daemon's memory: it is a copy")

    def read(self, ptr: int, nbytes: int) -> bytes:
        return ctypes.string_at(ptr, nbytes)

    def current_stream(self) -> Any:
        return SimulatedStream()

    def open_event(self, handle: bytes) -> Any:
        return SimulatedEvent(handle)

    def wait(self, stream: Any, event: Any) -> None:
        pass

    def new_fence(self) -> Any:
        return SimulatedEvent(f"simfence-{os.getpid()}-{next(self._fences)}".encode())

    def record(self, event: Any, stream: Any) -> None:
        pass

    def fence_handle(self, event: Any) -> bytes:
        return bytes(event.handle.ljust(HANDLE_BYTES, b"\0"))

    def marker(self, stream: Any) -> Any:
        return SimulatedEvent()

    def done(self, event: Any) -> bool:
        return True

    def synchronize(self, event: Any) -> None:
        pass

    def tensor(self, region: Any) -> torch.Tensor:
        return torch.from_numpy(np.asarray(_HostView(region)))

    def upload(self, host: torch.Tensor, stream: Any = None) -> torch.Tensor:
        self.uploads += 1
        return host.clone()

    def copy(self, tensor: torch.Tensor, stream: Any) -> torch.Tensor:
        self.copies += 1
        return tensor.clone()

    def pin(self, ptr: int, size: int) -> bool:
        self.pinned.add(ptr)
        return True

    def unpin(self, ptr: int) -> None:
        self.pinned.remove(ptr)


@dataclass
class SimulatedDevices:
    """The trainer's GPUs: one, the simulated daemon's GPU unless ``sees_daemon`` is false
    (then another one). Install as ``dalid.client.outputs.cuda_device.DEVICES``."""

    ipc: bool = True
    sees_daemon: bool = True
    opened: list[SimulatedDevice] = field(default_factory=list)

    def available(self) -> bool:
        return True

    def local(self, daemon_uuid: str) -> int:
        from dalid.client.errors import DeviceMismatch

        if daemon_uuid != SIMULATED_UUID or not self.sees_daemon:
            raise DeviceMismatch(f"this process does not see GPU {daemon_uuid}")
        return 0

    def current(self) -> int:
        return 0

    def open(self, index: int) -> SimulatedDevice:
        device = SimulatedDevice(ipc=self.ipc)
        self.opened.append(device)
        return device


def install_trainer(ipc: bool = True) -> SimulatedDevices:
    """This trainer process's GPUs: the simulated daemon's (a job process of the tests)."""
    from dalid.client.outputs import cuda_device

    devices = SimulatedDevices(ipc=ipc)
    cuda_device.DEVICES = devices  # type: ignore[assignment]
    return devices


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
