"""A torch DataLoader whose batches come out with dalid references replaced by tensors."""

from __future__ import annotations

import collections
import gc
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
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
    """A DataLoader worker's ``worker_init_fn``: ends the worker with its trainer, and freezes
    the heap the worker inherited, before running the user's own (``inner``).

    torch's worker watchdog compares ``getppid()`` with the parent pid it read when its loop
    started: a worker whose trainer died before that (while a spawned worker was importing)
    reads the reaper's pid and would run on forever. So the worker checks here that its trainer
    (the process that started it) is still its parent, and a thread of its own checks again
    every ``TRAINER_WATCH_S``: once the trainer is gone, the worker exits, which closes its
    link to the daemon (the daemon then drops what the worker held). A thread rather than
    ``PR_SET_PDEATHSIG``: that signal follows the *thread* that started the worker, and a
    trainer may start its workers from a thread that ends before they do.

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
        _end_with_trainer()
        gc.freeze()
        if self.inner is not None:
            self.inner(worker_id)


# How often a DataLoader worker checks that its trainer lives.
TRAINER_WATCH_S = 0.5


def _end_with_trainer() -> None:
    """Exits this worker now if its trainer is gone, else once it goes (see _FrozenHeap)."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return  # not a worker process
    trainer = parent.pid
    # The trainer is the parent, unless a fork server started the worker (or the trainer
    # died already, and this process has another parent): then its pid tells.
    direct = os.getppid() == trainer
    if not _lives(trainer, direct):
        os._exit(1)

    def watch() -> None:
        while _lives(trainer, direct):
            time.sleep(TRAINER_WATCH_S)
        os._exit(1)  # the trainer died: nobody will read this worker's batches

    threading.Thread(target=watch, name="dalid-trainer-watch", daemon=True).start()


def _lives(trainer: int, direct: bool) -> bool:
    if direct:
        return os.getppid() == trainer
    try:
        state = Path(f"/proc/{trainer}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class DataLoader(torchdata.DataLoader[Any]):
    """``torch.utils.data.DataLoader`` with a dalid session (or DALIServer) as first argument.

    Works with any ``num_workers``, including 0, and with persistent workers. Bad samples that
    batches came back without, or with replaced (``on_error``), accumulate in ``bad_samples``
    with their dataset indices; a :class:`BatchError` for bad samples names those indices too
    (``dataset_indices``). Indices are known with a batch sampler and ``in_order=True``.

    Small CPU tensors of a worker's batch (its labels, say) reach the trainer as copies rather
    than through shared-memory files (:mod:`dalid.client.worker.carry`). Each worker exits
    within a second of its trainer's death, and freezes the heap it inherited (``gc.freeze``)
    before the ``worker_init_fn`` given, so that its garbage collections leave the trainer's
    pages shared (:class:`_FrozenHeap`).
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
