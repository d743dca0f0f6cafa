"""A torch DataLoader whose batches come out with dalid references replaced by tensors."""

from __future__ import annotations

import collections
import contextlib
import gc
import multiprocessing
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from torch.utils import data as torchdata
from torchdata.stateful_dataloader.stateful import Stateful

from dalid.protocol import PROTOCOL_VERSION

from .badsamples import SampleReport
from .checkpoint import STATE_KEY, check_state
from .errors import DaemonUnavailable, InputError
from .worker.carry import CarryingCollate

if TYPE_CHECKING:
    # torchdata ships no types; its StatefulDataLoader is a torch DataLoader with state_dict()
    # and load_state_dict().
    _StatefulDataLoader = torchdata.DataLoader
else:
    from torchdata.stateful_dataloader import StatefulDataLoader as _StatefulDataLoader


class Producer(Protocol):
    def produce_data(self, obj: Any) -> Any: ...


class DrawsNotSaved(UserWarning):
    """A DataLoader state of a deterministic job holds no DALI checkpoint of its pipeline (one
    not made with ``enable_checkpointing=True``): a resume repeats the data, not the draws."""


class _RecordingSampler:
    """The loader's batch sampler, noting each batch of indices it gives, in order."""

    def __init__(self, inner: Iterable[Any]) -> None:
        self.inner = inner
        self.given: collections.deque[list[int]] = collections.deque()

    def __iter__(self) -> Iterator[Any]:
        inner = iter(self.inner)
        if isinstance(inner, Stateful):
            return _StatefulRecording(inner, self.given)
        return _Recording(inner, self.given)

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


class _StatefulRecordingSampler(_RecordingSampler):
    """A recording sampler over a batch sampler with a state, which it saves and restores (as
    ``StatefulDataLoader`` does with the index sampler it sees)."""

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()  # type: ignore[attr-defined,no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)  # type: ignore[attr-defined]


class _Recording:
    """An iteration of a recording sampler: its batches, each noted as it is given."""

    def __init__(self, inner: Iterator[Any], given: collections.deque[list[int]]) -> None:
        self.inner = inner
        self.given = given

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        indices = next(self.inner)
        self.given.append(list(indices))
        return indices


class _StatefulRecording(_Recording):
    """An iteration over a batch sampler's iterator with a state: torchdata's (its
    ``BatchSampler``'s, over its ``RandomSampler``) saves the sampler's generator and how far
    the epoch went, which this passes on."""

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()  # type: ignore[attr-defined,no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)  # type: ignore[attr-defined]

    def update_state_dict(self) -> None:
        update = getattr(self.inner, "update_state_dict", None)
        if update is not None:
            update()


class _ProducingIterator:
    """Wraps torch's loader iterator; each batch goes through ``produce_data`` on its way out,
    named by its step (as ``enumerate(loader)`` counts) and its dataset indices."""

    def __init__(
        self, inner: Iterator[Any], loader: DataLoader, workers: _ToldWorkers | None = None
    ) -> None:
        self._inner = inner
        self._loader = loader
        self._step = 0
        # An epoch's own workers (not persistent), which stop with the epoch.
        self._workers = workers

    def __iter__(self) -> _ProducingIterator:
        return self

    def __next__(self) -> Any:
        step = self._step
        try:
            batch = next(self._inner)
        except StopIteration:
            if self._workers is not None:
                self._workers.stopped()  # torch stopped them as the epoch ended
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


class _ToldWorkers:
    """The workers one loader iterator started, as its session counts them for the daemon
    (``dalid status`` shows them before they connect, at their first sample): counted and told
    once started (:meth:`tell`), uncounted once stopped (told at once from the thread that
    iterates, else with the session's next batch). A producer without a count (DALI's own
    server) counts nothing."""

    def __init__(self, producer: Producer, workers: int) -> None:
        self._producer = producer
        self._counted = getattr(producer, "started_workers", None)
        self._key = self._counted.start(workers) if self._counted is not None else None

    def stopped(self, *, tell: bool = True) -> None:
        """They stopped; ``tell``: the daemon is told now (only from the iterating thread: a
        finalizer leaves it to the session's next batch). Idempotent."""
        key, self._key = self._key, None
        if key is not None and self._counted is not None:
            self._counted.stop(key)
            if tell:
                self.tell()

    def tell(self) -> None:
        """Tells the daemon the session's count now (only from the iterating thread). A daemon
        gone is left for the next batch to report (the count goes with it, to a new daemon)."""
        tell = getattr(self._producer, "tell_workers", None)
        if tell is not None:
            with contextlib.suppress(DaemonUnavailable):
                tell()


def _stop_workers(shutdown: Callable[[], None], workers: _ToldWorkers | None) -> None:
    """A finalizer's: stops an iterator's workers and uncounts them."""
    try:
        shutdown()
    finally:
        if workers is not None:
            workers.stopped(tell=False)


class DataLoader(_StatefulDataLoader[Any]):
    """``torch.utils.data.DataLoader`` with a dalid session (or DALIServer) as first argument.

    It is torchdata's ``StatefulDataLoader``: ``state_dict()`` after k batches, loaded into a
    new loader (``load_state_dict()``), resumes with batch k+1 (docs/migration.md,
    "Checkpoints"); a deterministic pipeline's state travels with it.

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
        with warnings.catch_warnings():
            # torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates, at each loader.
            warnings.filterwarnings("ignore", "'set_vital' is deprecated", UserWarning)
            super().__init__(dataset, *args, **kwargs)
        if not isinstance(self.collate_fn, CarryingCollate):  # a loader made again from another
            self.collate_fn = CarryingCollate(self.collate_fn)
        if not isinstance(self.worker_init_fn, _FrozenHeap):
            self.worker_init_fn = _FrozenHeap(self.worker_init_fn)
        self.session = session
        self.bad_samples: list[SampleReport] = []
        self._recorder: _RecordingSampler | None = None
        self._warned_draws = False
        # The workers of the latest iterator, as the session counts them.
        self._workers: _ToldWorkers | None = None

    @property
    def _index_sampler(self) -> Any:
        # torch's iterators read their indices through this property; recording them here is
        # how the loader knows the dataset indices of each batch it hands out.
        sampler = super()._index_sampler
        if not self._auto_collation or not getattr(self, "in_order", True):
            return sampler
        recorder = getattr(self, "_recorder", None)
        if recorder is None or recorder.inner is not sampler:
            stateful = isinstance(sampler, Stateful)
            kind = _StatefulRecordingSampler if stateful else _RecordingSampler
            recorder = self._recorder = kind(sampler)
        return recorder

    def _batch_indices(self) -> list[int] | None:
        recorder = self._recorder
        if recorder is None or not recorder.given:
            return None
        return recorder.given.popleft()

    def _get_iterator(self) -> Any:
        iterator: Any = super()._get_iterator()
        # The workers this iterator started, counted for the daemon (`dalid status`) until
        # they stop: with the epoch, by the finalizers below, or when the iterator is collected.
        self._workers = _ToldWorkers(self.session, self.num_workers) if self.num_workers else None
        if self._workers is not None:
            weakref.finalize(iterator, self._workers.stopped, tell=False)
        if self.num_workers and self.persistent_workers:
            # Note [Stopping torchdata's workers]
            # -----------------------------------
            # torchdata 0.11's iterator, when it stops its workers from its own __del__ (after
            # a batch raised, say), waits 5 s a worker for them and leaves them unreaped; from
            # a finalizer that holds it, alive, they stop at once. The loader's finalizer stops
            # its persistent workers; an iterator's, an epoch's (``__iter__``). Why:
            # docs/design/checkpoints.md, "Stopping torchdata's workers".
            replaced = getattr(self, "_stop_persistent", None)
            if replaced is not None:
                replaced()  # the iterator this one replaces (a state loaded): its workers go
            self._stop_persistent = weakref.finalize(
                self, _stop_workers, iterator._shutdown_workers, self._workers
            )
        if self._workers is not None:
            self._workers.tell()
        return iterator

    def __iter__(self) -> _ProducingIterator:  # type: ignore[override]
        if self._recorder is not None:
            self._recorder.given.clear()  # a new epoch: indices of the last one are stale
        inner: Any = super().__iter__()
        if self.num_workers and not self.persistent_workers:
            produced = _ProducingIterator(inner, self, self._workers)
            # An epoch's workers stop with it, or with the last reference to its iterator
            # (Note [Stopping torchdata's workers]).
            weakref.finalize(produced, _stop_workers, inner._shutdown_workers, self._workers)
            return produced
        return _ProducingIterator(inner, self)

    # --- resuming ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The loader's state after the batches handed out so far: ``StatefulDataLoader``'s (the
        data position) and, under ``"dalid"``, the session's pipelines, with each deterministic
        one's DALI checkpoint (docs/migration.md, "Checkpoints"). A plain dict for
        ``torch.save``; :meth:`load_state_dict` in a new loader resumes from the next batch."""
        state: dict[str, Any] = super().state_dict()  # type: ignore[misc]
        take = getattr(self.session, "pipeline_states", None)
        pipelines, missing = take() if take is not None else ([], [])
        if missing and not self._warned_draws:
            self._warned_draws = True
            warnings.warn(
                "this DataLoader's state restores its data position but not the random draws "
                "of a deterministic pipeline, whose outputs will differ after a resume: "
                + "; ".join(missing),
                DrawsNotSaved,
                stacklevel=2,
            )
        state[STATE_KEY] = {
            "protocol": PROTOCOL_VERSION,
            "dataset_length": self._dataset_length(),
            "pipelines": pipelines,
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resumes from a state of :meth:`state_dict` (this process's or another's): the next
        batches are those that followed it, the pipelines' draws too where it holds their
        checkpoints. Refuses a state of another dalid protocol, dataset length or pipeline,
        saying which."""
        state = dict(state_dict)
        ours = state.pop(STATE_KEY, None)
        if not isinstance(ours, dict):
            raise InputError(
                "not a state of dalid's DataLoader (it has no 'dalid' entry): load a state that "
                "this DataLoader's state_dict() gave"
            )
        check_state(ours, self._dataset_length())
        restore = getattr(self.session, "restore_pipelines", None)
        if restore is not None:
            restore(ours["pipelines"])
        super().load_state_dict(state)  # type: ignore[misc]

    def _dataset_length(self) -> int | None:
        try:
            return len(self.dataset)  # type: ignore[arg-type]
        except TypeError:
            return None
