"""References that stand for pipeline outputs until the trainer replaces them with tensors.

The names and attributes follow DALI's proxy (``DALIOutputSampleRef``, ``DALIPipelineRunRef``,
``DALIOutputBatchRef``) so code that inspects them keeps working. A proxy call returns sample
references; collating them (the rule is in :mod:`dalid.client.worker.worker`) submits the batch and
yields batch references, which pickle to the trainer.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol


class Submits(Protocol):
    """The proxy a sample reference came from (``worker.Proxy``, whose module builds on this
    one): collating the batch's references submits the batch through it."""

    def _submit(self, run: DALIPipelineRunRef) -> None: ...


@dataclass
class Resubmission:
    """What a batch reference carries with reconnect=True, so that the trainer can submit the
    batch again to a restarted daemon (Note [Daemon restarts] in
    reconnect/reconnector.py)."""

    # The token of the job that accepted the batch ("": none). Another job's than the ref's
    # job_token when a worker rejoined its trainer's job on a restarted daemon.
    accepted_by: str = ""
    # The batch's inputs once collated, until the trainer has delivered its outputs.
    inputs: dict[str, list[Any]] = field(default_factory=dict)

    def accepted(self, job_token: str, inputs: dict[str, list[Any]]) -> None:
        """The batch was collated, and accepted by the job with ``job_token`` ("": unsent)."""
        self.accepted_by = job_token
        self.inputs = inputs


class DALIPipelineRunRef:
    """One pipeline run (a batch). ``batch_id`` is the daemon's id once submitted."""

    def __init__(
        self,
        pipeline_id: int,
        job_id: int,
        deterministic: bool,
        *,
        job_token: str = "",
        resubmission: Resubmission | None = None,
    ) -> None:
        self.pipeline_id = pipeline_id
        self.job_id = job_id
        # The job (of one daemon instance) that the proxy named the pipeline in: with
        # pipeline_id, how the trainer's session finds the pipeline.
        self.job_token = job_token
        self.deterministic = deterministic
        self.batch_id: int | None = None
        self.batch_size = 0
        # Inputs gathered in the worker until collation submits them.
        self.call_args: dict[str, list[Any]] = {}
        # With reconnect=True, what lets the trainer submit the batch again to a restarted
        # daemon: see Note [Daemon restarts] in reconnect/reconnector.py. None otherwise.
        self.resubmission = resubmission
        self.is_scheduled = False
        self.is_complete = False
        # Per sample, the references the proxy handed out for it; see Note [Abandoned samples].
        self._sample_refs: list[tuple[weakref.ref[DALIOutputSampleRef], ...]] = []

    def __reduce__(self) -> tuple[Any, tuple[_RunState]]:
        # Every batch's reference crosses from its worker to the trainer: its fields go as one
        # tuple, where a dict of them pickled each name too (a batch of labels and one output
        # pickled 13% faster and unpickled 18% faster). The inputs go only where the trainer
        # may submit them again; the sample references stay in the worker.
        state: _RunState = (
            self.pipeline_id,
            self.job_id,
            self.job_token,
            self.deterministic,
            self.batch_id,
            self.batch_size,
            self.call_args if self.resubmission is not None else {},
            self.resubmission,
            self.is_scheduled,
            self.is_complete,
        )
        return _rebuilt_run, (state,)

    def add_sample(self, refs: tuple[DALIOutputSampleRef, ...]) -> None:
        """Records the references of the sample just added at index ``batch_size``."""
        self._sample_refs.append(tuple([weakref.ref(ref) for ref in refs]))
        self.batch_size += 1

    def add_one(self, ref: DALIOutputSampleRef) -> None:
        """:meth:`add_sample` for a pipeline of one output (the proxy's common call)."""
        self._sample_refs.append((weakref.ref(ref),))
        self.batch_size += 1

    def drop_abandoned(self) -> None:
        """Drops the samples no reference stands for any more (their ``__getitem__`` raised)."""
        live = [
            index
            for index, refs in enumerate(self._sample_refs)
            if any(ref() is not None for ref in refs)
        ]
        if len(live) < self.batch_size:
            self.keep_samples(live)

    def keep_samples(self, indices: list[int]) -> None:
        """Keeps only the samples at ``indices`` (increasing), renumbering their references."""
        self.call_args = {
            name: [samples[index] for index in indices] for name, samples in self.call_args.items()
        }
        self._sample_refs = [self._sample_refs[index] for index in indices]
        for position, refs in enumerate(self._sample_refs):
            for ref in refs:
                sample = ref()
                if sample is not None:
                    sample.sample_idx = position
        self.batch_size = len(indices)

    def __repr__(self) -> str:
        return (
            f"DALIPipelineRunRef(batch_id={self.batch_id}, pipeline_id={self.pipeline_id}, "
            f"is_scheduled={self.is_scheduled}, is_complete={self.is_complete})"
        )


# What a run's pickle carries, in order (DALIPipelineRunRef.__reduce__).
_RunState = tuple[
    int, int, str, bool, int | None, int, dict[str, list[Any]], Resubmission | None, bool, bool
]


def _rebuilt_run(state: _RunState) -> DALIPipelineRunRef:
    """A run as its worker pickled it (:meth:`DALIPipelineRunRef.__reduce__`), without the
    sample references, which stay in the worker."""
    (pipeline_id, job_id, job_token, deterministic, batch_id, batch_size, call_args,
     resubmission, is_scheduled, is_complete) = state  # fmt: skip
    run = DALIPipelineRunRef(
        pipeline_id, job_id, deterministic, job_token=job_token, resubmission=resubmission
    )
    run.batch_id = batch_id
    run.batch_size = batch_size
    run.call_args = call_args
    run.is_scheduled = is_scheduled
    run.is_complete = is_complete
    return run


class DALIOutputSampleRef:
    """One output of one sample, before its batch is collated."""

    def __init__(
        self, proxy: Submits, pipe_run_ref: DALIPipelineRunRef, output_idx: int, sample_idx: int
    ) -> None:
        self.proxy = proxy
        self.pipe_run_ref = pipe_run_ref
        self.output_idx = output_idx
        self.sample_idx = sample_idx

    # A reference names one output of one sample of the batch being built; a copy (a dataset
    # that deep-copies its samples, say) names the same, so it is the same object.
    def __copy__(self) -> DALIOutputSampleRef:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> DALIOutputSampleRef:
        return self

    def __repr__(self) -> str:
        return (
            f"DALIOutputSampleRef({self.pipe_run_ref}, output_idx={self.output_idx}, "
            f"sample_idx={self.sample_idx})"
        )


class DALIOutputBatchRef:
    """One output of a submitted batch; ``produce_data`` replaces it with a tensor."""

    def __init__(self, pipe_run_ref: DALIPipelineRunRef, output_idx: int) -> None:
        self.pipe_run_ref = pipe_run_ref
        self.output_idx = output_idx

    def __reduce__(self) -> tuple[Any, tuple[DALIPipelineRunRef, int]]:
        return DALIOutputBatchRef, (self.pipe_run_ref, self.output_idx)

    def __repr__(self) -> str:
        return f"DALIOutputBatchRef(pipe_run_ref={self.pipe_run_ref}, output_idx={self.output_idx})"


# Note [Abandoned samples]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A batch holds exactly the samples its collation was given, in order, and every output's
# references agree on their indices: a sample whose ``__getitem__`` raised after its proxy
# call, or that a collate_fn filtered out, must not shift the next batch or fill it past
# max_batch_size. Collation keeps the samples it is given (``keep_samples``), and a full run
# first drops those whose references are all gone (``drop_abandoned``); the kept samples'
# references are renumbered in place. Why, and the tests: docs/design/worker-submission.md.
