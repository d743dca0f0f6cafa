"""DALI's ``pipeline_def`` as the tests call it: DALI's stub types ``device_id`` as an int, and
most of the tests' pipelines run without a GPU (``device_id=None``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

from nvidia.dali.data_node import DataNode
from nvidia.dali.pipeline import Pipeline
from nvidia.dali.pipeline import pipeline_def as dali_pipeline_def

Definition = Callable[..., DataNode | tuple[DataNode, ...]]


@overload
def pipeline_def(definition: Definition, /) -> Callable[..., Pipeline]: ...


@overload
def pipeline_def(**options: Any) -> Callable[[Definition], Callable[..., Pipeline]]: ...


def pipeline_def(definition: Definition | None = None, /, **options: Any) -> Any:
    """``nvidia.dali.pipeline_def``, bare or with options, ``device_id=None`` included."""
    if definition is not None:
        return dali_pipeline_def(definition)
    return dali_pipeline_def(**options)
