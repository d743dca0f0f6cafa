"""Where a proxy's batches go: the pipeline as the daemon registered it, for one job.

A :class:`ProxyTarget` is what a pickled proxy carries to the DataLoader workers; the trainer
makes one for each registration, and again after each reconnection to a restarted daemon.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dalid.protocol import InputBatch, SubmitBatch

if TYPE_CHECKING:
    from .refs import DALIPipelineRunRef


@dataclass(frozen=True)
class ProxyTarget:
    """Everything a worker process needs to reach the pipeline; this is what gets pickled."""

    socket: Path
    device: str | int
    job_id: int
    job_token: str
    pipeline_id: int
    input_names: tuple[str, ...]
    num_outputs: int
    max_batch_size: int
    deterministic: bool
    # The trainer's session reconnects to a restarted daemon: see Note [Daemon restarts].
    reconnect: bool = False

    def submission(self, run: DALIPipelineRunRef) -> SubmitBatch:
        """The request that submits the samples gathered in ``run`` to this pipeline; it runs
        at once unless deterministic (then when the trainer schedules it)."""
        inputs = tuple(
            InputBatch(
                name=name,
                dtype=run.call_args[name][0].dtype.name,
                shapes=tuple(tuple(sample.shape) for sample in run.call_args[name]),
                samples=tuple(run.call_args[name]),
            )
            for name in self.input_names
        )
        return SubmitBatch(self.pipeline_id, inputs, deferred=run.deterministic)
