"""The daemon's DALI reads files with read(2), never a memory map (Note [Plain file reads]):
real DALI pipelines, serialized as a client sends them, rewritten, rebuilt and run."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nvidia.dali import fn
from nvidia.dali.pipeline import Pipeline

from dalid.protocol import RegisterPipeline
from dalid.server.pipelines.file_reads import read_plainly
from dalid.server.pipelines.runner import PipelineRunner
from dalid.server.pipelines.sharing import Operator, read_graph
from dalid.server.pipelines.spec import PipelineSpec

from ..dali_typing import pipeline_def


def _reads(**read: Any) -> Any:
    """Two file reads of one path input, the first with ``read``'s arguments, and a sum."""

    @pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def pipe() -> Any:
        paths = fn.external_source(name="paths", no_copy=True)
        first = fn.io.file.read(paths, **read)  # type: ignore[attr-defined]
        second = fn.io.file.read(paths)  # type: ignore[attr-defined]
        return first, second, fn.external_source(name="x") + 1

    return pipe()


def _file_reads(serialized: bytes) -> list[Operator]:
    return [op for op in read_graph(serialized).operators if op.schema == "io__file__Read"]


@pytest.mark.parametrize("read", [{}, {"dont_use_mmap": False}], ids=["default", "mmap-asked"])
def test_every_file_read_reads_plainly_and_the_rest_of_the_graph_is_the_same(
    read: dict[str, Any],
) -> None:
    serialized = _reads(**read).serialize()
    plain = read_plainly(serialized)
    assert [op.flag("dont_use_mmap") for op in _file_reads(serialized)] == [False, False]
    assert [op.flag("dont_use_mmap") for op in _file_reads(plain)] == [True, True]
    # The rest of the graph is the client's: operators, their tensors and other arguments.
    ops, plain_ops = read_graph(serialized).operators, read_graph(plain).operators
    assert [op.schema for op in plain_ops] == [op.schema for op in ops]
    for before, after in zip(ops, plain_ops, strict=True):
        kept = [arg for arg in before.arguments if arg[0] != "dont_use_mmap"]
        assert [arg for arg in after.arguments if arg[0] != "dont_use_mmap"] == kept
        assert (after.inputs, after.outputs) == (before.inputs, before.outputs)
    # And DALI builds it.
    rebuilt = Pipeline.deserialize(serialized_pipeline=plain, batch_size=2, num_threads=1)
    rebuilt.build()


def test_a_graph_without_a_mapped_file_read_is_left_as_it_is() -> None:
    # Direct I/O asked for (which needs dont_use_mmap=True), plain reads asked for already,
    # and no file read at all: the same bytes.
    for serialized in (
        _direct_only().serialize(),
        _plain_only().serialize(),
        _no_files().serialize(),
    ):
        assert read_plainly(serialized) is serialized


@pipeline_def(batch_size=2, num_threads=1, device_id=None)
def _direct_only() -> Any:
    paths = fn.external_source(name="paths")
    return fn.io.file.read(paths, dont_use_mmap=True, use_o_direct=True)  # type: ignore[attr-defined]


@pipeline_def(batch_size=2, num_threads=1, device_id=None)
def _plain_only() -> Any:
    return fn.io.file.read(fn.external_source(name="paths"), dont_use_mmap=True)  # type: ignore[attr-defined]


@pipeline_def(batch_size=2, num_threads=1, device_id=None)
def _no_files() -> Any:
    return fn.external_source(name="x") * 2


def test_the_daemons_pipeline_reads_each_file_whole(tmp_path: Path) -> None:
    """The pipeline the daemon runs gives each file's bytes, as the client's would (a file it
    could not map, a FIFO, is read too: test_runner.py)."""
    files = [tmp_path / "a.bin", tmp_path / "b.bin"]
    contents = [bytes(range(256)) * 40, b"dalid"]
    for path, content in zip(files, contents, strict=True):
        path.write_bytes(content)
    pipeline = _reads()
    spec = PipelineSpec.from_message(
        RegisterPipeline(
            serialized=memoryview(pipeline.serialize()),
            input_names=("paths", "x"),
            num_outputs=3,
            max_batch_size=2,
            num_threads=1,
            prefetch_queue_depth=2,
            seed=1,
            exec_dynamic=False,
        )
    )
    runner = PipelineRunner(spec, device_id=None)
    try:
        paths = [np.frombuffer(str(path).encode(), np.int8) for path in files]
        runner.schedule({"paths": paths, "x": [np.zeros(1, np.float32)] * 2})
        first, second, _ = runner.collect()
        for output in (first, second):
            assert [np.array(sample).tobytes() for sample in output] == contents
    finally:
        runner.close()


# A child reads a sparse file of 256 MiB that a thread of its own cuts to 4 KiB meanwhile, up to
# ATTEMPTS times, through the daemon's pipeline (``runner``) or through DALI as the client's
# graph asks (``dali``: a memory map). It prints "cut short: <error>" once a read fails.
_CUT_SHORT = """
import os, sys, threading, time
import numpy as np
from nvidia.dali import fn
from nvidia.dali.pipeline import pipeline_def
from dalid.protocol import RegisterPipeline
from dalid.server.pipelines.runner import PipelineRunner
from dalid.server.pipelines.spec import PipelineSpec

how, path = sys.argv[1], sys.argv[2]

@pipeline_def(batch_size=1, num_threads=1, device_id=None, prefetch_queue_depth=1)
def read():
    return fn.io.file.read(fn.external_source(name="paths", no_copy=True))

pipeline = read()
if how == "runner":
    spec = PipelineSpec.from_message(RegisterPipeline(
        serialized=memoryview(pipeline.serialize()), input_names=("paths",), num_outputs=1,
        max_batch_size=1, num_threads=1, prefetch_queue_depth=1, seed=1, exec_dynamic=False))
    runner = PipelineRunner(spec, device_id=None)
    def run(paths):
        runner.schedule({"paths": paths})
        return runner.collect()
else:
    pipeline.build()
    def run(paths):
        pipeline.feed_input("paths", paths)
        return pipeline.run()

for attempt in range(ATTEMPTS):
    with open(path, "wb") as f:
        f.truncate(256 << 20)
    cut = threading.Timer(0.005 * (attempt % 8), os.truncate, (path, 4096))
    cut.start()
    try:
        run([np.frombuffer(path.encode(), np.int8)])
    except Exception as error:
        print("cut short:", " ".join(str(error).split())[:400], flush=True)
        break
    finally:
        cut.join()
else:
    print("never cut short while read")
"""
ATTEMPTS = 40


@pytest.mark.parametrize("how", ["runner", "dali"])
def test_a_file_cut_short_while_read_fails_its_run_and_the_daemon_lives(
    how: str, tmp_path: Path
) -> None:
    """A file that its job (or anyone) cuts short while the daemon's DALI reads it is an error
    of that run. Mapped, as DALI reads by default, the copy out of the map faults and SIGBUS ends
    the process: every job of the daemon with it."""
    done = subprocess.run(
        [sys.executable, "-c", _CUT_SHORT.replace("ATTEMPTS", str(ATTEMPTS)), how,
         str(tmp_path / "cut.bin")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if how == "dali":
        assert done.returncode == -signal.SIGBUS, (done.returncode, done.stdout, done.stderr)
        return
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cut short:" in done.stdout and "Expected to read" in done.stdout, done.stdout
