"""Where a job's batch outputs go: the output-backend interface and a job's set of stores.

A job has one :class:`OutputStore` per kind of memory the daemon delivers outputs in: POSIX
shared memory for CPU outputs (``shm.py``) and, on a GPU daemon, device memory exported through
CUDA IPC for GPU outputs (``cuda.py``). A store carves regions out of slabs it creates and
exports once (a :class:`~dalid.server.outputs.pool.RegionPool` over its slab backend), copies DALI
outputs into them, and takes them back when the trainer releases them. :class:`JobOutputs` routes
each output of a batch to the store that holds its kind of memory; the executor and the daemon core
see only :class:`JobOutputs`, never a store's device.

The lifetime contract is Note [Output buffer lifetime] in ``pool.py``, with what CUDA adds in
Note [GPU output lifetime] in ``cuda.py``; the parts both sides rely on are in SPEC.md
("Outputs").

Why one module of some 680 lines: the store interface, the job's stores and a run's outputs
are the one boundary between the executor and output memory, private copies included (a batch
that finds no room goes out through the same stores, into their copy memory or as frames).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from dalid.protocol import ErrorCode, Limits, OutputDescriptor

from .copies import DeviceCopies, private_copy
from .pool import PoolTooSmall, Region, RegionPool, SlabUnavailable


class _LeasedBatch:
    """A delivered batch's regions still leased, and what to call when none is."""

    __slots__ = ("released", "remaining")

    def __init__(self, remaining: int, released: Callable[[], None]) -> None:
        self.remaining = remaining
        self.released = released


class OutputFailure(Exception):
    """A batch whose outputs cannot be delivered; ``code`` says why."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ReleaseRefused(ValueError):
    """A release the job's stores cannot apply (a fence for memory that takes none, say)."""


class OutputStore(Protocol):
    """One job's output memory of one kind, and how DALI outputs get into it.

    ``device`` is what descriptors of its regions say ("cpu", "cuda", "staged"); ``takes`` the
    DALI outputs it holds ("cpu" or "cuda": DALI's CPU or GPU TensorLists). ``stream`` is the CUDA
    stream the store writes on, on which DALI may hand outputs over (None: the host).
    ``peer_ordered``: releases of its regions come with the trainer's fence, and its slabs are
    freed only once the trainer reports them unmapped (device memory; Note [GPU output
    lifetime]). Only such a store is given fences and unmapped slabs.
    """

    device: str
    takes: str
    pool: RegionPool
    peer_ordered: bool

    @property
    def stream(self) -> int | None: ...

    def holds(self, output: Any) -> bool:
        """Whether a DALI output (a TensorList) lies in this store's kind of memory."""

    def prepare(self, others: bool, source_stream: int | None) -> None:
        """Called before a batch's outputs are copied; ``others``: some go to other stores.
        ``source_stream``: the stream DALI handed the outputs over on (None: the host)."""

    def write(self, region: Region, output: RunOutput, rows: range) -> None:
        """Copies ``rows`` of one output of a run into ``region``."""

    def export(self, region: Region) -> str:
        """The handle a descriptor of ``region`` carries ("" where the slab name is enough);
        from then on the trainer may map its slab."""

    def read(self, address: int, nbytes: int) -> np.ndarray:
        """``nbytes`` at ``address`` of one of its regions, in a new host buffer (a private
        copy of a region still leased: ``JobOutputs.copies_of``)."""

    def finish(self, wrote: bool, source_stream: int | None) -> str:
        """Called once a batch's outputs are copied; the batch's event handle, or ""."""

    def fence(self, event: str) -> None:
        """Later writes wait for the trainer's release fence ``event`` (hex); raises
        ReleaseRefused for one that cannot be used."""

    def peer_unmapped(self, slabs: Sequence[str]) -> None:
        """The trainer reports these slabs unmapped."""

    def peer_leaving(self, kept: Sequence[str]) -> None:
        """The trainer, ending its job, still maps ``kept`` and has unmapped every other slab."""

    def close(self, unmap: bool) -> bool:
        """Closes the pool (``unmap=False``: a writer could not be stopped); whether memory is
        left that the trainer still maps, which :meth:`free` frees once it is gone."""

    def free(self) -> None:
        """Frees everything left. Idempotent."""


class JobOutputs:
    """A job's output stores: writes a batch's outputs, applies releases, frees at the end.

    Thread-safe as its stores are: executors write from their threads while the I/O thread
    releases. Region ids come from one sequence, so an id names one region of the job whatever
    its store.
    """

    def __init__(
        self, stores: Sequence[OutputStore], on_device: DeviceCopies | None = None
    ) -> None:
        self.stores = tuple(stores)
        self.closed = False
        # How long a batch waits for memory before it goes as a private copy; None: it waits
        # for ever (a trainer that takes no copies). Note [Private copies] in copies.py.
        self.copy_after: float | None = None
        # The store (one of ``stores``) whose copy memory keeps GPU outputs' private copies on
        # the device, and whether the trainer takes them so (``hello.device_copies``).
        self.on_device = on_device
        self.device_copies = False
        # Delivered batches by their leased region ids: what to call once all are released.
        self._batches: dict[int, _LeasedBatch] = {}
        self._batches_lock = threading.Lock()

    @property
    def stream(self) -> int | None:
        """The stream DALI may hand outputs over on (None: outputs are ready on the host)."""
        return next((store.stream for store in self.stores if store.stream is not None), None)

    def store(self, device: str) -> OutputStore:
        """The store of ``device``'s memory (KeyError if the job has none)."""
        for store in self.stores:
            if store.device == device:
                return store
        raise KeyError(device)

    def replace(self, device: str, store: OutputStore) -> OutputStore:
        """Puts ``store`` in the place of the store of ``device`` memory, which must not have
        made a slab yet (a trainer's handshake chose how GPU outputs reach it: ``cuda_staged.py``);
        returns the store replaced, for the caller to close."""
        old = self.store(device)
        if old.pool.slab_count:
            raise ValueError(f"the job's {device} outputs are in use already")
        self.stores = tuple(store if s is old else s for s in self.stores)
        if self.on_device is not None and id(old) == id(self.on_device):
            self.on_device = None  # staged outputs' copies go through the host anyway
        return old

    # --- a batch ------------------------------------------------------------------------------

    def write_batch(
        self,
        outputs: Sequence[RunOutput],
        rows: range,
        *,
        source_stream: int | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        wait: bool = True,
    ) -> tuple[tuple[OutputDescriptor, ...], str]:
        """Copies a batch's ``rows`` of a run's outputs into fresh regions; their descriptors
        and the batch event.

        Blocks while the job's memory is full (backpressure), or with ``copy_after`` set, for
        that long at most, then raises PoolFull (deliver :meth:`private_copies` instead); with
        ``wait`` false and ``copy_after`` set, raises PoolFull at once instead of waiting (a
        pipeline other jobs share must not wait for one job's trainer).
        Raises :class:`OutputFailure` for outputs that cannot be delivered, and PoolClosed when
        the job ends meanwhile. On return the regions are leased to the trainer (Note [Output
        buffer lifetime]).
        """
        shapes = [output.shape_of(rows) for output in outputs]
        stores = [self._store_of(output) for output in outputs]
        sizes = [
            math.prod(shape) * output.itemsize
            for shape, output in zip(shapes, outputs, strict=True)
        ]
        give_up_after = self.copy_after
        if not wait and give_up_after is not None:
            give_up_after = 0.0
        regions = self._allocate(stores, sizes, cancelled, give_up_after)
        try:
            used = {id(store) for store in stores}
            for store in self.stores:
                store.prepare(others=bool(used - {id(store)}), source_stream=source_stream)
            for store, region, output in zip(stores, regions, outputs, strict=True):
                if region.nbytes:
                    store.write(region, output, rows)
            events = [
                store.finish(id(store) in used, source_stream=source_stream)
                for store in self.stores
            ]
        except Exception:
            self._release_regions(regions)
            raise
        descriptors = tuple(
            _descriptor(store.device, region, output, shape, store.export(region))
            for store, region, output, shape in zip(stores, regions, outputs, shapes, strict=True)
        )
        return descriptors, next((event for event in events if event), "")

    def private_copies(
        self, outputs: Sequence[RunOutput], rows: range, *, source_stream: int | None = None
    ) -> tuple[tuple[OutputDescriptor, ...], tuple[memoryview, ...], str]:
        """A batch's ``rows`` of a run's outputs as private copies: descriptors, the frame of
        each output, and the batch's event (Note [Private copies] in copies.py). GPU outputs
        stay on the device where the trainer takes them so and the copy memory has room: their
        descriptors name regions of it (``copy``), with empty frames; the others name no slab,
        and their frames hold their bytes. ``source_stream``: as for :meth:`write_batch`."""
        kept, event = self._copies_on_device(outputs, rows, source_stream)
        descriptors, frames = [], []
        for index, output in enumerate(outputs):
            descriptor = kept.get(index)
            if descriptor is not None:
                descriptors.append(descriptor)
                frames.append(memoryview(b""))
                continue
            store = self._store_of(output)
            shape = output.shape_of(rows)
            nbytes = math.prod(shape) * output.itemsize
            frames.append(private_copy(output, rows, nbytes).data)
            descriptors.append(_host_copy(store.device, output, shape, nbytes))
        return tuple(descriptors), tuple(frames), event

    def _copies_on_device(
        self, outputs: Sequence[RunOutput], rows: range, source_stream: int | None
    ) -> tuple[dict[int, OutputDescriptor], str]:
        """The GPU outputs' private copies written into the copy memory, by output index, and
        the batch's event; none where they go through the host (point 2 of the note)."""
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
            i: _descriptor(store.device, region, outputs[i], shape, store.export(region), copy=True)
            for i, region, shape in zip(indices, regions, shapes, strict=True)
        }
        return kept, event

    def copies_of(self, descriptors: Sequence[OutputDescriptor]) -> tuple[memoryview, ...]:
        """The bytes of regions of this memory, still leased, as private copies (a GPU region's
        through the host, once the copies queued so far are done): a cohort's outputs for a
        member past its window, or one that cannot map the cohort's GPU memory (Note [Cohort
        outputs], points 4 and 6, in cohorts.py)."""
        copies = []
        for d in descriptors:
            store = self.store(d.device)
            address = store.pool.address(d.region_id) if d.nbytes else 0
            copies.append(store.read(address, d.nbytes).data)
        return tuple(copies)

    def copies_from(
        self, source: JobOutputs, descriptors: Sequence[OutputDescriptor]
    ) -> tuple[tuple[OutputDescriptor, ...], tuple[memoryview, ...], str]:
        """``source``'s regions (a cohort's, still leased) as this job's private copies, as
        :meth:`private_copies` makes them: GPU ones into this job's copy memory, on its stream
        after ``source``'s, where the trainer takes them so and it has room, the others
        through the host (Note [Private copies], point 7)."""
        kept, event = self._copied_on_device(source, descriptors)
        through_host = [d for i, d in enumerate(descriptors) if i not in kept]
        frames = iter(source.copies_of(through_host))
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

    def _copied_on_device(
        self, source: JobOutputs, descriptors: Sequence[OutputDescriptor]
    ) -> tuple[dict[int, OutputDescriptor], str]:
        """``source``'s GPU regions copied into this job's copy memory, by index, and the
        batch's event; none where they go through the host (as :meth:`_copies_on_device`)."""
        store, theirs = self.on_device, source.on_device
        if store is None or theirs is None or not self.device_copies:
            return {}, ""
        on_gpu = [i for i, d in enumerate(descriptors) if d.device == theirs.device]
        if not on_gpu:
            return {}, ""
        regions = store.copy_regions([descriptors[i].nbytes for i in on_gpu])
        if regions is None:
            return {}, ""
        pool = source.store(theirs.device).pool
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

    def when_released(self, region_ids: Sequence[int], released: Callable[[], None]) -> None:
        """Calls ``released`` once the trainer has released every one of ``region_ids`` (a
        delivered batch's; registered before its ``batch_ready`` goes)."""
        batch = _LeasedBatch(len(region_ids), released)
        with self._batches_lock:
            for region_id in region_ids:
                self._batches[region_id] = batch

    def _batches_released(self, region_ids: Sequence[int]) -> None:
        done = []
        with self._batches_lock:
            for region_id in region_ids:
                batch = self._batches.pop(region_id, None)
                if batch is not None:
                    batch.remaining -= 1
                    if not batch.remaining:
                        done.append(batch.released)
        for released in done:
            released()

    def _pools(self) -> list[RegionPool]:
        """Every pool of the job's memory: its stores' and the copy memory."""
        pools = [store.pool for store in self.stores]
        if self.on_device is not None:
            pools.append(self.on_device.copy_pool)
        return pools

    def take_retired(self) -> tuple[str, ...]:
        """Slabs freed since the last call, for the trainer to unmap."""
        return tuple(name for pool in self._pools() for name in pool.take_retired())

    def has_room(self, sizes: Sequence[tuple[str, int]]) -> bool:
        """Whether outputs of these (DALI device, bytes) would fit now, without waiting."""
        for store in self.stores:
            wanted = [size for device, size in sizes if device == store.takes]
            if wanted and not store.pool.has_room(wanted):
                return False
        return True

    def batches_fit(self, sizes: Sequence[tuple[str, int]]) -> int:
        """How many batches of outputs of these (DALI device, bytes) the job's memory could hold
        at once (``RegionPool.sets_fit``): its window may hold no more (Note [A job's window]
        in run_planner.py, point 7). Outputs no store takes need none of its memory."""
        fits = sys.maxsize
        for store in self.stores:
            wanted = [size for device, size in sizes if device == store.takes]
            if wanted:
                fits = min(fits, store.pool.sets_fit(wanted))
        return fits

    def _store_of(self, output: RunOutput) -> OutputStore:
        for store in self.stores:
            if store.holds(output.tensors):
                return store
        served = " and ".join(store.device.upper() for store in self.stores)
        raise OutputFailure(
            ErrorCode.INVALID_OUTPUT,
            f"output {output.index} is on the GPU, and this daemon delivers {served} outputs only",
        )

    def _allocate(
        self,
        stores: list[OutputStore],
        sizes: list[int],
        cancelled: Callable[[], bool],
        give_up_after: float | None,
    ) -> list[Region]:
        """One region per output, from the pool of its store; all or none."""
        by_store: dict[int, Iterator[Region]] = {}
        taken: list[Region] = []
        try:
            for store in self.stores:
                wanted = [size for size, s in zip(sizes, stores, strict=True) if s is store]
                if wanted:
                    regions = store.pool.allocate(
                        wanted, cancelled=cancelled, give_up_after=give_up_after
                    )
                    taken.extend(regions)
                    by_store[id(store)] = iter(regions)
        except (PoolTooSmall, SlabUnavailable) as error:
            self._release_regions(taken)
            raise OutputFailure(ErrorCode.RESOURCE_EXHAUSTED, str(error)) from None
        except BaseException:
            self._release_regions(taken)
            raise
        return [next(by_store[id(store)]) for store in stores]

    def _release_regions(self, regions: Sequence[Region]) -> None:
        self.release([region.region_id for region in regions])

    # --- the trainer's releases -----------------------------------------------------------------

    def release(
        self, region_ids: Sequence[int], fence: str = "", closed_slabs: Sequence[str] = ()
    ) -> list[int]:
        """Takes back regions the trainer released, after its ``fence`` (a release event's
        hex handle, for device memory), and notes the slabs it reports unmapped; returns the
        ids that were not leased. Raises ReleaseRefused for a fence or slabs no store takes."""
        ordered = [store for store in self.stores if store.peer_ordered]
        if (fence or closed_slabs) and not ordered:
            raise ReleaseRefused(
                "event and closed_slabs are for GPU outputs, and this daemon delivers CPU "
                "outputs only"
            )
        if fence:
            # Before the regions go back to their pools: every later write into them is
            # queued after this wait (Note [GPU output lifetime], point 4).
            for store in ordered:
                store.fence(fence)
        unknown = list(region_ids)
        for pool in self._pools():
            if unknown:
                unknown = pool.release(unknown)
        if self._batches:
            self._batches_released(region_ids)
        if closed_slabs:
            for store in ordered:
                store.peer_unmapped(closed_slabs)
        return unknown

    def peer_leaving(self, kept_slabs: Sequence[str]) -> None:
        """The trainer's goodbye: it still maps ``kept_slabs``, and no other slab."""
        for store in self.stores:
            if store.peer_ordered:
                store.peer_leaving(kept_slabs)

    # --- the end --------------------------------------------------------------------------------

    def close(self, unmap: bool = True) -> bool:
        """Closes every pool; whether memory is left that the trainer still maps (call
        :meth:`free` once its process is gone). Idempotent."""
        if self.closed:
            return False
        self.closed = True
        with self._batches_lock:
            self._batches.clear()
        lingering = [store.close(unmap) for store in self.stores]
        return any(lingering)

    def free(self) -> None:
        """Frees everything left, the memory the trainer mapped included. Idempotent."""
        for store in self.stores:
            store.free()

    # --- figures --------------------------------------------------------------------------------

    @property
    def path(self) -> str:
        """How the job's GPU outputs reach the trainer, "cuda_ipc" or "staged" (``cuda_staged.py``);
        "shm" where the job has CPU outputs only."""
        devices = {store.device for store in self.stores}
        return "staged" if "staged" in devices else "cuda_ipc" if "cuda" in devices else "shm"

    @property
    def leased_regions(self) -> int:
        return sum(pool.leased_regions for pool in self._pools())

    @property
    def leased_bytes(self) -> int:
        return sum(pool.leased_bytes for pool in self._pools())

    @property
    def slab_count(self) -> int:
        return sum(pool.slab_count for pool in self._pools())

    @property
    def slab_bytes(self) -> int:
        """The bytes of the job's slabs now, of every kind of memory, the copy memory's too."""
        return sum(pool.slab_bytes_total for pool in self._pools())

    @property
    def copy_slab_bytes(self) -> int:
        """The bytes of the slabs of its copy memory now (Note [Private copies], point 2)."""
        return self.on_device.copy_pool.slab_bytes_total if self.on_device is not None else 0

    @property
    def peak_slab_bytes(self) -> int:
        """The most bytes of slabs each pool has held at once, summed over the pools."""
        return sum(pool.peak_slab_bytes for pool in self._pools())


class RunOutput:
    """One output of a run (a DALI TensorList), read once for all the jobs that get rows of it.

    A run of a shared pipeline holds the samples of several jobs' batches; each job's rows of
    each output go to that job's memory (``JobOutputs.write_batch``).
    """

    def __init__(self, index: int, tensors: Any) -> None:
        self.index = index
        self.tensors = tensors
        self._dense: Any = None
        # The one shape of every sample, where they have one (None: they differ).
        self._sample_shape: tuple[int, ...] | None = None
        # A dense output (every sample of one shape, the common case) tells its shape at once,
        # and no more is made of it, per run or per sample. Otherwise one row of extents per
        # sample, as an array: the checks below are numpy operations on the whole run, not a
        # Python step per sample (DALI's shape() makes a tuple per sample).
        self._shapes: np.ndarray | None = None
        if tensors.is_dense_tensor():
            self._dense = tensors.as_tensor()
            samples, *shape = self._dense.shape()
            self._samples: int = samples
            self._sample_shape = tuple(shape)
        else:
            shapes = tensors.shape()
            ndim = len(shapes[0]) if shapes else 0
            self._shapes = np.array(shapes, np.int64).reshape(len(shapes), ndim)
            self._samples = len(shapes)
        self.dtype = _dtype_name(tensors.dtype)
        self.itemsize = np.dtype(self.dtype).itemsize
        self.layout = tensors.layout() or ""

    @property
    def samples(self) -> int:
        return self._samples

    def shape_of(self, rows: range) -> tuple[int, ...]:
        """The shape of ``rows`` as one tensor; rows of different shapes cannot be one."""
        if self._sample_shape is not None:
            return (len(rows), *self._sample_shape)
        assert self._shapes is not None
        selected = self._shapes[rows.start : rows.stop]
        if len(selected) and not (selected == selected[0]).all():
            shown = [tuple(shape) for shape in selected[:4].tolist()]
            raise OutputFailure(
                ErrorCode.INVALID_OUTPUT,
                f"output {self.index} has samples of different shapes ({shown}...): "
                "a batch is delivered as one tensor, so resize, crop or pad to one shape",
            )
        return (len(selected), *(selected[0].tolist() if len(selected) else ()))

    @property
    def whole(self) -> range:
        return range(self._samples)

    def dense(self) -> Any:
        """The whole output as one contiguous DALI tensor, or None if its samples differ."""
        if self._dense is None and self.tensors.is_dense_tensor():
            self._dense = self.tensors.as_tensor()
        return self._dense

    def row_bytes(self, rows: range) -> int:
        """Bytes of one of ``rows`` (rows of one shape)."""
        if self._sample_shape is not None:
            return math.prod(self._sample_shape) * self.itemsize if rows else 0
        assert self._shapes is not None
        return math.prod(self._shapes[rows.start].tolist()) * self.itemsize if rows else 0


def _descriptor(
    device: str,
    region: Region,
    output: RunOutput,
    shape: tuple[int, ...],
    ipc_handle: str,
    *,
    copy: bool = False,
) -> OutputDescriptor:
    """The descriptor of one output written into ``region``."""
    return OutputDescriptor(
        region_id=region.region_id,
        slab=region.slab.name,
        slab_size=region.slab.size,
        offset=region.offset,
        nbytes=region.nbytes,
        dtype=output.dtype,
        shape=shape,
        layout=output.layout,
        device=device,
        ipc_handle=ipc_handle,
        copy=copy,
    )


def _host_copy(
    device: str, output: RunOutput, shape: tuple[int, ...], nbytes: int
) -> OutputDescriptor:
    """The descriptor of an output whose private copy travels as a frame: it names no slab."""
    return OutputDescriptor(
        region_id=0,
        slab="",
        slab_size=nbytes,
        offset=0,
        nbytes=nbytes,
        dtype=output.dtype,
        shape=shape,
        layout=output.layout,
        device=device,
    )


OutputsFactory = Callable[[str, Limits], JobOutputs]
"""outputs(name_prefix, limits): the output stores of a new job, slabs named after the prefix."""


class Stream(Protocol):
    """A CUDA stream that a pipeline shared by several jobs hands its outputs over on; each
    job's store orders its copies after it (``prepare``) and it after them (``finish``)."""

    handle: int

    def close(self) -> None: ...


StreamFactory = Callable[[], "Stream | None"]
"""A new stream for a shared pipeline; None where outputs are ready on the host (CPU daemon)."""


def no_streams() -> Stream | None:
    """The stream factory of a CPU daemon: DALI hands outputs over on the host."""
    return None


def region_ids() -> Iterator[int]:
    """One sequence of region ids for all the stores of a job."""
    return itertools.count(1)


_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dali_dtype: Any) -> str:
    """The numpy name of a DALI dtype (looked up once per dtype: every run asks)."""
    name = _DTYPE_NAMES.get(dali_dtype)
    if name is None:
        from nvidia.dali.types import to_numpy_type

        name = _DTYPE_NAMES[dali_dtype] = np.dtype(to_numpy_type(dali_dtype)).name
    return name
