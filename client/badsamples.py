"""What the trainer learns of bad samples that a batch came back without, or with replaced."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dalid.protocol import ErrorCode

from .errors import BatchError
from .refs import DALIPipelineRunRef
from .structure import take_rows


@dataclass(frozen=True)
class SampleReport:
    """One bad sample of a batch that was delivered all the same (on_error skip or replace).

    ``position`` is its place in the batch as the DataLoader collated it; ``replaced_by`` the
    position of the good sample whose outputs (and labels) stand in its place, or None: it was
    dropped, with its row of every other per-sample field. ``dataset_index`` is filled in by dalid's
    DataLoader, which knows the indices the sampler gave.
    """

    batch_id: int
    pipeline_id: int
    position: int
    message: str
    replaced_by: int | None
    dataset_index: int | None = None
    # The loader's step (as enumerate(loader) counts), where dalid's DataLoader gave the batch.
    step: int | None = None

    @property
    def dropped(self) -> bool:
        return self.replaced_by is None

    def __str__(self) -> str:
        where = (
            f"pipeline {self.pipeline_id} batch {self.batch_id}"
            if self.step is None
            else f"loader step {self.step}"
        )
        index = "" if self.dataset_index is None else f" (dataset index {self.dataset_index})"
        what = "dropped" if self.replaced_by is None else f"replaced by sample {self.replaced_by}"
        return f"{where}: sample {self.position}{index} {what}: {self.message}"


def locate(
    reports: Sequence[SampleReport], step: int | None, indices: list[int] | None
) -> list[SampleReport]:
    """``reports`` with the loader's step and the dataset index of each sample."""
    return [
        dataclasses.replace(
            report,
            step=step,
            dataset_index=(
                indices[report.position]
                if indices is not None and report.position < len(indices)
                else report.dataset_index
            ),
        )
        for report in reports
    ]


def follow_bad_samples(
    produced: Any,
    resolved: Sequence[tuple[DALIPipelineRunRef, tuple[Any, ...]]],
    reports: Sequence[SampleReport],
) -> Any:
    """``produced`` with its other per-sample fields following the skipped or replaced samples.

    ``resolved`` pairs each batch in ``produced`` with its output tensors, which the daemon
    already delivered without (or with replacements for) the bad samples in ``reports``. A
    skipped sample's row is dropped from every other per-sample field (labels, names); a
    replaced one's row becomes the row of the sample that replaced it (see :func:`take_rows`).
    """
    changed = [
        (run, outputs)
        for run, outputs in resolved
        if any(report.batch_id == run.batch_id for report in reports)
    ]
    if not changed:
        return produced
    if len(changed) > 1:
        run = changed[0][0]
        raise BatchError(
            ErrorCode.BAD_SAMPLES,
            "several batches of this structure skipped or replaced bad samples, and its other "
            "fields cannot follow all of them: use on_error='raise' for all but one pipeline",
            run.batch_id or 0,
            run.pipeline_id,
        )
    run, outputs = changed[0]
    mine = [report for report in reports if report.batch_id == run.batch_id]
    dropped = {report.position for report in mine if report.dropped}
    size = run.batch_size or (int(outputs[0].shape[0]) + len(dropped) if outputs else 0)
    rows = list(range(size))
    for report in mine:
        if report.replaced_by is not None:
            rows[report.position] = report.replaced_by
    rows = [row for position, row in enumerate(rows) if position not in dropped]
    return take_rows(produced, size, rows, {id(tensor) for tensor in outputs})
