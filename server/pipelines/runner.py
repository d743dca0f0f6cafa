"""A DALI pipeline rebuilt from its serialized form: plain DALI, no sockets, no threads.

It builds, rebuilds, feeds and collects one pipeline; the daemon's executors drive it, and
tests drive it directly in-process.

Note [Feeding DALI without its checks of every call]
----------------------------------------------------
A built pipeline's first run goes through ``Pipeline.feed_input`` and ``Pipeline.outputs``,
which check it once; its later runs hand the backend (``Pipeline._pipe``) what those calls
would have: each input a ``TensorListCPU`` with no layout, and no stream for the outputs but
the executor's own. The one check that depends on the run, its samples against the batch
size, is made on every run (``_fed_directly``); a rebuilt pipeline checks anew. Why, and the
tests that hold it: docs/design/feeding-dali.md.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from dalid.protocol import ErrorCode, OnError
from dalid.protocol.file_inputs import path_inputs
from dalid.protocol.messages import MAX_INPUTS, MAX_NAME_LENGTH, MAX_OUTPUTS

from . import checkpoints
from .file_reads import read_plainly
from .operators import ALLOW_LIST, OperatorPolicy, OperatorRefused
from .sharing import Graph, batches_a_run, read_graph
from .sizes import sized_outputs
from .spec import PipelineBuildError, PipelineSpec, feedable

log = logging.getLogger("dalid.server")


def instance_seed(seed: int, instance: int) -> int:
    """The seed of DALI instance ``instance`` of a pipeline of ``seed``: the first keeps it, each
    other its own, so that two instances' runs never draw the same random numbers (two of one
    seed would give the same augmentation to the runs at the same place of their streams)."""
    if not instance or seed < 0:
        return seed  # -1: DALI draws a seed of its own for each instance
    return (seed + instance * 0x9E3779B1) % (1 << 31)


class PipelineRunner:
    """Builds the pipeline of ``spec`` for ``device_id`` (None: CPU only) and runs batches.

    ``schedule`` feeds one run and starts it; ``collect`` returns the outputs of the oldest
    scheduled run. After a failure the DALI pipeline object is dead: ``rebuild`` replaces it.
    A run holds up to ``run_batches`` batches of ``spec.max_batch_size`` samples (a pipeline
    several jobs share runs their batches together; 0: ``batches_a_run``'s choice);
    ``num_threads``, when given, replaces the spec's (a shared pipeline's threads are the
    daemon's to choose). ``instance``: which DALI instance of the pipeline this is; one past the
    first draws its own random numbers (``instance_seed``).
    """

    def __init__(
        self,
        spec: PipelineSpec,
        device_id: int | None,
        pipeline: Any = None,
        *,
        run_batches: int = 1,
        num_threads: int | None = None,
        max_threads: int = 0,
        on_run: Callable[[bool], None] | None = None,
        instance: int = 0,
    ) -> None:
        self.spec = spec
        self.instance = instance
        # Told when DALI starts holding runs of this pipeline, and when it holds none (flight.py).
        self._on_run = on_run
        self.device_id = device_id
        self.run_size = spec.max_batch_size * batches_a_run(run_batches, spec.max_batch_size)
        asked = num_threads or spec.num_threads
        # A pipeline's DALI threads are at most its share of the daemon's (PipelineBuilder).
        self.num_threads = min(asked, max_threads) if max_threads else asked
        self.threads_asked = asked if self.num_threads < asked else 0
        if self.threads_asked:
            log.info(
                "pipeline %r asked for %d DALI threads and gets %d, its share of the daemon's "
                "(dalid serve --max-threads)",
                spec.name,
                asked,
                self.num_threads,
            )
        self._pipeline: Any = None
        # Whether the built pipeline's first run went through DALI's checked calls (Note
        # [Feeding DALI without its checks of every call]).
        self._checked = False
        # What each scheduled run was fed, oldest first (``schedule``).
        self._fed: collections.deque[list[Any]] = collections.deque()
        # Taken to schedule a run and to take or restore a checkpoint from another thread (the
        # daemon's I/O thread: ``checkpoints.py``); never held while DALI runs.
        self._state_lock = threading.Lock()
        # Runs collected since the pipeline was built or restored from a checkpoint.
        self.runs = 0
        # ``pipeline``: an unbuilt pipeline of ``spec.definition`` made already, to build first
        # (only where it is built as defined: one batch a run, its own threads, its own seed: an
        # instance past the first is made anew with another, ``instance_seed``).
        if self.run_size != spec.max_batch_size or self.num_threads != spec.num_threads or instance:
            pipeline = None
        self._build(pipeline)
        graph = self._graph()
        # The path inputs fed as one dense array of padded paths (``padded_paths``).
        self.padded_paths = (
            frozenset(name for name in spec.path_inputs if graph.read_as_files_only(name))
            if graph is not None
            else frozenset()
        )
        # The operators whose output sizes come from inputs, checked per batch (sizes.py).
        self.sized_outputs = sized_outputs(graph, spec.input_names) if graph is not None else ()

    @classmethod
    def from_definition(
        cls,
        name: str,
        definition: Callable[[], Any],
        device_id: int | None,
        max_batch_size: int,
        on_error: OnError = OnError.RAISE,
        *,
        run_batches: int = 1,
        num_threads: int | None = None,
        max_threads: int = 0,
        on_run: Callable[[bool], None] | None = None,
        operators: OperatorPolicy = ALLOW_LIST,
        instance: int = 0,
    ) -> PipelineRunner:
        """Builds a pipeline of the daemon's repository; its spec is read from the pipeline.

        ``definition`` makes a new unbuilt pipeline at each call (a rebuild calls it again),
        taking ``batch_size`` and ``num_threads`` to override its own.
        """
        try:
            pipeline = definition()
        except Exception as error:
            raise PipelineBuildError(
                ErrorCode.INVALID_PIPELINE,
                f"pipeline {name!r} of the repository raised {type(error).__name__}: {error}\n"
                + traceback.format_exc(),
            ) from None
        input_names, num_outputs = _graph_summary(pipeline, name)
        try:
            operators.check(_schema_names(pipeline), repository=True)
        except OperatorRefused as refusal:
            raise PipelineBuildError(
                ErrorCode.INVALID_PIPELINE, f"pipeline {name!r} of the repository: {refusal}"
            ) from None
        if pipeline.max_batch_size > max_batch_size:
            raise PipelineBuildError(
                ErrorCode.INVALID_PIPELINE,
                f"pipeline {name!r}: batch size {pipeline.max_batch_size} is over this daemon's "
                f"limit of {max_batch_size}",
            )
        depth = pipeline.prefetch_queue_depth
        if isinstance(depth, dict):
            depth = max(depth.values())
        spec = PipelineSpec(
            serialized=b"",
            input_names=input_names,
            num_outputs=num_outputs,
            max_batch_size=pipeline.max_batch_size,
            num_threads=pipeline.num_threads,
            prefetch_queue_depth=int(depth),
            seed=pipeline.seed,
            exec_dynamic=bool(pipeline.exec_dynamic),
            name=name,
            on_error=on_error,
            definition=definition,
            path_inputs=path_inputs(pipeline),
        )
        return cls(
            spec,
            device_id,
            pipeline,
            run_batches=run_batches,
            num_threads=num_threads,
            max_threads=max_threads,
            on_run=on_run,
            instance=instance,
        )

    def _build(self, pipeline: Any = None) -> None:
        from nvidia.dali.pipeline import Pipeline

        kwargs: dict[str, Any] = {
            "batch_size": self.run_size,
            "num_threads": self.num_threads,
            "device_id": self.device_id,
            "prefetch_queue_depth": self.spec.prefetch_queue_depth,
            # A deserialized pipeline defaults to the legacy executor; keep the client's choice.
            "exec_dynamic": self.spec.exec_dynamic,
            # And to neither pipelined nor asynchronous: DALI's simple executor, which does a
            # run in the thread that asks for it and returns when it is done (Note [DALI's host
            # buffers]): as the client's own pipeline would, each run's stages go on in DALI's
            # threads while the daemon copies the last run out.
            "exec_pipelined": True,
            "exec_async": True,
        }
        seeded: dict[str, Any] = {}
        if self.spec.seed is not None:
            seeded["seed"] = instance_seed(self.spec.seed, self.instance)
            kwargs.update(seeded)
        try:
            if pipeline is None and self.spec.definition is not None:
                pipeline = self.spec.definition(
                    batch_size=self.run_size, num_threads=self.num_threads, **seeded
                )
            elif pipeline is None:
                # Its file reads with read(2), not a memory map (Note [Plain file reads]).
                serialized = read_plainly(self.spec.serialized)
                pipeline = Pipeline.deserialize(serialized_pipeline=serialized, **kwargs)
            pipeline.build()
        except Exception as error:
            text = str(error)
            if self.device_id is None and ("CUDA" in text or "GPU" in text):
                raise PipelineBuildError(
                    ErrorCode.DEVICE_MISMATCH,
                    "the pipeline has GPU operators (device='mixed' or 'gpu') but this daemon runs "
                    "CPU pipelines only: connect to a daemon started with `dalid serve --device N` "
                    f"(DALI said: {text.strip().splitlines()[-1]})",
                ) from None
            raise PipelineBuildError(
                ErrorCode.INVALID_PIPELINE, f"DALI could not build the pipeline: {text.strip()}"
            ) from None
        self._pipeline = pipeline
        self._checked = False
        self._fed.clear()
        self.runs = 0

    def _graph(self) -> Graph | None:
        """The built pipeline's graph, read once; None where it cannot be read (Python
        operators cannot be serialized, for one: their pipeline is fed as its inputs came, and
        its size inputs are not checked)."""
        try:
            return read_graph(self.spec.serialized or self._pipeline.serialize())
        except Exception:
            return None

    def schedule(self, inputs: Mapping[str, np.ndarray | Sequence[np.ndarray]]) -> None:
        """Feeds every external_source its samples (up to ``run_size``) and schedules one run."""
        fed = []
        pipeline = self._pipeline
        for name in self.spec.input_names:
            batch = feedable(inputs[name], name in self.padded_paths)
            if self._checked:
                pipeline._pipe.SetExternalTLInput(name, self._fed_directly(batch), None, False)
            else:
                pipeline.feed_input(name, batch)
            fed.append(batch)
        # An external_source with no_copy=True reads what it was fed when the run starts; a
        # stacked batch is ours alone, so it lives until the run is collected (the samples
        # themselves are kept by their batch, see executor.py).
        self._fed.append(fed)
        if len(self._fed) == 1 and self._on_run is not None:
            self._on_run(True)  # DALI holds a run now, and held none (told once, not each run)
        # Not schedule_run(): its first call prefetches prefetch_queue_depth runs at once,
        # which needs that many batches fed up front. DALI's own proxy schedules this way.
        with self._state_lock:
            self._pipeline._run_once()

    def _fed_directly(self, batch: Any) -> Any:
        """``batch`` (``feedable``'s) as ``feed_input`` hands it to the backend, after the one
        check of ``feed_input``'s that depends on the run."""
        samples = len(batch)
        if samples > self._pipeline.max_batch_size:
            raise RuntimeError(
                f"a run of {samples} samples is over the pipeline's batch size of "
                f"{self._pipeline.max_batch_size}"
            )
        if isinstance(batch, np.ndarray):
            from nvidia.dali.tensors import TensorListCPU

            return TensorListCPU(batch, "")
        return batch

    @property
    def dynamic(self) -> bool:
        """Whether the built pipeline runs on DALI's default executor, which makes its
        outputs afresh at each run (else the legacy one, which reuses them: CpuExecutor)."""
        return bool(self._pipeline.exec_dynamic)

    @property
    def scheduled(self) -> int:
        """Runs scheduled and not collected yet."""
        return len(self._fed)

    def collect(self, cuda_stream: int | None = None) -> tuple[Any, ...]:
        """The outputs (DALI TensorLists) of the oldest scheduled run.

        With ``cuda_stream`` (a ``cudaStream_t``; the default executor only) GPU outputs, and CPU
        outputs copied from the GPU, are ready in that stream's order instead of on the host.
        """
        pipeline = self._pipeline
        if self._checked:
            # What ``Pipeline.outputs`` does once checked, less its count of runs to consume,
            # which only it reads (Note [Feeding DALI without its checks of every call]).
            stream = None if cuda_stream is None else ctypes.c_void_p(cuda_stream)
            outputs = tuple(pipeline._pipe.Outputs(stream))
        else:
            outputs = tuple(pipeline.outputs(cuda_stream))
            self._checked = True
        # A run that failed keeps what it was fed until the pipeline is rebuilt.
        with self._state_lock:
            self._fed.popleft()
            self.runs += 1
        if not self._fed and self._on_run is not None:
            self._on_run(False)
        if len(outputs) != self.spec.num_outputs:
            raise PipelineBuildError(
                ErrorCode.INVALID_OUTPUT,
                f"the pipeline returned {len(outputs)} outputs, the client declared "
                f"{self.spec.num_outputs}",
            )
        return outputs

    def checkpoint(self) -> tuple[bytes, int]:
        """The pipeline's DALI checkpoint between two runs (``checkpoints.py``), and the runs
        collected since it was built or restored."""
        with self._state_lock:
            return checkpoints.take(self._idle(), self.spec.name), self.runs

    def restore(self, checkpoint: bytes) -> None:
        """Restores the pipeline from ``checkpoint`` before its next run."""
        with self._state_lock:
            checkpoints.restore(self._idle(), self.spec.name, checkpoint)
            self.runs = 0

    def _idle(self) -> Any:
        """The built pipeline, with no run inside DALI (under ``_state_lock``)."""
        if self._pipeline is None or self._fed:
            raise checkpoints.CheckpointUnavailable(
                "a run of the pipeline is inside DALI: its state is saved and restored between runs"
            )
        return self._pipeline

    def release(self) -> None:
        """Returns the collected outputs' buffers to DALI once they have been copied out.

        The legacy executor (``exec_dynamic=False``) keeps them in its prefetch queue until
        this call, and blocks the next run while the queue is full.
        """
        if not self.spec.exec_dynamic:
            self._pipeline.release_outputs()

    def unshareable(self) -> str:
        """Why the built pipeline's runs must not mix jobs' samples ("" if they may), read from
        its operators (``sharing.py``)."""
        try:
            graph = read_graph(self._pipeline.serialize())
        except Exception as error:  # Python operators cannot be serialized, for one
            # DALI's own words (an assert on the operator's schema, say) are for debugging.
            log.debug(
                "pipeline %r cannot be serialized: %s: %s",
                self.spec.name,
                type(error).__name__,
                error,
            )
            return (
                "DALI cannot serialize it (a Python operator, for one), so dalid cannot tell "
                "whether its operators work sample by sample"
            )
        return graph.unshareable()

    def rebuild(self) -> None:
        """A fresh pipeline after an error; batches scheduled on the old one are gone."""
        self.close()
        self._build()

    def close(self) -> None:
        self._pipeline = None
        self._fed.clear()
        if self._on_run is not None:
            self._on_run(False)


def _schema_names(pipeline: Any) -> list[str]:
    """The schema names of a defined pipeline's operators (external_source has none)."""
    return [
        getattr(op._op, "schema_name", None) or type(op._op).__name__ for op in pipeline._ops or ()
    ]


def _graph_summary(pipeline: Any, name: str) -> tuple[tuple[str, ...], int]:
    """The external_source names (in definition order) and output count of a pipeline."""
    from nvidia.dali.external_source import ExternalSource
    from nvidia.dali.pipeline import Pipeline

    if not isinstance(pipeline, Pipeline):
        raise PipelineBuildError(
            ErrorCode.INVALID_PIPELINE,
            f"pipeline {name!r} of the repository returned a {type(pipeline).__name__}, not a "
            "DALI pipeline: decorate it with @pipeline_def",
        )
    try:
        if not pipeline._py_graph_built:
            pipeline._build_graph()
    except Exception as error:
        raise PipelineBuildError(
            ErrorCode.INVALID_PIPELINE,
            f"pipeline {name!r} of the repository could not be defined: {type(error).__name__}: "
            f"{error}",
        ) from None
    names = tuple(op.name for op in pipeline._ops or () if isinstance(op._op, ExternalSource))
    problems = []
    if not 0 < len(names) <= MAX_INPUTS:
        problems.append(f"it has {len(names)} external_source inputs (1 to {MAX_INPUTS} needed)")
    if any(not 0 < len(input_name) <= MAX_NAME_LENGTH for input_name in names):
        problems.append("an external_source name is empty or too long: name each one")
    if len(set(names)) != len(names):
        problems.append(f"external_source names repeat: {list(names)}")
    num_outputs = int(pipeline._num_outputs)
    if not 0 < num_outputs <= MAX_OUTPUTS:
        problems.append(f"it has {num_outputs} outputs (1 to {MAX_OUTPUTS} allowed)")
    if problems:
        raise PipelineBuildError(
            ErrorCode.INVALID_PIPELINE, f"pipeline {name!r} cannot be served: {'; '.join(problems)}"
        )
    return names, num_outputs
