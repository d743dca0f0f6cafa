"""The whole path on CPU pipelines: a real daemon subprocess, real DataLoader workers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from nvidia.dali.data_node import DataNode

import dalid.client as dalid

from ..daemons import DaemonProcess, start_daemon
from .helpers import (
    BATCH,
    ProxyDataset,
    TwoInputDataset,
    index_batches,
    random_pipeline,
    run_in_process,
    sample,
    two_input_pipeline,
    two_output_pipeline,
)

LENGTH = 37  # 4 full batches of 8 and a partial one of 5


@pytest.fixture(scope="module")
def session(daemon: DaemonProcess) -> Iterator[dalid.Session]:
    with dalid.connect(socket=daemon.socket, autostart=False, name="e2e") as session:
        yield session


@pytest.mark.parametrize("num_workers", [0, 2, 4])
def test_outputs_equal_in_process_run(session: dalid.Session, num_workers: int) -> None:
    proxy = session.proxy(two_output_pipeline())
    loader = dalid.DataLoader(
        session, ProxyDataset(proxy, LENGTH), batch_size=BATCH, num_workers=num_workers
    )
    reference = run_in_process(
        two_output_pipeline(prefetch_queue_depth=1),
        [{"data": [sample(i) for i in indices]} for indices in index_batches(LENGTH)],
    )
    seen = []
    for ((scaled, shifted), indices), expected in zip(loader, reference, strict=True):
        assert isinstance(scaled, torch.Tensor) and scaled.dtype == torch.float32
        assert shifted.dtype == torch.int32
        np.testing.assert_array_equal(scaled.numpy(), expected[0])
        np.testing.assert_array_equal(shifted.numpy(), expected[1])
        seen.extend(indices.tolist())
    assert seen == list(range(LENGTH))


class _WithFeatures(torch.utils.data.Dataset[dict[str, Any]]):
    """Beside each proxy call, a label, a weight tensor and a feature tensor of 128 KiB."""

    def __init__(self, proxy: dalid.Proxy, length: int) -> None:
        self.proxy = proxy
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        features = torch.full((32768,), float(index))
        weight = torch.tensor(index / 2)
        return {
            "outputs": self.proxy(sample(index)),
            "label": index,
            "weight": weight,
            "features": features,
        }


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_other_fields_of_a_batch_arrive_as_collated(
    session: dalid.Session, num_workers: int
) -> None:
    # Through workers, the labels and weights (small; the weights collated into shared memory
    # by torch in the worker) come as copies, and the features (1 MiB a batch of 8: past
    # what is copied) as torch sends them; the values are the same either way.
    proxy = session.proxy(two_output_pipeline())
    loader = dalid.DataLoader(
        session, _WithFeatures(proxy, 20), batch_size=BATCH, num_workers=num_workers
    )
    seen = []
    for batch in loader:
        (_, shifted), labels, features = batch["outputs"], batch["label"], batch["features"]
        indices = labels.tolist()
        np.testing.assert_array_equal(shifted.numpy(), np.stack([sample(i) for i in indices]) + 7)
        assert labels.dtype == torch.int64 and not labels.is_shared()
        assert torch.equal(batch["weight"], labels / 2) and not batch["weight"].is_shared()
        assert features.shape == (len(indices), 32768)
        assert torch.equal(features[:, 0], labels.float())
        assert features.is_shared() == (num_workers > 0)
        seen.extend(indices)
    assert seen == list(range(20))


def test_several_inputs_are_keyword_arguments(session: dalid.Session) -> None:
    proxy = session.proxy(two_input_pipeline())
    loader = dalid.DataLoader(session, TwoInputDataset(proxy, 20), batch_size=BATCH, num_workers=2)
    count = 0
    for (total, difference), indices in loader:
        for row, index in enumerate(indices.tolist()):
            a, b = sample(index), np.full((4, 3), index, np.int32)
            np.testing.assert_array_equal(total[row].numpy(), a + b)
            np.testing.assert_array_equal(difference[row].numpy(), a - b)
            count += 1
    assert count == 20


def test_single_output_pipeline_gives_one_tensor(session: dalid.Session) -> None:
    from nvidia.dali import fn

    from ..dali_typing import pipeline_def

    @pipeline_def(batch_size=4, num_threads=1, device_id=None)
    def negate() -> DataNode:
        return -fn.external_source(name="x")

    proxy = session.proxy(negate())
    loader = dalid.DataLoader(session, ProxyDataset(proxy, 6, keyword="x"), batch_size=4)
    batches = list(loader)
    assert [tuple(out.shape) for out, _ in batches] == [(4, 4, 3), (2, 4, 3)]
    np.testing.assert_array_equal(batches[1][0][1].numpy(), -sample(5))


def test_outputs_view_shared_memory_without_copy(session: dalid.Session) -> None:
    proxy = session.proxy(two_output_pipeline())
    loader = dalid.DataLoader(session, ProxyDataset(proxy, BATCH), batch_size=BATCH)
    (scaled, _), _ = next(iter(loader))
    address = scaled.data_ptr()
    mapped = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "/dev/shm/dalid-" in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                mapped.append((start, end))
    assert any(start <= address < end for start, end in mapped)


def test_regions_return_to_the_daemon_and_slabs_are_mapped_once(
    daemon: DaemonProcess, short_tmp: Path
) -> None:
    # Each batch leases two 256-byte regions; a pool of two 4 KiB slabs holds 16 batches, so
    # 50 batches only get through if regions come back when their tensors are collected.
    small = start_daemon(short_tmp, "--pool-bytes", "8K", "--slab-bytes", "4K", name="small")
    try:
        with dalid.connect(socket=small.socket, autostart=False) as session:
            proxy = session.proxy(two_output_pipeline())
            loader = dalid.DataLoader(session, ProxyDataset(proxy, 400), batch_size=BATCH)
            batches = 0
            for (scaled, _), indices in loader:
                np.testing.assert_array_equal(
                    scaled[0].numpy(), sample(indices[0].item()) * 0.5 + 1.0
                )
                batches += 1
            assert batches == 50
            assert session.slabs_opened <= 2
    finally:
        assert small.stop() == 0


def test_spawned_workers_open_their_own_connections(session: dalid.Session) -> None:
    proxy = session.proxy(two_output_pipeline())
    loader = dalid.DataLoader(
        session,
        ProxyDataset(proxy, 20),
        batch_size=BATCH,
        num_workers=2,
        multiprocessing_context="spawn",
    )
    indices_seen = []
    for (_, shifted), indices in loader:
        np.testing.assert_array_equal(shifted[0].numpy(), sample(indices[0].item()) + 7)
        indices_seen.extend(indices.tolist())
    assert sorted(indices_seen) == list(range(20))


def test_persistent_workers_across_epochs(session: dalid.Session) -> None:
    proxy = session.proxy(two_output_pipeline())
    loader = dalid.DataLoader(
        session, ProxyDataset(proxy, 20), batch_size=BATCH, num_workers=2, persistent_workers=True
    )
    for _ in range(2):
        total = 0
        for (_, shifted), indices in loader:
            np.testing.assert_array_equal(shifted[-1].numpy(), sample(indices[-1].item()) + 7)
            total += len(indices)
        assert total == 20


class LabelFailsAfterTheProxy(ProxyDataset):
    """Its ``__getitem__`` raises for the indices in ``missing`` after its proxy call took the
    sample, as a dataset does when an image loads but its label file is missing."""

    def __init__(self, proxy: dalid.Proxy, length: int, missing: set[int]) -> None:
        super().__init__(proxy, length)
        self.missing = missing

    def __getitem__(self, index: int) -> tuple[Any, int]:
        out, _ = super().__getitem__(index)
        if index in self.missing:
            raise FileNotFoundError(f"no label for sample {index}")
        return out, index


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sample_that_raised_after_the_proxy_call_leaves_later_batches_right(
    session: dalid.Session, num_workers: int
) -> None:
    proxy = session.proxy(two_output_pipeline())
    dataset = LabelFailsAfterTheProxy(proxy, 40, missing={3, 17})
    loader = dalid.DataLoader(
        session,
        dataset,
        batch_size=BATCH,  # the pipeline's max_batch_size: no room for a left-over sample
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )
    for _ in range(2):  # the same workers go on into a second epoch
        iterator = iter(loader)
        delivered: list[int] = []
        failed = 0
        while True:
            try:
                (_, shifted), indices = next(iterator)
            except StopIteration:
                break
            except FileNotFoundError:
                failed += 1  # a trainer that logs a bad batch and carries on
                continue
            for row, index in enumerate(indices.tolist()):
                np.testing.assert_array_equal(shifted[row].numpy(), sample(index) + 7)
            delivered.extend(indices.tolist())
        assert failed == 2
        assert delivered == [index for index in range(40) if index // BATCH not in (0, 2)]


def _random_epoch(session: dalid.Session, num_workers: int) -> list[np.ndarray]:
    proxy = session.proxy(random_pipeline(), deterministic=True)
    loader = dalid.DataLoader(
        session, ProxyDataset(proxy, 24), batch_size=BATCH, num_workers=num_workers
    )
    return [out.numpy().copy() for out, _ in loader]


def test_deterministic_mode_repeats_run_to_run(session: dalid.Session) -> None:
    first = _random_epoch(session, num_workers=2)
    second = _random_epoch(session, num_workers=2)
    reference = run_in_process(
        random_pipeline(prefetch_queue_depth=1),
        [{"data": [sample(i) for i in indices]} for indices in index_batches(24)],
    )
    for a, b, expected in zip(first, second, reference, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, expected[0])


def test_produce_data_on_a_custom_structure(session: dalid.Session) -> None:
    from collections import namedtuple

    proxy = session.proxy(two_output_pipeline())
    refs = [proxy(sample(i)) for i in range(3)]
    batch = torch.utils.data.default_collate([(ref, i) for i, ref in enumerate(refs)])
    Pair = namedtuple("Pair", "outputs labels")

    class Holder:
        def __init__(self, value: Any) -> None:
            self.value = value

    structure = {"pair": Pair(batch[0], batch[1]), "holder": Holder(batch[0][1]), "list": [batch]}
    produced = session.produce_data(structure)
    assert isinstance(produced["pair"], Pair)
    scaled, shifted = produced["pair"].outputs
    np.testing.assert_array_equal(shifted.numpy(), np.stack([sample(i) + 7 for i in range(3)]))
    assert produced["holder"].value is shifted
    assert produced["list"][0][0][0] is scaled


def _mapped_slabs() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split("/dev/shm/")[1].split()[0] for line in maps if "/dev/shm/dalid-" in line}


def test_slabs_the_daemon_frees_are_unmapped_by_the_trainer(short_tmp: Path) -> None:
    from nvidia.dali import fn

    from ..dali_typing import pipeline_def

    # Room for 24 KiB of slabs of 8 KiB: a 20 KB output needs the first slab freed first.
    daemon = start_daemon(short_tmp, "--pool-bytes", "24K", "--slab-bytes", "8K", name="evict")
    try:
        with dalid.connect(socket=daemon.socket, autostart=False) as session:

            @pipeline_def(batch_size=1, num_threads=1, device_id=None)
            def identity() -> DataNode:
                return fn.copy(fn.external_source(name="x"))

            proxy = session.proxy(identity())

            def run(size: int) -> Any:
                batch = torch.utils.data.default_collate([proxy(np.ones(size, np.uint8))])
                return session.produce_data(batch)

            small = run(16)
            (first_slab,) = _mapped_slabs() & daemon.segments()
            del small  # its region goes back, so the daemon may free the slab
            large = run(20_000)
            assert int(large.sum()) == 20_000
            assert first_slab not in _mapped_slabs()
            assert first_slab not in daemon.segments()
    finally:
        assert daemon.stop() == 0


def test_a_dropped_session_ends_its_job(daemon: DaemonProcess) -> None:
    import gc
    import weakref

    session = dalid.connect(socket=daemon.socket, autostart=False)
    proxy = session.proxy(two_output_pipeline())
    job = session.job_id
    alive = weakref.ref(session)
    del session, proxy
    gc.collect()
    assert alive() is None
    assert f"job {job} said goodbye" in daemon.log_text()
