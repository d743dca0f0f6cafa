"""PipelineRunner in-process: a serialized CPU pipeline rebuilt and run like the daemon does."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nvidia.dali import fn, types

from dalid.protocol import ErrorCode, InputBatch, RegisterPipeline, SubmitBatch, decode, encode
from dalid.server.pipelines.runner import PipelineRunner
from dalid.server.pipelines.sharing import batches_a_run
from dalid.server.pipelines.spec import PipelineBuildError, PipelineSpec, feedable
from dalid.server.samples.packed import PackedSamples
from dalid.server.samples.paths import padded_paths

from ..dali_typing import pipeline_def

BATCH = 4
SEED = 1234


def _wire(frames: list[Any]) -> list[bytes]:
    """The frames as a ZeroMQ peer receives them: plain bytes."""
    return [memoryview(frame).tobytes() for frame in frames]


@pipeline_def(batch_size=BATCH, num_threads=1, device_id=None, seed=SEED, prefetch_queue_depth=2)
def _random_pipeline() -> Any:
    x = fn.external_source(name="x", dtype=types.DALIDataType.FLOAT, ndim=2)
    y = fn.external_source(name="y", dtype=types.DALIDataType.INT32, ndim=1)
    noise = fn.random.uniform(range=[0.0, 1.0], shape=[3])
    return x * 2.0 + noise, fn.cast(y, dtype=types.DALIDataType.INT64) + 1


@pipeline_def(batch_size=BATCH, num_threads=1, device_id=None, seed=SEED, prefetch_queue_depth=2)
def _any_ndim_pipeline() -> Any:
    return fn.external_source(name="x") + 1


@pipeline_def(batch_size=2, num_threads=1, device_id=None)
def _decoder_pipeline() -> Any:
    encoded = fn.external_source(name="encoded", dtype=types.DALIDataType.UINT8, ndim=1)
    return fn.decoders.image(encoded, device="mixed")


@pipeline_def(batch_size=1, num_threads=1, device_id=None, prefetch_queue_depth=2)
def _file_pipeline() -> Any:
    return fn.io.file.read(fn.external_source(name="path", no_copy=True))  # type: ignore[attr-defined]


def _spec(
    pipeline: Any, names: tuple[str, ...], num_outputs: int, **overrides: Any
) -> PipelineSpec:
    """What the client sends for ``pipeline``, as the daemon turns it into a spec.

    ``num_outputs`` is given, not read from ``pipeline.num_outputs``: that property builds the
    pipeline in this process, which a GPU pipeline cannot do on a machine without a GPU.
    """
    fields: dict[str, Any] = {
        "serialized": memoryview(pipeline.serialize()),
        "input_names": names,
        "num_outputs": num_outputs,
        "max_batch_size": pipeline.max_batch_size,
        "num_threads": pipeline.num_threads,
        "prefetch_queue_depth": pipeline.prefetch_queue_depth,
        "seed": pipeline.seed,
        "exec_dynamic": bool(pipeline.exec_dynamic),
    }
    fields.update(overrides)
    return PipelineSpec.from_message(RegisterPipeline(**fields))


def _batches() -> list[dict[str, list[np.ndarray]]]:
    first: dict[str, list[np.ndarray]] = {
        "x": [np.arange(6, dtype=np.float32).reshape(2, 3) + i for i in range(BATCH)],
        "y": [np.arange(i + 1, dtype=np.int32) for i in range(BATCH)],
    }
    second: dict[str, list[np.ndarray]] = {  # a partial batch
        "x": [np.full((2, 3), -i, dtype=np.float32) for i in range(BATCH - 1)],
        "y": [np.array([7 * i], dtype=np.int32) for i in range(BATCH - 1)],
    }
    return [first, second]


def _wire_inputs(batch: dict[str, list[np.ndarray]]) -> dict[str, np.ndarray | list[np.ndarray]]:
    """The inputs as the executor feeds them: numpy views of received frames."""
    fed = {}
    for name, samples in batch.items():
        frames = _wire(encode(SubmitBatch(1, (InputBatch.of(name, samples),))))
        message = decode(frames).message
        assert isinstance(message, SubmitBatch)
        fed[name] = message.inputs[0].arrays()
    return fed


def _as_numpy(outputs: tuple[Any, ...]) -> list[list[np.ndarray]]:
    return [[np.array(sample) for sample in output] for output in outputs]


def _reference(batches: list[dict[str, list[np.ndarray]]]) -> list[list[list[np.ndarray]]]:
    """The outputs of the original pipeline object run in this process."""
    pipeline = _random_pipeline()
    pipeline.build()
    for batch in batches:
        for name, samples in batch.items():
            pipeline.feed_input(name, samples)
    pipeline.schedule_run()
    return [_as_numpy(pipeline.outputs()) for _ in batches]


def _assert_same(actual: list[list[np.ndarray]], expected: list[list[np.ndarray]]) -> None:
    assert len(actual) == len(expected)
    for actual_output, expected_output in zip(actual, expected, strict=True):
        assert len(actual_output) == len(expected_output)
        for actual_sample, expected_sample in zip(actual_output, expected_output, strict=True):
            assert actual_sample.dtype == expected_sample.dtype
            np.testing.assert_array_equal(actual_sample, expected_sample)


def _first_noise(instance: int) -> list[np.ndarray]:
    """The noise instance ``instance`` of ``_random_pipeline`` adds to its first run."""
    batch = _batches()[0]
    runner = PipelineRunner(_spec(_random_pipeline(), ("x", "y"), 2), None, instance=instance)
    try:
        runner.schedule(_wire_inputs(batch))
        got = _as_numpy(runner.collect())
        runner.release()
    finally:
        runner.close()
    return [sample - x * 2 for sample, x in zip(got[0], batch["x"], strict=True)]


def test_each_instance_of_a_seeded_pipeline_draws_its_own_random_numbers() -> None:
    # Two instances of one seed gave the same augmentation to the runs at the same place of
    # their streams (a CPU daemon's shared pipeline runs on two: dali-instances.md).
    first, again, second = _first_noise(0), _first_noise(0), _first_noise(1)
    _assert_same([again], [first])  # the first instance is the client's pipeline, seed and all
    assert not any(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    assert all(np.all((noise >= 0) & (noise < 1)) for noise in second)


@pytest.mark.parametrize("exec_dynamic", [True, False], ids=["dynamic", "legacy"])
def test_outputs_match_the_original_pipeline(exec_dynamic: bool) -> None:
    batches = _batches()
    expected = _reference(batches)
    runner = PipelineRunner(
        _spec(_random_pipeline(), ("x", "y"), 2, exec_dynamic=exec_dynamic), device_id=None
    )
    try:
        assert runner.spec.seed == SEED
        for batch in batches:
            runner.schedule(_wire_inputs(batch))
        assert runner.scheduled == 2
        for index, want in enumerate(expected):
            outputs = runner.collect()
            assert len(outputs) == 2
            got = _as_numpy(outputs)
            del outputs
            runner.release()
            _assert_same(got, want)
            assert len(got[0]) == len(batches[index]["x"])
        assert runner.scheduled == 0
        # The outputs themselves: x * 2 + noise in [0, 1), and y + 1 as int64.
        first = expected[0]
        for sample, x in zip(first[0], batches[0]["x"], strict=True):
            assert np.all((sample >= x * 2) & (sample < x * 2 + 1))
        for sample, y in zip(first[1], batches[0]["y"], strict=True):
            assert sample.dtype == np.int64
            np.testing.assert_array_equal(sample, y + 1)
    finally:
        runner.close()


@pytest.mark.parametrize("exec_dynamic", [True, False], ids=["dynamic", "legacy"])
def test_scheduling_a_run_returns_before_dali_has_done_it(
    exec_dynamic: bool, tmp_path: Path
) -> None:
    """DALI does a run in its own threads under either executor, so that the thread that
    schedules it copies the last run out meanwhile. Here the run waits in ``open()`` of a FIFO
    for a writer that comes only once ``schedule`` has returned."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    spec = _spec(_file_pipeline(), ("path",), 1, exec_dynamic=exec_dynamic)
    runner = PipelineRunner(spec, device_id=None)
    scheduled = threading.Event()

    def schedule() -> None:
        runner.schedule({"path": [np.frombuffer(str(fifo).encode(), dtype=np.int8)]})
        scheduled.set()

    thread = threading.Thread(target=schedule, daemon=True)
    thread.start()
    try:
        assert scheduled.wait(10), "schedule() waited for DALI to do the run"
    finally:
        _write_once_read(fifo)
        thread.join(30)
    try:
        # The daemon's DALI reads files with read(2) (Note [Plain file reads]): a FIFO's size
        # is 0, so its sample is empty, and DALI keeps no descriptor of it.
        (output,) = runner.collect()
        assert output.as_array().size == 0
        assert fifo not in _open_files()
    finally:
        runner.close()


def _open_files() -> list[Path]:
    """What this process's file descriptors name."""
    named = []
    for entry in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            named.append(entry.readlink())
    return named


def _write_once_read(fifo: Path) -> None:
    """Opens ``fifo`` for writing once a reader has it open (so that the reader's ``open()``
    returns), and closes it."""
    deadline = time.monotonic() + 30
    while True:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            return
        except OSError:  # ENXIO: no reader yet
            assert time.monotonic() < deadline, "DALI never opened the FIFO"
            time.sleep(0.01)


def test_runner_keeps_running_batch_after_batch() -> None:
    runner = PipelineRunner(_spec(_random_pipeline(), ("x", "y"), 2), device_id=None)
    try:
        for _ in range(3):
            for batch in _batches():
                runner.schedule(batch)
                (images, labels) = runner.collect()
                assert len(images) == len(batch["x"])
                assert len(labels) == len(batch["y"])
                del images, labels
                runner.release()
    finally:
        runner.close()


def test_the_runner_tells_when_dali_starts_holding_runs_and_when_it_holds_none() -> None:
    # The flight recorder's slot is written on these calls: once a busy spell, not once a run.
    told: list[bool] = []
    runner = PipelineRunner(
        _spec(_random_pipeline(), ("x", "y"), 2), device_id=None, on_run=told.append
    )
    try:
        first, second = _batches()[:2]
        runner.schedule(first)
        runner.schedule(second)  # DALI holds two runs: nothing new to tell
        assert told == [True]
        runner.collect()
        runner.release()
        assert told == [True]  # one is still in DALI
        runner.collect()
        runner.release()
        assert told == [True, False]
        for batch in (first, second):
            runner.schedule(batch)
            runner.collect()
            runner.release()
        assert told == [True, False, True, False, True, False]
    finally:
        runner.close()
    assert told[-1] is False


def _count_checked_calls(runner: PipelineRunner) -> dict[str, int]:
    """Counts the built pipeline's calls of DALI's checked ``feed_input`` and ``outputs``."""
    pipeline = runner._pipeline
    counts = {"feed_input": 0, "outputs": 0}
    for name in counts:
        method = getattr(pipeline, name)

        def counted(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _method(*args, **kwargs)

        setattr(pipeline, name, counted)
    return counts


@pytest.mark.parametrize("exec_dynamic", [True, False], ids=["dynamic", "legacy"])
def test_only_a_built_pipelines_first_run_goes_through_dalis_checked_calls(
    exec_dynamic: bool,
) -> None:
    """Note [Feeding DALI without its checks of every call]: later runs, dense or ragged, give
    what the checked calls give without making them; a rebuilt pipeline checks once again."""
    spec = _spec(_any_ndim_pipeline(), ("x",), 1, exec_dynamic=exec_dynamic)
    runner = PipelineRunner(spec, device_id=None)
    try:
        for _ in range(2):
            counts = _count_checked_calls(runner)
            for i in range(4):
                dense = np.full((BATCH, 3), i, np.float32)
                ragged = [np.full(n + 1, i, np.float32) for n in range(BATCH - 1)]
                for samples in (dense, ragged):
                    runner.schedule({"x": samples})
                    (output,) = runner.collect()
                    got = [np.array(output.at(n)) for n in range(len(output))]
                    del output
                    runner.release()
                    assert len(got) == len(samples)
                    for sample, fed in zip(got, samples, strict=True):
                        np.testing.assert_array_equal(sample, np.asarray(fed) + 1)
            assert counts == {"feed_input": 1, "outputs": 1}
            runner.rebuild()
    finally:
        runner.close()


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "ragged"])
def test_a_run_over_the_batch_size_is_refused_on_every_run(dense: bool) -> None:
    runner = PipelineRunner(_spec(_any_ndim_pipeline(), ("x",), 1), device_id=None)
    try:
        for samples in (BATCH, BATCH + 1, BATCH + 1):
            x: Any = np.zeros((samples, 3), np.float32)
            if not dense:
                x = [np.zeros(n + 1, np.float32) for n in range(samples)]
            if samples > BATCH:
                with pytest.raises(RuntimeError, match="batch size"):
                    runner.schedule({"x": x})
                continue
            runner.schedule({"x": x})
            (output,) = runner.collect()
            assert len(output) == samples
            del output
            runner.release()
    finally:
        runner.close()


def test_the_seed_is_honoured() -> None:
    batch = _batches()[0]

    def run(seed: int) -> list[list[np.ndarray]]:
        runner = PipelineRunner(_spec(_random_pipeline(), ("x", "y"), 2, seed=seed), device_id=None)
        try:
            runner.schedule(batch)
            return _as_numpy(runner.collect())
        finally:
            runner.close()

    _assert_same(run(7), run(7))
    assert not np.array_equal(run(7)[0][0], run(8)[0][0])


def test_pipeline_spec_from_message() -> None:
    message = RegisterPipeline(
        serialized=memoryview(b"pipeline"),
        input_names=("a", "b"),
        num_outputs=3,
        max_batch_size=16,
        num_threads=2,
        prefetch_queue_depth=1,
        seed=None,
        exec_dynamic=False,
        name="valid",
    )
    spec = PipelineSpec.from_message(message)
    assert spec == PipelineSpec(b"pipeline", ("a", "b"), 3, 16, 2, 1, None, False, "valid")
    assert type(spec.serialized) is bytes  # a copy: the frame may be reused after the request


# --- Errors -------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:nvidia-dali-cuda120 is no longer shipped")
def test_gpu_operators_on_a_cpu_daemon_are_a_device_mismatch() -> None:
    pipeline = _decoder_pipeline()
    serialized = pipeline.serialize()  # defining it needs no GPU
    assert serialized
    spec = _spec(pipeline, ("encoded",), 1)
    with pytest.raises(PipelineBuildError) as caught:
        PipelineRunner(spec, device_id=None)
    assert caught.value.code is ErrorCode.DEVICE_MISMATCH
    assert "dalid serve --device" in str(caught.value)


@pytest.mark.parametrize(
    "serialized",
    [b"garbage", b"", b"\x00" * 64, b"\x08\x96\x01" * 5],
    ids=["garbage", "empty", "zeros", "truncated-protobuf"],
)
def test_garbage_is_an_invalid_pipeline(serialized: bytes) -> None:
    spec = PipelineSpec(serialized, ("x",), 1, 2, 1, 1)
    with pytest.raises(PipelineBuildError) as caught:
        PipelineRunner(spec, device_id=None)
    assert caught.value.code is ErrorCode.INVALID_PIPELINE
    assert "DALI could not build the pipeline" in str(caught.value)


def test_wrong_number_of_outputs_is_an_invalid_output() -> None:
    runner = PipelineRunner(_spec(_random_pipeline(), ("x", "y"), num_outputs=3), device_id=None)
    try:
        runner.schedule(_batches()[0])
        with pytest.raises(PipelineBuildError) as caught:
            runner.collect()
        assert caught.value.code is ErrorCode.INVALID_OUTPUT
        assert "3" in str(caught.value)
    finally:
        runner.close()


def test_rebuild_after_a_failed_run() -> None:
    runner = PipelineRunner(_spec(_any_ndim_pipeline(), ("x",), 1), device_id=None)
    try:
        runner.schedule({"x": [np.zeros(3, dtype=np.float32)] * 2})
        (output,) = runner.collect()
        np.testing.assert_array_equal(np.array(output.as_tensor()), np.ones((2, 3)))
        del output

        # The number of dimensions changes between batches: DALI fails the run.
        runner.schedule({"x": [np.zeros((2, 3), dtype=np.float32)] * 2})
        with pytest.raises(RuntimeError):
            runner.collect()

        runner.rebuild()
        assert runner.scheduled == 0
        runner.schedule({"x": [np.full(3, 2, dtype=np.float32)] * 3})
        (output,) = runner.collect()
        np.testing.assert_array_equal(np.array(output.as_tensor()), np.full((3, 3), 3))
        del output

        # The rebuilt pipeline starts afresh: the other shape is fine as its first batch.
        runner.rebuild()
        runner.schedule({"x": [np.zeros((2, 3), dtype=np.float32)]})
        (output,) = runner.collect()
        assert np.array(output.as_tensor()).shape == (1, 2, 3)
    finally:
        runner.close()


def test_samples_are_fed_as_one_batch_without_a_copy() -> None:
    """Samples of one shape arrive as one array, fed as it is; others as a TensorListCPU that
    DALI makes of their views, reading them where they lie."""
    small = [np.full((2, 3), i, dtype=np.float32) for i in range(BATCH)]
    dense = _wire_inputs({"x": small})["x"]
    assert isinstance(dense, np.ndarray) and dense.shape == (BATCH, 2, 3)
    assert feedable(dense) is dense
    np.testing.assert_array_equal(dense[2], small[2])
    ragged = [np.full(i + 1, i, dtype=np.int32) for i in range(BATCH)]
    views = _wire_inputs({"y": ragged})["y"]
    assert isinstance(views, list)
    fed = feedable(views)
    assert type(fed).__name__ == "TensorListCPU" and len(fed) == BATCH
    for i in range(BATCH):
        np.testing.assert_array_equal(np.array(fed.at(i)), ragged[i])


@pipeline_def(batch_size=BATCH, num_threads=1, device_id=None)
def _files_pipeline() -> Any:
    only_read = fn.external_source(name="only_read", dtype=types.DALIDataType.UINT8, ndim=1)
    also_out = fn.external_source(name="also_out", dtype=types.DALIDataType.UINT8, ndim=1)
    read = fn.io.file.read  # type: ignore[attr-defined]
    return read(only_read), read(also_out), also_out


def test_paths_of_several_lengths_that_only_name_files_go_as_one_array(tmp_path: Path) -> None:
    """Paths that nothing but fn.io.file.read sees go to DALI as one dense array (each
    left-padded with slashes), and read the same files; paths the pipeline also returns go as
    they came, so its outputs hold the very bytes the trainer sent."""
    files = []
    for i in range(BATCH):
        directory = tmp_path / ("d" * (i + 1))
        directory.mkdir()
        files.append(directory / f"{'x' * (3 * i)}{i}.bin")
        files[-1].write_bytes(bytes([i]) * (i + 5))
    paths = [np.frombuffer(str(file).encode(), np.uint8) for file in files]
    spec = _spec(_files_pipeline(), ("only_read", "also_out"), 3)
    spec = dataclasses.replace(spec, path_inputs=("only_read", "also_out"))
    runner = PipelineRunner(spec, device_id=None)
    try:
        assert runner.padded_paths == {"only_read"}
        inputs = _wire_inputs({"only_read": paths, "also_out": paths})
        fed = feedable(inputs["only_read"], paths=True)
        assert isinstance(fed, np.ndarray)
        assert fed.shape == (BATCH, max(len(path) for path in paths))
        # As the planner keeps them (packed.py): the same array, the same files read.
        item = InputBatch.of("only_read", paths)
        packed = PackedSamples(np.frombuffer(item.data, np.uint8), item.sample_bytes())
        np.testing.assert_array_equal(feedable(packed, paths=True), fed)
        for fed_as in (inputs, {"only_read": packed, "also_out": packed}):
            runner.schedule(fed_as)
            read_padded, read_as_sent, returned = _as_numpy(runner.collect())
            contents = [file.read_bytes() for file in files]
            assert [sample.tobytes() for sample in read_padded] == contents
            assert [sample.tobytes() for sample in read_as_sent] == contents
            assert [sample.tobytes() for sample in returned] == [bytes(p) for p in paths]
    finally:
        runner.close()


@pytest.mark.parametrize(
    "samples",
    [
        [b"/data/a.jpg", b"data/bb.jpg"],  # relative: padded, it would name another file
        [b"/data/a.jpg", b""],
        [],
        [b"/a"] * 7 + [b"/" + b"x" * 64],  # 8 x 65 bytes for 78: one long path among short
        [b"/" + b"x" * 4096, b"/" + b"y" * 4095],  # longer than any path Linux opens
    ],
    ids=["relative", "empty", "none", "one-long", "over-path-max"],
)
def test_paths_that_padding_would_change_are_not_padded(samples: list[bytes]) -> None:
    assert padded_paths([np.frombuffer(sample, np.uint8) for sample in samples]) is None


def test_padded_paths_keep_their_dtype_and_bytes() -> None:
    samples = [b"/a/b.jpg", b"/a/ccc/d.jpg", b"/e.jpg"]
    padded = padded_paths([np.frombuffer(sample, np.int8) for sample in samples])
    assert padded is not None and padded.dtype == np.int8
    assert [row.tobytes() for row in padded] == [b"/////a/b.jpg", b"/a/ccc/d.jpg", b"///////e.jpg"]


@pytest.mark.parametrize(
    ("batch", "batches"), [(1, 4), (32, 4), (64, 4), (100, 2), (128, 2), (256, 1), (1000, 1)]
)
def test_auto_runs_hold_as_many_batches_as_fit_256_samples(batch: int, batches: int) -> None:
    # Small batches still share runs; a batch of 256 or more runs alone, so DALI's buffers
    # are those of one in-process pipeline of that batch, however many jobs share it.
    assert batches_a_run(0, batch) == batches


def test_a_set_run_size_is_kept_whatever_the_batch() -> None:
    assert batches_a_run(4, 256) == 4
    assert batches_a_run(1, 8) == 1
