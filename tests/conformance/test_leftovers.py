"""What DALI's own proxy leaves behind is put away after its cases (:mod:`.leftovers`), and
nothing else: real DALI proxy loaders, real worker processes, the leak checks' own snapshots."""

from __future__ import annotations

import importlib
import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from nvidia.dali import fn
from nvidia.dali.data_node import DataNode

from .. import leaks
from ..dali_typing import pipeline_def
from ..integration.dropin_examples import ImageFolder
from . import leftovers
from .conftest import DALI_PROXY


@pipeline_def
def _crop() -> DataNode:
    images = fn.external_source(name="images", no_copy=True)
    cropped: DataNode = fn.crop(images, crop=(8, 8))
    return cropped


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as file:
        text = file.read()
    return text[text.rfind(")") + 2 :].split()[0]


def _exited_unreaped(process: multiprocessing.process.BaseProcess) -> None:
    """Waits (without reaping it) until ``process`` has exited: a zombie, as DataLoader workers
    that were terminated and never joined again are."""
    assert process.pid is not None
    deadline = time.monotonic() + 60
    while _state(process.pid) != "Z":
        assert time.monotonic() < deadline, "the process did not exit"
        time.sleep(0.05)


def test_a_held_dali_proxy_iterator_has_its_workers_shut_down(
    jpeg: Path, private_runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An iterator of DALI's proxy DataLoader that something still holds after its case: its
    workers run and its queues are open, until put_away shuts it down as torch would."""
    if not torch.cuda.is_available():
        # DALI's proxy calls NVTX unconditionally, which a CPU-only torch refuses.
        monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda *args, **kwargs: None)
        monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda *args, **kwargs: None)
    proxy = importlib.import_module(DALI_PROXY)
    before, snapshot = leftovers.made_so_far(), leaks.take([])
    with proxy.DALIServer(_crop(batch_size=4, num_threads=1, device_id=None)) as server:
        loader = proxy.DataLoader(
            server, ImageFolder(jpeg, transform=server.proxy), batch_size=4, num_workers=2
        )
        held = iter(loader)
        images, labels = next(held)
        assert tuple(images.shape) == (4, 8, 8, 3)
    outside, inside = leaks.left_behind(snapshot, [], private_runtime_dir, set(), grace_s=0)
    workers = sorted(process.pid for process in outside.processes)
    assert len(workers) == 2  # running
    assert any(target.startswith("pipe:") for target in inside.fds.values())

    # Shut down (torch's shutdown joins them), then closed: their pipes.
    assert leftovers.put_away(before) == [
        "a DataLoader iterator's 2 workers shut down",
        *(f"process {pid} reaped and closed" for pid in workers),
    ]
    outside, inside = leaks.left_behind(snapshot, [], private_runtime_dir, set(), grace_s=0)
    assert not outside  # reaped, though the iterator is still held
    # Of what the case opened, only what the objects still held own is left: the pipes of the
    # server's input queue and of the iterator's result queue (torch's shutdown closes its end
    # of each worker's queue; a queue's own pipe is closed as the queue goes), and torch's
    # shared memory of the batches the iterator had taken ahead.
    queues = (server._dali_input_q, held._worker_result_queue)
    held_fds = {end.fileno() for queue in queues for end in (queue._reader, queue._writer)}
    left = leaks.still_there(inside).fds
    assert {fd for fd, target in left.items() if "/torch_" not in target} <= held_fds
    del images, labels
    assert held._shutdown
    del held, loader, server, queues
    assert not leaks.still_there(inside)


def test_processes_that_exited_unreaped_are_reaped_and_closed_others_left(
    private_runtime_dir: Path,
) -> None:
    """DataLoader workers terminated and never joined again: exited, not reaped, their pipes
    open. Those made since the snapshot are reaped and closed; an earlier one is left alone."""
    spawn = multiprocessing.get_context("spawn")
    # Still running when the next one starts (a start reaps the children that have exited).
    earlier = spawn.Process(target=time.sleep, args=(5,))
    earlier.start()
    try:
        before, snapshot = leftovers.made_so_far(), leaks.take([])
        process = spawn.Process(target=time.sleep, args=(0,))
        process.start()
        pid = process.pid
        _exited_unreaped(process)
        _exited_unreaped(earlier)
        outside, inside = leaks.left_behind(snapshot, [], private_runtime_dir, set(), grace_s=0)
        assert [found.pid for found in outside.processes] == [pid]
        assert "exited but not reaped" in outside.lines()[0]
        assert any(target.startswith("pipe:") for target in inside.fds.values())

        assert leftovers.put_away(before) == [f"process {pid} reaped and closed"]
        outside, _ = leaks.left_behind(snapshot, [], private_runtime_dir, set(), grace_s=0)
        assert not outside
        assert not leaks.still_there(inside)
        assert earlier.pid is not None
        assert _state(earlier.pid) == "Z"  # not this case's: still for its owner to reap
    finally:
        earlier.join()
        earlier.close()
