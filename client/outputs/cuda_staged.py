"""GPU outputs without CUDA IPC: the handshake that finds out, and the staged output backend.

A GPU daemon's welcome carries the IPC handle of a probe buffer (``Welcome.ipc_probe``). The
trainer opens it and reads it back (:func:`probe_ipc`), tells the daemon whether it could
(``ipc_probe_result``) and learns the job's output path (:func:`output_path`). Where CUDA IPC
cannot work (a MIG instance, another PID namespace than the daemon's, a GPU this process does not
see), the daemon stages the job's GPU outputs in shared memory, and :class:`StagedOutputs`
uploads them to this process's GPU on its current stream. protocol/SPEC.md, "Outputs", rules
14 to 17 are the contract; this side keeps the trainer's half:

- each slab is mapped once, by name, and page-locked once, so uploads from it are asynchronous;
- a batch's outputs are uploaded on the current stream, which the tensors handed out belong to,
  and no view of the slab leaves this module;
- a region goes back to the daemon once its upload has completed (no fence: the daemon writes it
  again only after the release); slabs are unmapped once no pending upload reads them.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from dalid.protocol import (
    ErrorCode,
    IpcProbeResult,
    OutputDescriptor,
    OutputPath,
    ReleaseRegions,
    slabs,
)

from ..errors import DeviceMismatch, RequestError
from . import cuda_device
from .copies import copied_tensor
from .shm import map_daemon_slab

if TYPE_CHECKING:
    from ..link.link import Link

log = logging.getLogger("dalid.client")

MAX_REASON = 1000

STAGING_COST = (
    "each batch is copied from the GPU into shared memory by the daemon and uploaded to the GPU "
    "here: two PCIe copies a batch (some 3 ms each for 77 MB, 256 images of 3x224x224 float16) "
    "and a host wait in the daemon, where CUDA IPC costs none. CUDA IPC needs the daemon's GPU "
    "visible here, no MIG instance, and the daemon's PID namespace (containers: --pid=host "
    "--ipc=host)"
)


class StagingDevice(Protocol):
    """The CUDA calls :class:`StagedOutputs` makes;
    :class:`~dalid.client.outputs.cuda_device.TorchDevice` on a real GPU."""

    def current_stream(self) -> Any: ...

    def upload(self, host: torch.Tensor, stream: Any = None) -> torch.Tensor: ...

    def marker(self, stream: Any) -> Any: ...

    def done(self, event: Any) -> bool: ...

    def synchronize(self, event: Any) -> None: ...

    def pin(self, ptr: int, size: int) -> bool: ...

    def unpin(self, ptr: int) -> None: ...


# --- the handshake ------------------------------------------------------------------------------

# Probe results of this process, by (pid, GPU UUID, probe handle): each probe is opened once.
_probed: dict[tuple[int, str, str], str] = {}


def probe_ipc(device_uuid: str, handle: str) -> str:
    """Why this process cannot open the daemon's GPU memory by CUDA IPC, or "" where it can: it
    opens the probe ``handle`` of the welcome, reads its 64 bytes back (the handle itself) and
    closes it, once per process and probe."""
    key = (os.getpid(), device_uuid, handle)
    if key not in _probed:
        _probed[key] = _probe(device_uuid, bytes.fromhex(handle))[:MAX_REASON]
    return _probed[key]


def _probe(device_uuid: str, handle: bytes) -> str:
    devices = cuda_device.DEVICES
    if not devices.available():
        return "torch in this process has no CUDA"
    try:
        device = devices.open(devices.local(device_uuid))
    except DeviceMismatch:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        return f"this process does not see the daemon's GPU {device_uuid}{where}"
    try:
        ptr = device.open_memory(handle)
    except Exception as error:
        return f"cudaIpcOpenMemHandle failed: {error}"
    try:
        seen = device.read(ptr, len(handle))
    except Exception as error:
        return f"the probe opened but could not be read: {error}"
    finally:
        try:
            device.close_memory(ptr)
        except Exception as error:
            log.debug("closing the IPC probe failed: %s", error)
    if seen != handle:
        return "the probe handle opened memory that does not hold the daemon's bytes"
    return ""


def output_path(link: Link) -> OutputPath:
    """How the GPU outputs of the daemon on ``link`` reach this process: probes CUDA IPC and
    asks the daemon. A daemon whose welcome offers no probe has no CUDA IPC of its own (a MIG
    instance); an older daemon does not know the question, and delivers by CUDA IPC. Raises
    DeviceMismatch where the daemon refuses a trainer that cannot use CUDA IPC."""
    welcome = link.welcome
    if welcome.ipc_probe:
        reason = probe_ipc(welcome.device_uuid, welcome.ipc_probe)
    else:
        reason = "the daemon offered no CUDA IPC probe"
    try:
        reply = link.request(IpcProbeResult(opened=not reason, reason=reason))
    except RequestError as error:
        if error.code is ErrorCode.UNKNOWN_OPERATION:
            return OutputPath("cuda_ipc")  # a daemon of an older release
        if error.code is ErrorCode.DEVICE_MISMATCH:
            raise DeviceMismatch(str(error)) from None
        raise
    assert isinstance(reply, OutputPath)
    return reply


# --- the backend --------------------------------------------------------------------------------


@dataclass(eq=False)
class _Slab:
    name: str
    map: mmap.mmap
    bytes: np.ndarray | None
    pinned: bool
    reading: int = 0  # uploads from it not yet known to be complete


@dataclass(eq=False)
class _Upload:
    marker: Any
    region_ids: tuple[int, ...]
    slabs: tuple[_Slab, ...]


class StagedOutputs:
    """GPU outputs the daemon staged in shared memory, uploaded to this process's GPU (an
    :class:`~dalid.client.outputs.outputs.OutputBackend`; see the module's docstring).

    ``open_device`` makes the device when the first staged output arrives, which is when the
    one warning naming ``reason`` and the cost is logged. Used from the session's thread.
    """

    # The daemon's copies are done when a batch arrives: there is no event to open.
    events_opened = 0

    def __init__(self, open_device: Callable[[], StagingDevice], reason: str = "") -> None:
        self._open_device = open_device
        self._device: StagingDevice | None = None
        self.reason = reason
        self._pid = os.getpid()
        self._slabs: dict[str, _Slab] = {}
        self._retiring: list[_Slab] = []
        self._uploads: collections.deque[_Upload] = collections.deque()
        self.opened = 0
        self.uploaded = 0

    @classmethod
    def for_daemon(cls, device_uuid: str, reason: str) -> StagedOutputs:
        """The backend for the staged outputs of the daemon on GPU ``device_uuid``: uploads go
        to that GPU where this process sees it, else to its current device. Without CUDA,
        the first staged output raises DeviceMismatch."""
        return cls(lambda: upload_device(device_uuid), reason)

    @property
    def device(self) -> StagingDevice:
        if self._device is None:
            self._device = self._open_device()
            log.warning(
                "dalid: GPU outputs reach this process staged through shared memory, not by "
                "CUDA IPC: %s. The cost: %s",
                self.reason or "the daemon chose so",
                STAGING_COST,
            )
        return self._device

    @property
    def live_regions(self) -> int:
        """Regions whose upload is still running (their release is not yet due)."""
        device = self._device
        return sum(
            len(upload.region_ids)
            for upload in self._uploads
            if device is None or not device.done(upload.marker)
        )

    # --- receiving ----------------------------------------------------------------------------

    def wrap(self, outputs: Sequence[OutputDescriptor], event: str = "") -> list[torch.Tensor]:
        """Copies of the regions of one batch's ``outputs`` on the GPU, uploaded on the current
        stream (``event``: unused). Raises FileNotFoundError for a slab that no longer exists."""
        device = self.device
        stream = device.current_stream()
        tensors = []
        slabs = []
        for descriptor in outputs:
            slab = self._slab(descriptor)
            assert slab.bytes is not None
            region = slab.bytes[descriptor.offset : descriptor.offset + descriptor.nbytes]
            array = region.view(np.dtype(descriptor.dtype)).reshape(descriptor.shape)
            tensors.append(device.upload(torch.from_numpy(array), stream))
            slab.reading += 1
            slabs.append(slab)
        marker = device.marker(stream)
        self._uploads.append(_Upload(marker, tuple(d.region_id for d in outputs), tuple(slabs)))
        self.uploaded += len(outputs)
        return tensors

    def copy(self, output: OutputDescriptor, frame: memoryview) -> torch.Tensor:
        """A private copy of a staged output (protocol/SPEC.md, "Outputs", rule 4) put on the
        GPU on the current stream: the trainer's own, nothing to release."""
        device = self.device
        return device.upload(copied_tensor(output, frame), device.current_stream())

    def _slab(self, descriptor: OutputDescriptor) -> _Slab:
        if descriptor.device != "staged":
            raise ValueError(f"output on {descriptor.device!r} is not a staged GPU output")
        if descriptor.strides:
            raise ValueError("staged outputs are C-contiguous: strides are not expected")
        slab = self._slabs.get(descriptor.slab)
        if slab is None:
            slab = self._map(descriptor.slab, descriptor.slab_size)
            self._slabs[descriptor.slab] = slab
            self.opened += 1
        return slab

    def _map(self, name: str, size: int) -> _Slab:
        # By the same rules as CPU outputs' slabs: a dalid name, this user's file.
        shared = map_daemon_slab(name, size)
        array = np.frombuffer(shared, dtype=np.uint8)
        pinned = self.device.pin(array.ctypes.data, size)
        if not pinned:
            log.debug("slab %s could not be page-locked: uploads from it are synchronous", name)
        return _Slab(name, shared, array, pinned)

    # --- giving back --------------------------------------------------------------------------

    def releases(self) -> list[ReleaseRegions]:
        """The regions whose upload has completed since the last call, as one message."""
        if self._device is None:
            return []
        released: list[int] = []
        pending: collections.deque[_Upload] = collections.deque()
        for upload in self._uploads:
            if self._device.done(upload.marker):
                released.extend(upload.region_ids)
                for slab in upload.slabs:
                    slab.reading -= 1
            else:
                pending.append(upload)
        self._uploads = pending
        self._unmap_unread()
        return [ReleaseRegions(tuple(released))] if released else []

    def retire(self, slabs: Sequence[str]) -> None:
        """Unmaps the slabs the daemon let go of, once no pending upload reads them."""
        for name in slabs:
            slab = self._slabs.pop(name, None)
            if slab is not None:
                self._retiring.append(slab)
        self._unmap_unread()

    def _unmap_unread(self) -> None:
        still = []
        for slab in self._retiring:
            if slab.reading:
                still.append(slab)
            else:
                self._unmap(slab)
        self._retiring = still

    def _unmap(self, slab: _Slab) -> None:
        if slab.bytes is None:
            return
        # Not in a forked child: Note [Slab mappings across fork].
        here = slabs.mapped_here(slab.map)
        if here and slab.pinned and self._device is not None:
            self._device.unpin(slab.bytes.ctypes.data)
        slab.bytes = None
        if here:
            # Nothing else views it: tensors handed out are copies.
            slab.map.close()

    # --- the end ------------------------------------------------------------------------------

    def unmap(self) -> tuple[str, ...]:
        """Waits for the uploads still running (a host wait, at the end of a job only) and
        unmaps every slab; the daemon need keep none. Idempotent."""
        if self._pid != os.getpid():
            return ()
        if self._device is not None:
            for upload in self._uploads:
                self._device.synchronize(upload.marker)
        self._uploads.clear()
        for slab in [*self._slabs.values(), *self._retiring]:
            self._unmap(slab)
        self._slabs, self._retiring = {}, []
        return ()

    def close(self) -> None:
        """Unmaps what ``unmap`` left (nothing, after it). Idempotent."""
        self.unmap()


def upload_device(device_uuid: str) -> StagingDevice:
    """Where staged outputs go: the daemon's GPU where this process sees it, else its current
    device. Raises DeviceMismatch without CUDA."""
    devices = cuda_device.DEVICES
    if devices.available():
        try:
            return devices.open(devices.local(device_uuid))
        except DeviceMismatch:
            return devices.open(devices.current())
    return devices.open(devices.local(device_uuid))  # raises, naming the daemon's GPU
