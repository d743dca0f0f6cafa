"""Where a proxy's batches go: the pipeline as the daemon registered it, for one job.

A :class:`ProxyTarget` is what a pickled proxy carries to the DataLoader workers; the trainer
makes one for each registration, and again after each reconnection to a restarted daemon.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dalid.protocol import InputBatch, SubmitBatch

from ..errors import InputError
from .paths import resolve_paths


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
    # Inputs whose samples are file paths, made absolute from the trainer's working directory
    # before they leave (dalid.client.worker.paths).
    path_inputs: tuple[str, ...] = ()
    working_directory: str = ""

    def submission(
        self, samples: Mapping[str, Sequence[Any]], deferred: bool, batch_id: int = 0
    ) -> SubmitBatch:
        """The request that submits a batch's ``samples`` (numpy arrays, by input name) to
        this pipeline as ``batch_id``; ``deferred``: it runs only when the trainer schedules it.
        Relative file paths are made absolute, and files this process cannot read are named."""
        resolved, unreadable = resolve_paths(samples, self.path_inputs, self.working_directory)
        try:
            # Each input's samples become one frame here, once, as the batch is collated.
            inputs = tuple(InputBatch.of(name, resolved[name]) for name in self.input_names)
        except ValueError as error:
            raise InputError(str(error)) from None
        return SubmitBatch(
            self.pipeline_id, inputs, batch_id, deferred=deferred, unreadable=unreadable
        )
