"""A job's outputs: its output stores, and the one place a batch's outputs go through.

:class:`JobOutputs` routes each output of a batch to the store (``store.py``) that holds its kind
of memory, applies the trainer's releases, and delivers private copies where the job's memory is
held (``copies.py``); the executor and the daemon core see only :class:`JobOutputs`, never a
store's device. The lifetime contract is Note [Output buffer lifetime] in ``pool.py``, with what
CUDA adds in Note [GPU output lifetime] in ``cuda.py``; the parts both sides rely on are in
SPEC.md ("Outputs").
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Sequence

from dalid.protocol import ErrorCode, Limits, OutputDescriptor

from .copies import DeviceCopies, PrivateCopies
from .delivered import DeliveredBatches
from .pool import PoolTooSmall, Region, RegionPool, SlabUnavailable
from .run_output import OutputFailure, RunOutput, descriptor
from .store import OutputRoute, OutputStore, ReleaseRefused


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
        # How its private copies are made; ``on_device`` is one of ``stores``.
        self.copies = PrivateCopies(on_device)
        # Delivered batches by their leased region ids: what to call once all are released.
        self._delivered = DeliveredBatches()

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
        self.copies.forget(old)
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
            descriptor(store.device, region, output, shape, store.export(region))
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
        return self.copies.of_run(
            outputs, rows, lambda output: self._store_of(output).device, source_stream
        )

    def copies_of(self, descriptors: Sequence[OutputDescriptor]) -> tuple[memoryview, ...]:
        """The bytes of regions of this memory, still leased, as private copies (a GPU region's
        through the host, once the copies queued so far are done): a cohort's outputs for a
        member past its window, or one that cannot map the cohort's GPU memory (Note [Cohort
        outputs] in cohorts.py)."""
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
        through the host (Note [Private copies])."""
        return self.copies.of_regions(
            source.copies,
            lambda device: source.store(device).pool,
            descriptors,
            source.copies_of,
        )

    def when_released(self, region_ids: Sequence[int], released: Callable[[], None]) -> None:
        """Calls ``released`` once the trainer has released every one of ``region_ids`` (a
        delivered batch's; registered before its ``batch_ready`` goes)."""
        self._delivered.add(region_ids, released)

    def _pools(self) -> list[RegionPool]:
        """Every pool of the job's memory: its stores' and the copy memory."""
        pools = [store.pool for store in self.stores]
        if self.copies.pool is not None:
            pools.append(self.copies.pool)
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
        in run_planner.py). Outputs no store takes need none of its memory."""
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
            # queued after this wait (Note [GPU output lifetime]).
            for store in ordered:
                store.fence(fence)
        unknown = list(region_ids)
        for pool in self._pools():
            if unknown:
                unknown = pool.release(unknown)
        if self._delivered:
            self._delivered.released(region_ids)
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
        self._delivered.clear()
        lingering = [store.close(unmap) for store in self.stores]
        return any(lingering)

    def free(self) -> None:
        """Frees everything left, the memory the trainer mapped included. Idempotent."""
        for store in self.stores:
            store.free()

    # --- figures --------------------------------------------------------------------------------

    @property
    def path(self) -> OutputRoute:
        """How the job's outputs reach the trainer: its GPU outputs by CUDA IPC or staged
        (``cuda_staged.py``), or by shared memory where it has CPU outputs only."""
        devices = {store.device for store in self.stores}
        if "staged" in devices:
            return OutputRoute.STAGED
        return OutputRoute.CUDA_IPC if "cuda" in devices else OutputRoute.SHM

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
        """The bytes of the slabs of its copy memory now (Note [Private copies])."""
        pool = self.copies.pool
        return pool.slab_bytes_total if pool is not None else 0

    @property
    def peak_slab_bytes(self) -> int:
        """The most bytes of slabs each pool has held at once, summed over the pools."""
        return sum(pool.peak_slab_bytes for pool in self._pools())


OutputsFactory = Callable[[str, Limits], JobOutputs]
"""outputs(name_prefix, limits): the output stores of a new job, slabs named after the prefix."""
