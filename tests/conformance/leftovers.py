"""What DALI's own proxy leaves in the test process, put away after each of its cases, so that
the leak checks (:mod:`tests.leaks`) still judge dalid's cases, and everything else, strictly.

DALI's proxy DataLoader is torch's, whose iterator shuts its worker processes down when it is
collected: it tells them to stop, joins each for a few seconds, and terminates one that has not
stopped by then, without joining it again. On a GPU, after a pipeline error, that left two
workers exited but not reaped, and their pipes open: each ``multiprocessing`` process keeps two
(a sentinel and the write end of its own pipe) until it is joined and closed. An iterator that
something still holds keeps its workers running, and their queues open.

:func:`put_away` ends both, as their owners would: a DataLoader iterator made during the case
shuts its workers down (torch's own shutdown, which joins them and closes its queues), and a
process made during the case that has exited is reaped and closed (its pipes). What was there
before the case (:func:`made_so_far`) is left alone, and so is a process still running after
its iterator was shut down: the leak checks name it.
"""

from __future__ import annotations

import gc
import multiprocessing.process
import weakref
from typing import Any

from torch.utils.data import dataloader

_Process = multiprocessing.process.BaseProcess
_Iterator = dataloader._MultiProcessingDataLoaderIter


def _live() -> list[Any]:
    # type(), not isinstance(): some objects (torch's deprecated aliases) warn when their
    # __class__ is read.
    return [thing for thing in gc.get_objects() if issubclass(type(thing), (_Process, _Iterator))]


def _pid(process: multiprocessing.process.BaseProcess) -> int:
    try:
        return process.pid or 0
    except ValueError:
        return 0  # closed


def made_so_far() -> weakref.WeakSet[Any]:
    """The DataLoader iterators with workers and the processes that exist now."""
    return weakref.WeakSet(_live())


def put_away(before: weakref.WeakSet[Any]) -> list[str]:
    """Shuts down the DataLoader iterators made since ``before`` and reaps and closes the
    processes made since then that have exited; says what it put away."""
    gc.collect()  # an iterator that is only unreachable shuts its workers down as it goes
    done = []
    made = [thing for thing in _live() if thing not in before]
    for iterator in (thing for thing in made if isinstance(thing, _Iterator)):
        if not iterator._shutdown:
            iterator._shutdown_workers()
            done.append(f"a DataLoader iterator's {len(iterator._workers)} workers shut down")
    processes = sorted((thing for thing in made if isinstance(thing, _Process)), key=_pid)
    for process in processes:
        try:
            # exitcode reaps a child that has exited (a non-blocking wait); None: still running,
            # or not this process's child.
            if process.exitcode is None:
                continue
            pid = process.pid
            process.close()  # its pipes; it leaves multiprocessing's children too
        except ValueError:
            continue  # closed already
        done.append(f"process {pid} reaped and closed")
    return done
