"""Private copies: a batch delivered outside the job's output memory once the trainer holds it all.

Note [Private copies]
---------------------
A trainer that keeps its outputs and says it takes copies (``private_copies`` in its hello) gets
a batch that finds no room for ``PRIVATE_COPY_AFTER_S`` as a private copy instead of waiting for
ever: CPU outputs as frames of its ``batch_ready``, GPU outputs, where the trainer maps CUDA IPC
and says ``device_copies``, in the job's copy memory (at most ``COPY_BATCHES`` batches, never
waited for; else through the host). Nothing of the job's pool is leased for a copy, and only a
release of the pool's regions ends the copying; a cohort's keeper gets its copies the same way.
A loop that releases its batches never gets one. docs/design/private-copies.md
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from dalid.protocol import OutputDescriptor

from .pool import Region, RegionPool
from .run_output import RunOutput, descriptor, host_descriptor

# How long a batch waits for the trainer to release a region before it goes as a copy.
PRIVATE_COPY_AFTER_S = 1.0
# Batches of GPU outputs a job's copy memory holds at once.
COPY_BATCHES = 2


class DeviceCopies(Protocol):
    """The store that keeps a job's GPU outputs' private copies on the device, in its copy
    memory: ``cuda_store.CudaStore``, for a trainer that maps CUDA IPC."""

    device: str
    copy_pool: RegionPool

    @property
    def stream(self) -> int | None: ...

    def holds(self, output: Any) -> bool: ...

    def copy_regions(self, sizes: Sequence[int]) -> list[Region] | None:
        """Regions of ``sizes`` in the copy memory, all or none; None where it has no room now
        (never waits)."""

    def write_copies(
        self,
        regions: Sequence[Region],
        outputs: Sequence[Any],
        rows: range,
        others: bool,
        source_stream: int | None,
    ) -> str:
        """Copies ``rows`` of each of a run's ``outputs`` into its region, on the job's stream
        (``others``: the batch has outputs elsewhere); the batch's event handle."""

    def copy_from(self, source: DeviceCopies, copies: Sequence[tuple[Region, int]]) -> str:
        """Copies device memory of ``source``'s (each region's bytes from the address paired
        with it) into these regions, on the job's stream after ``source``'s work queued so
        far, and ``source``'s later work after these copies; the batch's event handle."""

    def export(self, region: Region) -> str: ...


class PrivateCopies:
    """Makes a job's batches into private copies (Note [Private copies]): GPU outputs into the
    copy memory of ``on_device`` where the trainer takes them so (``device_copies``, from its
    hello) and it has room now, every other output through the host as a frame."""

    def __init__(self, on_device: DeviceCopies | None = None) -> None:
        # The store (one of the job's) whose copy memory keeps GPU outputs' private copies on
        # the device; None: every copy goes through the host.
        self.on_device = on_device
        self.device_copies = False

    def forget(self, store: object) -> None:
        """``store`` is no longer the job's (staged outputs took its place): their copies go
        through the host anyway."""
        if self.on_device is not None and id(store) == id(self.on_device):
            self.on_device = None

    @property
    def pool(self) -> RegionPool | None:
        """The copy memory, where the job has one."""
        return self.on_device.copy_pool if self.on_device is not None else None

    def of_run(
        self,
        outputs: Sequence[RunOutput],
        rows: range,
        device_of: Callable[[RunOutput], str],
        source_stream: int | None,
    ) -> tuple[tuple[OutputDescriptor, ...], tuple[memoryview, ...], str]:
        """A batch's ``rows`` of a run's outputs as private copies: descriptors, the frame of
        each output, and the batch's event. Those kept on the device name regions of the copy
        memory (``copy``), with empty frames; the others name no slab, their frames hold their
        bytes, and their descriptors the device ``device_of`` each (which may refuse it)."""
        kept, event = self._run_on_device(outputs, rows, source_stream)
        descriptors, frames = [], []
        for index, output in enumerate(outputs):
            kept_here = kept.get(index)
            if kept_here is not None:
                descriptors.append(kept_here)
                frames.append(memoryview(b""))
                continue
            device = device_of(output)
            shape = output.shape_of(rows)
            nbytes = math.prod(shape) * output.itemsize
            frames.append(private_copy(output, rows, nbytes).data)
            descriptors.append(host_descriptor(device, output, shape, nbytes))
        return tuple(descriptors), tuple(frames), event

    def _run_on_device(
        self, outputs: Sequence[RunOutput], rows: range, source_stream: int | None
    ) -> tuple[dict[int, OutputDescriptor], str]:
        """The GPU outputs' private copies written into the copy memory, by output index, and
        the batch's event; none where they go through the host."""
        store = self.on_device
        if store is None or not self.device_copies:
            return {}, ""
        indices = [i for i, output in enumerate(outputs) if store.holds(output.tensors)]
        if not indices:
            return {}, ""
        shapes = [outputs[i].shape_of(rows) for i in indices]
        sizes = [
            math.prod(shape) * outputs[i].itemsize for i, shape in zip(indices, shapes, strict=True)
        ]
        regions = store.copy_regions(sizes)
        if regions is None:
            return {}, ""
        try:
            event = store.write_copies(
                regions,
                [outputs[i] for i in indices],
                rows,
                others=len(indices) < len(outputs),
                source_stream=source_stream,
            )
        except BaseException:
            store.copy_pool.release([region.region_id for region in regions])
            raise
        kept = {
            i: descriptor(store.device, region, outputs[i], shape, store.export(region), copy=True)
            for i, region, shape in zip(indices, regions, shapes, strict=True)
        }
        return kept, event

    def of_regions(
        self,
        source: PrivateCopies,
        source_pool: Callable[[str], RegionPool],
        descriptors: Sequence[OutputDescriptor],
        through_host: Callable[[Sequence[OutputDescriptor]], tuple[memoryview, ...]],
    ) -> tuple[tuple[OutputDescriptor, ...], tuple[memoryview, ...], str]:
        """Regions of another job's memory (a cohort's, still leased: ``source``, whose pool of
        each device ``source_pool`` gives) as copies of this job's, as :meth:`of_run` makes
        them: GPU ones into this job's copy memory, on its stream after ``source``'s, the
        others as the frames ``through_host`` reads."""
        kept, event = self._regions_on_device(source, source_pool, descriptors)
        frames = iter(through_host([d for i, d in enumerate(descriptors) if i not in kept]))
        copied, all_frames = [], []
        for i, d in enumerate(descriptors):
            if i in kept:
                copied.append(kept[i])
                all_frames.append(memoryview(b""))
            else:
                # A copy through the host names no slab, so no GPU slab's IPC handle either.
                copied.append(
                    dataclasses.replace(
                        d, region_id=0, slab="", slab_size=d.nbytes, offset=0, ipc_handle=""
                    )
                )
                all_frames.append(next(frames))
        return tuple(copied), tuple(all_frames), event

    def _regions_on_device(
        self,
        source: PrivateCopies,
        source_pool: Callable[[str], RegionPool],
        descriptors: Sequence[OutputDescriptor],
    ) -> tuple[dict[int, OutputDescriptor], str]:
        """``source``'s GPU regions copied into this job's copy memory, by index, and the
        batch's event; none where they go through the host (as :meth:`_run_on_device`)."""
        store, theirs = self.on_device, source.on_device
        if store is None or theirs is None or not self.device_copies:
            return {}, ""
        on_gpu = [i for i, d in enumerate(descriptors) if d.device == theirs.device]
        if not on_gpu:
            return {}, ""
        regions = store.copy_regions([descriptors[i].nbytes for i in on_gpu])
        if regions is None:
            return {}, ""
        pool = source_pool(theirs.device)
        pairs = [
            (region, pool.address(descriptors[i].region_id) if region.nbytes else 0)
            for i, region in zip(on_gpu, regions, strict=True)
        ]
        try:
            event = store.copy_from(theirs, pairs)
        except BaseException:
            store.copy_pool.release([region.region_id for region in regions])
            raise
        kept = {
            i: dataclasses.replace(
                descriptors[i],
                region_id=region.region_id,
                slab=region.slab.name,
                slab_size=region.slab.size,
                offset=region.offset,
                ipc_handle=store.export(region),
                copy=True,
            )
            for i, region in zip(on_gpu, regions, strict=True)
        }
        return kept, event


def private_copy(output: RunOutput, rows: range, nbytes: int) -> np.ndarray:
    """The bytes of ``rows`` of one output of a run (CPU or GPU) in a new host buffer."""
    if not nbytes:
        return np.empty(0, dtype=np.uint8)
    dense = output.dense()
    if dense is not None:
        # A GPU output comes through the host (as_cpu waits for it); a CPU one is copied once.
        host = dense.as_cpu() if "GPU" in type(dense).__name__ else dense
        return host_copy(host.data_ptr() + rows.start * output.row_bytes(rows), nbytes)
    buffer = np.empty(nbytes, dtype=np.uint8)
    address = buffer.ctypes.data
    for row in rows:
        sample = output.tensors[row]
        sample = sample.as_cpu() if "GPU" in type(sample).__name__ else sample
        sample.copy_to_external(ctypes.c_void_p(address))
        address += output.row_bytes(rows)
    return buffer


def host_copy(address: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of host memory from ``address`` in a new buffer: a private copy's bytes."""
    buffer = np.empty(nbytes, dtype=np.uint8)
    if nbytes:
        ctypes.memmove(buffer.ctypes.data, address, nbytes)
    return buffer
