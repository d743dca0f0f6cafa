"""A torch DataLoader whose batches come out with dalid references replaced by tensors."""

from __future__ import annotations

import collections
import gc
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from torch.utils import data as torchdata

from .badsamples import SampleReport
from .worker.carry import CarryingCollate


class Producer(Protocol):
    def produce_data(self, obj: Any) -> Any: ...


class _RecordingSampler:
    """The loader's batch sampler, noting each batch of indices it gives, in order."""

    def __init__(self, inner: Iterable[Any]) -> None:
        self.inner = inner
        self.given: collections.deque[list[int]] = collections.deque()

    def __iter__(self) -> Iterator[Any]:
        for indices in self.inner:
            self.given.append(list(indices))
            yield indices

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


class _ProducingIterator:
    """Wraps torch's loader iterator; each batch goes through ``produce_data`` on its way out,
    named by its step (as ``enumerate(loader)`` counts) and its dataset indices."""

    def __init__(self, inner: Iterator[Any], loader: DataLoader) -> None:
        self._inner = inner
        self._loader = loader
        self._step = 0

    def __iter__(self) -> _ProducingIterator:
        return self

    def __next__(self) -> Any:
        step = self._step
        try:
            batch = next(self._inner)
        except StopIteration:
            raise
        except BaseException:
            self._step += 1
            self._loader._batch_indices()  # that batch's indices, so the next batch gets its own
            raise
        self._step += 1
        indices = self._loader._batch_indices()
        producer = self._loader.session
        produce = getattr(producer, "produce", None)
        if produce is None:  # a producer of DALI's own kind: no steps, no indices
            return producer.produce_data(batch)
        produced = produce(batch, step=step, indices=indices)
        self._loader.bad_samples.extend(getattr(producer, "last_bad_samples", []))
        return produced

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]


class _FrozenHeap:
    """A DataLoader worker's ``worker_init_fn``: freezes the heap the worker inherited before
    running the user's own (``inner``).

    A forked worker shares its trainer's pages until it writes to them, and a full garbage
    collection writes to every object it walks: the worker's first one copies nearly all the
    trainer's heap (torch's and DALI's imports, some 50 MiB), once per worker. Frozen, those
    objects are left alone by the worker's collections (the worker's own still go), so its
    pages stay shared. Frozen objects that become cyclic garbage in the worker are not
    collected: the worker lives an epoch (or as long as the loader, persistent), and they are
    the trainer's, shared. In a spawned worker it freezes what it imported: as long-lived.
    """

    def __init__(self, inner: Callable[[int], None] | None) -> None:
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        gc.freeze()
        if self.inner is not None:
            self.inner(worker_id)


class DataLoader(torchdata.DataLoader[Any]):
    """``torch.utils.data.DataLoader`` with a dalid session (or DALIServer) as first argument.

    Works with any ``num_workers``, including 0, and with persistent workers. Bad samples that
    batches came back without, or with replaced (``on_error``), accumulate in ``bad_samples``
    with their dataset indices; a :class:`BatchError` for bad samples names those indices too
    (``dataset_indices``). Indices are known with a batch sampler and ``in_order=True``.

    Small CPU tensors of a worker's batch (its labels, say) reach the trainer as copies rather
    than through shared-memory files (:mod:`dalid.client.worker.carry`). Each worker freezes
    the heap it inherited (``gc.freeze``) before the ``worker_init_fn`` given, so that its
    garbage collections leave the trainer's pages shared (:class:`_FrozenHeap`).
    """

    def __init__(self, session: Producer, dataset: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        if not isinstance(self.collate_fn, CarryingCollate):  # a loader made again from another
            self.collate_fn = CarryingCollate(self.collate_fn)
        if not isinstance(self.worker_init_fn, _FrozenHeap):
            self.worker_init_fn = _FrozenHeap(self.worker_init_fn)
        self.session = session
        self.bad_samples: list[SampleReport] = []
        self._recorder: _RecordingSampler | None = None

    @property
    def _index_sampler(self) -> Any:
        # torch's iterators read their indices through this property; recording them here is
        # how the loader knows the dataset indices of each batch it hands out.
        sampler = super()._index_sampler
        if not self._auto_collation or not getattr(self, "in_order", True):
            return sampler
        recorder = getattr(self, "_recorder", None)
        if recorder is None or recorder.inner is not sampler:
            recorder = self._recorder = _RecordingSampler(sampler)
        return recorder

    def _batch_indices(self) -> list[int] | None:
        recorder = self._recorder
        if recorder is None or not recorder.given:
            return None
        return recorder.given.popleft()

    def __iter__(self) -> _ProducingIterator:  # type: ignore[override]
        if self._recorder is not None:
            self._recorder.given.clear()  # a new epoch: indices of the last one are stale
        return _ProducingIterator(super().__iter__(), self)
