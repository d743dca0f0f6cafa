"""References that stand for pipeline outputs until the trainer replaces them with tensors.

The names and attributes follow DALI's proxy (``DALIOutputSampleRef``, ``DALIPipelineRunRef``,
``DALIOutputBatchRef``) so code that inspects them keeps working. Importing this module
registers the collate rule in torch's ``default_collate_fn_map``: collating the sample
references of one worker batch submits that batch to the daemon and yields batch references.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.utils.data._utils.collate import default_collate_fn_map

if TYPE_CHECKING:
    from .transform import Proxy


class DALIPipelineRunRef:
    """One pipeline run (a batch). ``batch_id`` is the daemon's id once submitted."""

    def __init__(
        self,
        pipeline_id: int,
        job_id: int,
        deterministic: bool,
        *,
        job_token: str = "",
        keeps_inputs: bool = False,
    ) -> None:
        self.pipeline_id = pipeline_id
        self.job_id = job_id
        # The job (of one daemon instance) that batch_id and pipeline_id belong to.
        self.job_token = job_token
        self.deterministic = deterministic
        self.batch_id: int | None = None
        self.batch_size = 0
        # Inputs gathered in the worker until collation. Pickled to the trainer and kept until
        # the outputs are delivered only with ``keeps_inputs`` (a session with reconnect=True),
        # so that the trainer can submit the batch again to a restarted daemon.
        self.call_args: dict[str, list[Any]] = {}
        self.keeps_inputs = keeps_inputs
        self.is_scheduled = False
        self.is_complete = False

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if not self.keeps_inputs:
            state["call_args"] = {}
        return state

    def __repr__(self) -> str:
        return (
            f"DALIPipelineRunRef(batch_id={self.batch_id}, pipeline_id={self.pipeline_id}, "
            f"is_scheduled={self.is_scheduled}, is_complete={self.is_complete})"
        )


class DALIOutputSampleRef:
    """One output of one sample, before its batch is collated."""

    def __init__(
        self, proxy: Proxy, pipe_run_ref: DALIPipelineRunRef, output_idx: int, sample_idx: int
    ) -> None:
        self.proxy = proxy
        self.pipe_run_ref = pipe_run_ref
        self.output_idx = output_idx
        self.sample_idx = sample_idx

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

    def __repr__(self) -> str:
        return f"DALIOutputBatchRef(pipe_run_ref={self.pipe_run_ref}, output_idx={self.output_idx})"


def collate_sample_refs(
    samples: list[DALIOutputSampleRef], *, collate_fn_map: Any = None
) -> DALIOutputBatchRef:
    """Collate rule: the sample refs of one output become a batch ref; the first submits."""
    if not samples:
        raise ValueError("cannot collate an empty batch of dalid sample references")
    first = samples[0]
    for index, sample in enumerate(samples):
        if sample.pipe_run_ref is not first.pipe_run_ref or sample.output_idx != first.output_idx:
            raise RuntimeError(
                "all samples of a batch must come from one proxy run: a batch mixes samples "
                "of several pipelines or workers"
            )
        if sample.sample_idx != index:
            raise RuntimeError(
                f"unexpected sample order: sample {sample.sample_idx} at position {index} "
                "(was the batch shuffled or filtered after the proxy call?)"
            )
    run = first.pipe_run_ref
    run.is_complete = True
    if run.batch_id is None:
        first.proxy._submit(run)
    return DALIOutputBatchRef(run, first.output_idx)


default_collate_fn_map[DALIOutputSampleRef] = collate_sample_refs
