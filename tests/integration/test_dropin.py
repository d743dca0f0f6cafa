"""``dalid.client.proxy`` as a drop-in for DALI's ``plugin.pytorch.experimental.proxy``.

The examples of DALI's ``DALIServer`` documentation run with only the import changed (the
``daemon`` fixture's socket is given through ``$DALID_SOCKET``, so the code needs no extra
argument), and the drop-in gives the same outputs as DALI's own proxy run in this process.

DALI's own module calls ``torch.cuda.nvtx.range_push`` unconditionally, which a CPU-only torch
refuses; tests that use it patch those calls to no-ops for their own duration and import the
module only then.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from nvidia.dali.data_node import DataNode

from dalid.client import proxy as dalid_proxy

from ..daemons import DaemonProcess, start_daemon
from . import dropin_examples as examples
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

DALI_PROXY = "nvidia.dali.plugin.pytorch.experimental.proxy"
IMAGES_PER_CLASS = 8
CLASSES = 3
IMAGES = CLASSES * IMAGES_PER_CLASS


def dalis_own_proxy(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """DALI's original proxy module, usable on a CPU-only torch until the test ends."""
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda *args, **kwargs: None)
    return importlib.import_module(DALI_PROXY)


@pytest.fixture(scope="module")
def jpeg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An image folder of 3 classes with 8 small JPEGs each, of varied sizes."""
    root = tmp_path_factory.mktemp("dropin") / "jpeg"
    return examples.make_image_folder(root, classes=CLASSES, per_class=IMAGES_PER_CLASS)


@pytest.fixture
def dali_proxy(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``dalid.client.proxy``, finding the test daemon as a user's code would: by environment."""
    monkeypatch.setenv("DALID_SOCKET", str(daemon.socket))
    return dalid_proxy


@pytest.fixture
def gpu_daemon(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[DaemonProcess]:
    """A daemon for GPU 0, found through ``$DALID_SOCKET``; skips without CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU and a CUDA build of torch")
    running = start_daemon(short_tmp, "--device", "0", name="gpu0")
    monkeypatch.setenv("DALID_SOCKET", str(running.socket))
    try:
        yield running
    finally:
        code = running.stop()
        assert code == 0, f"daemon exited with {code}:\n{running.log_text()}"
        assert not running.segments(), "daemon left shared memory"
        assert not running.socket.exists(), "daemon left its socket file"


def check_rn50_batches(
    consumed: examples.Batches, batch_size: int, expected_device: str | None = None
) -> None:
    """Example 1/3 output: full batches of normalized 3x224x224 images, labels in order."""
    assert len(consumed) == IMAGES // batch_size
    for data, _ in consumed:
        assert isinstance(data, torch.Tensor)
        assert data.shape == (batch_size, 3, 224, 224)
        assert data.dtype == torch.float32
        if expected_device is not None:
            assert data.device.type == expected_device
        assert torch.isfinite(data).all()
        assert data.std() > 0.1  # normalized image content, not an empty buffer
    targets = torch.cat([target for _, target in consumed]).tolist()
    labels = [label for label in range(CLASSES) for _ in range(IMAGES_PER_CLASS)]
    assert targets == labels[: len(targets)]


# --- 1. The documentation examples, with only the import changed ---------------------------------


def test_example_1_cpu(dali_proxy: ModuleType, jpeg: Path) -> None:
    consumed = examples.example_1(
        dali_proxy, jpeg, batch_size=8, device_id=None, decoder_device="cpu"
    )
    check_rn50_batches(consumed, batch_size=8, expected_device="cpu")


def test_example_2_verbatim(dali_proxy: ModuleType) -> None:
    a, b, a_plus_b, a_minus_b = examples.example_2(dali_proxy, batch_size=6)
    assert a.shape == b.shape == a_plus_b.shape == a_minus_b.shape == (6, 3, 3)
    assert a_plus_b.dtype == a_minus_b.dtype == torch.float32
    assert torch.equal(a_plus_b, a + b)
    assert torch.equal(a_minus_b, a - b)


@pytest.mark.parametrize("nworkers", [0, 2])
def test_example_3_cpu(dali_proxy: ModuleType, jpeg: Path, nworkers: int) -> None:
    consumed = examples.example_3(
        dali_proxy, jpeg, batch_size=8, nworkers=nworkers, device_id=None, decoder_device="cpu"
    )
    check_rn50_batches(consumed, batch_size=8, expected_device="cpu")


@pytest.mark.gpu
def test_example_1_gpu(gpu_daemon: DaemonProcess, jpeg: Path) -> None:
    consumed = examples.example_1(dalid_proxy, jpeg, batch_size=8)
    check_rn50_batches(consumed, batch_size=8)


@pytest.mark.gpu
def test_example_3_gpu(gpu_daemon: DaemonProcess, jpeg: Path) -> None:
    consumed = examples.example_3(dalid_proxy, jpeg, batch_size=8, nworkers=2)
    check_rn50_batches(consumed, batch_size=8)


# --- 2. The same outputs as DALI's own proxy -----------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_outputs_as_dalis_own_proxy(
    dali_proxy: ModuleType, jpeg: Path, monkeypatch: pytest.MonkeyPatch, num_workers: int
) -> None:
    # Batches of 5 over 24 images: four full batches and a partial one.
    ours = examples.run_image_folder(
        dali_proxy, examples.eval_pipe(), jpeg, batch_size=5, num_workers=num_workers
    )
    original = dalis_own_proxy(monkeypatch)
    theirs = examples.run_image_folder(
        original, examples.eval_pipe(), jpeg, batch_size=5, num_workers=num_workers
    )
    assert [len(target) for _, target in ours] == [5, 5, 5, 5, 4]
    assert len(ours) == len(theirs)
    for (data, target), (expected, expected_target) in zip(ours, theirs, strict=True):
        assert data.dtype == expected.dtype == torch.float32
        assert data.shape == expected.shape == (len(target), 3, 64, 64)
        assert torch.equal(target, expected_target)
        assert torch.equal(data, expected)


# --- 3. Deterministic mode with a random operator ------------------------------------------------


def test_deterministic_mode_repeats_and_equals_in_process_run(dali_proxy: ModuleType) -> None:
    def epoch() -> list[torch.Tensor]:
        with dali_proxy.DALIServer(random_pipeline(), deterministic=True) as server:
            loader = dali_proxy.DataLoader(
                server, ProxyDataset(server.proxy, 24), batch_size=BATCH, num_workers=2
            )
            return [out.clone() for out, _ in loader]

    first, second = epoch(), epoch()
    reference = run_in_process(
        random_pipeline(prefetch_queue_depth=1),
        [{"data": [sample(i) for i in indices]} for indices in index_batches(24)],
    )
    for a, b, expected in zip(first, second, reference, strict=True):
        assert torch.equal(a, b)
        np.testing.assert_array_equal(a.numpy(), expected[0])
    # The random operator did contribute: noise in [0, 1), not the same for every sample.
    inputs = torch.from_numpy(np.stack([sample(i) for i in range(BATCH)])).float()
    noise = first[0] - inputs
    assert (noise >= 0).all() and (noise < 1).all()
    assert len(torch.unique(noise)) > 3


# --- 4. Leaving the scope returns promptly (DALI's own takes 5 s) --------------------------------


@pytest.mark.parametrize("in_flight", [False, True], ids=["consumed", "in-flight"])
def test_leaving_the_scope_is_prompt(dali_proxy: ModuleType, in_flight: bool) -> None:
    with dali_proxy.DALIServer(two_output_pipeline()) as server:
        loader = dali_proxy.DataLoader(
            server, ProxyDataset(server.proxy, 48), batch_size=BATCH, num_workers=2
        )
        batches = iter(loader)
        kept = [next(batches)] if in_flight else list(batches)
        started = time.monotonic()
    elapsed = time.monotonic() - started
    del batches  # shuts the workers down; with batches in flight they were still submitting
    assert elapsed < 2.0, f"leaving DALIServer's scope took {elapsed:.2f} s"
    # Tensors received before the exit stay valid after it.
    for (scaled, shifted), indices in kept:
        for row, index in enumerate(indices.tolist()):
            np.testing.assert_array_equal(shifted[row].numpy(), sample(index) + 7)
            np.testing.assert_array_equal(scaled[row].numpy(), sample(index) * 0.5 + 1.0)


# --- 5. Collate rule, names and signatures -------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_plain_torch_dataloader_yields_batch_refs(dali_proxy: ModuleType, num_workers: int) -> None:
    with dali_proxy.DALIServer(two_output_pipeline()) as server:
        dataset = ProxyDataset(server.proxy, 20)
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=num_workers)
        seen = []
        for batch in loader:
            (scaled_ref, shifted_ref), indices = batch
            for output, ref in enumerate((scaled_ref, shifted_ref)):
                assert isinstance(ref, dali_proxy.DALIOutputBatchRef)
                assert isinstance(ref.pipe_run_ref, dali_proxy.DALIPipelineRunRef)
                assert ref.output_idx == output
            assert scaled_ref.pipe_run_ref.batch_id is not None
            (scaled, shifted), indices = server.produce_data(batch)
            assert isinstance(scaled, torch.Tensor) and isinstance(shifted, torch.Tensor)
            expected = np.stack([sample(i) for i in indices.tolist()])
            np.testing.assert_array_equal(shifted.numpy(), expected + 7)
            np.testing.assert_array_equal(scaled.numpy(), expected * 0.5 + 1.0)
            seen.extend(indices.tolist())
    assert seen == list(range(20))


def test_collate_rule_is_registered_on_import() -> None:
    # A fresh interpreter: importing the drop-in alone (not DALI's module) registers the rule.
    code = (
        "import sys\n"
        "from torch.utils.data._utils.collate import default_collate_fn_map\n"
        "from dalid.client import proxy\n"
        f"assert {DALI_PROXY!r} not in sys.modules\n"
        "assert proxy.DALIOutputSampleRef in default_collate_fn_map\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


def _parameters(callable_: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    """A signature's parameters without annotations: (name, kind, default) each."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(callable_).parameters.values()]


def test_names_and_signatures_match_dalis(
    dali_proxy: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = dalis_own_proxy(monkeypatch)
    for name in [*original.__all__, "DALIOutputSampleRef", "DALIOutputBatchRef"]:
        assert hasattr(dali_proxy, name), name
    assert hasattr(dali_proxy, "DALIPipelineRunRef")
    # DALIServer(pipeline, deterministic=False): DALI's parameters in DALI's order with DALI's
    # defaults; dalid's additions are keyword-only with defaults.
    ours = _parameters(dali_proxy.DALIServer)
    theirs = _parameters(original.DALIServer)
    assert [name for name, _, _ in theirs] == ["pipeline", "deterministic"]
    assert ours[: len(theirs)] == theirs
    assert all(
        kind is inspect.Parameter.KEYWORD_ONLY and default is not inspect.Parameter.empty
        for _, kind, default in ours[len(theirs) :]
    )
    # DataLoader(dali_server, *args, **kwargs)
    assert _parameters(dali_proxy.DataLoader) == _parameters(original.DataLoader)
    assert [name for name, _, _ in _parameters(dali_proxy.DataLoader)] == [
        "dali_server",
        "args",
        "kwargs",
    ]
    assert issubclass(dali_proxy.DataLoader, torch.utils.data.DataLoader)
    for name in ["DALIOutputSampleRef", "DALIOutputBatchRef"]:
        assert _parameters(getattr(dali_proxy, name)) == _parameters(getattr(original, name))
    for method in ["produce_data", "start_thread", "stop_thread", "__enter__"]:
        ours_method = _parameters(getattr(dali_proxy.DALIServer, method))
        assert ours_method == _parameters(getattr(original.DALIServer, method)), method
    # __exit__(self, exc_type, exc_value, tb) in DALI; any form taking those three will do.
    inspect.signature(dali_proxy.DALIServer.__exit__).bind(None, None, None, None)
    assert isinstance(inspect.getattr_static(dali_proxy.DALIServer, "proxy"), property)

    # The proxy callable takes the pipeline's external_source names, as DALI's does: one input
    # positional or keyword, several keyword-only; anything else is a ValueError.
    for make in [two_output_pipeline, two_input_pipeline]:
        with dali_proxy.DALIServer(make()) as server:
            mine = server.proxy
            theirs_proxy = original.DALIServer(make()).proxy
            assert _parameters(mine) == _parameters(theirs_proxy)
            for proxy in (mine, theirs_proxy):
                with pytest.raises(ValueError):
                    proxy(np.zeros(3, np.int32), np.zeros(3, np.int32))


def test_run_refs_carry_dalis_attributes(dali_proxy: ModuleType) -> None:
    with dali_proxy.DALIServer(two_input_pipeline()) as server:
        (total, _), _ = TwoInputDataset(server.proxy, 1)[0]
        run = total.pipe_run_ref
        for attribute in ["batch_id", "call_args", "is_scheduled", "is_complete"]:
            assert hasattr(run, attribute), attribute
        assert total.proxy is server.proxy and total.sample_idx == 0
        batch = torch.utils.data.default_collate([total])
        assert run.is_complete and run.is_scheduled
        (produced,) = server.produce_data([batch])
        np.testing.assert_array_equal(produced[0].numpy(), sample(0))


# --- 6. Explicit start/stop and argument errors --------------------------------------------------


def _one_epoch(dali_proxy: ModuleType, server: Any, length: int = 12) -> None:
    loader = dali_proxy.DataLoader(server, ProxyDataset(server.proxy, length), batch_size=BATCH)
    seen = []
    for (_, shifted), indices in loader:
        for row, index in enumerate(indices.tolist()):
            np.testing.assert_array_equal(shifted[row].numpy(), sample(index) + 7)
        seen.extend(indices.tolist())
    assert seen == list(range(length))


def test_start_and_stop_thread_explicitly(dali_proxy: ModuleType) -> None:
    server = dali_proxy.DALIServer(two_output_pipeline())
    server.stop_thread()  # never started: nothing to do, as in DALI
    server.start_thread()
    server.start_thread()  # already started: nothing to do, as in DALI
    _one_epoch(dali_proxy, server)
    server.stop_thread()
    server.stop_thread()  # idempotent
    # Started again after a stop, it serves again.
    server.start_thread()
    _one_epoch(dali_proxy, server)
    server.stop_thread()
    server.stop_thread()


def test_persistent_workers_across_stops(dali_proxy: ModuleType, daemon: DaemonProcess) -> None:
    # DALI's documented loop (the loader starts the server, each epoch ends with stop_thread())
    # with workers that persist across epochs: they keep the job they were started with, so
    # the stops leave it open, and it ends once the loader that owns them is gone.
    server = dali_proxy.DALIServer(two_output_pipeline())
    loader = dali_proxy.DataLoader(
        server, ProxyDataset(server.proxy, 12), batch_size=BATCH, num_workers=2,
        persistent_workers=True,
    )  # fmt: skip
    jobs = set()
    for _ in range(3):
        seen = []
        for (_, shifted), indices in loader:
            for row, index in enumerate(indices.tolist()):
                np.testing.assert_array_equal(shifted[row].numpy(), sample(index) + 7)
            seen.extend(indices.tolist())
        assert seen == list(range(12))
        jobs.add(server.session.job_id)
        server.stop_thread()
    assert len(jobs) == 1  # one job all along: the workers' target never went stale
    assert [job.job_id for job in daemon.status().jobs] == list(jobs)
    # `dalid status` counts the loader's workers between its epochs too: they persist.
    assert [job.workers_started for job in daemon.status().jobs] == [2]
    del loader
    gc.collect()
    assert not daemon.status().jobs, "the job outlived the loader's workers"
    server.stop_thread()  # idempotent once ended


def test_stop_without_persistent_workers_ends_the_job(
    dali_proxy: ModuleType, daemon: DaemonProcess
) -> None:
    server = dali_proxy.DALIServer(two_output_pipeline())
    _one_epoch(dali_proxy, server)
    assert daemon.status().jobs
    server.stop_thread()
    assert not daemon.status().jobs


@pytest.mark.parametrize("num_workers", [0, 2])
def test_proxy_taken_before_a_restart_still_works(dali_proxy: ModuleType, num_workers: int) -> None:
    server = dali_proxy.DALIServer(two_output_pipeline())
    dataset = ProxyDataset(server.proxy, 12)  # built once, used in every epoch
    for _ in range(2):
        with server:
            loader = dali_proxy.DataLoader(
                server, dataset, batch_size=BATCH, num_workers=num_workers
            )
            seen = [index for _, indices in loader for index in indices.tolist()]
            assert sorted(seen) == list(range(12))


def _server_module(which: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return dalid_proxy if which == "dalid" else dalis_own_proxy(monkeypatch)


# DALI's own DALIServer, refused in its __init__, then fails in its __del__ (AttributeError:
# no '_thread_stop_event'); that is DALI's, so it is ignored for DALI's module only.
BOTH_MODULES = [
    "dalid",
    pytest.param(
        "dali",
        marks=pytest.mark.filterwarnings(
            "ignore:Exception ignored in.*DALIServer.__del__"
            ":pytest.PytestUnraisableExceptionWarning"
        ),
    ),
]


@pytest.mark.parametrize("which", BOTH_MODULES)
def test_not_a_pipeline_is_a_type_error(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _server_module(which, monkeypatch)
    with pytest.raises(TypeError):
        module.DALIServer("not a pipeline")
    with pytest.raises(TypeError):
        module.DALIServer(two_output_pipeline)  # the definition, not a pipeline
    gc.collect()  # the refused objects go now, inside this test (and its warning filter)


@pytest.mark.parametrize("which", BOTH_MODULES)
def test_pipeline_without_external_source_is_a_runtime_error(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nvidia.dali import fn

    from ..dali_typing import pipeline_def

    @pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def no_inputs() -> DataNode:
        return fn.random.uniform(range=(0.0, 1.0), shape=[2])

    module = _server_module(which, monkeypatch)
    with pytest.raises(RuntimeError, match="doesn't have any inputs"):
        module.DALIServer(no_inputs())
    gc.collect()


def test_a_reader_pipeline_gets_dalis_words_and_what_to_write_instead(tmp_path: Path) -> None:
    from nvidia.dali import fn

    from dalid.client import proxy as dalid_proxy

    from ..dali_typing import pipeline_def

    @pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def reads_files() -> tuple[DataNode, DataNode]:
        jpegs, labels = fn.readers.file(file_root=str(tmp_path))
        return fn.decoders.image(jpegs), labels

    with pytest.raises(RuntimeError) as raised:
        dalid_proxy.DALIServer(reads_files())
    message = str(raised.value)
    assert message.startswith("The provided pipeline doesn't have any inputs: ")
    assert "the daemon refuses fn.readers.file" in message
    assert "fn.io.file.read(" in message
    gc.collect()


def test_daliserver_takes_connects_job_options(
    dali_proxy: ModuleType, daemon: DaemonProcess
) -> None:
    options = {"name": "eval", "weight": 2.5, "memory_bytes": 96 << 20, "max_inflight_batches": 3}
    with dali_proxy.DALIServer(two_output_pipeline(), **options) as server:
        _one_epoch(dali_proxy, server)
        limits = server.session.limits
        assert (limits.weight, limits.pool_bytes, limits.max_inflight_batches) == (2.5, 96 << 20, 3)
        (job,) = [job for job in daemon.status().jobs if job.job_id == server.session.job_id]
        assert (job.name, job.weight, job.max_inflight_batches) == ("eval", 2.5, 3)
