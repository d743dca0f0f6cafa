"""Pipelines of the daemon's repository, selected by name (``dalid serve --pipelines DIR``).

A pipeline that cannot be serialized (one with Python operators, say) lives as a
``@pipeline_def`` function in a file of the daemon's repository; a client selects it by name
with the build arguments and parameters it wants, and the daemon builds it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dalid.protocol import RegisterNamedPipeline
from dalid.protocol.messages import NAMED_PIPELINE_BUILD_ARGUMENTS

from .errors import InputError


@dataclass(frozen=True)
class RepositoryPipeline:
    """The pipeline ``name`` of the daemon's repository, to pass to ``Session.proxy``.

    The daemon calls the ``@pipeline_def`` function ``name`` with its own device_id, the build
    arguments set here (None leaves the definition's default) and ``parameters`` as further
    keyword arguments (JSON values: numbers, strings, booleans, lists, dicts).
    """

    name: str
    batch_size: int | None = None
    num_threads: int | None = None
    prefetch_queue_depth: int | None = None
    seed: int | None = None
    parameters: Mapping[str, Any] = field(default_factory=dict)

    def request(self) -> RegisterNamedPipeline:
        """The registration message; bad arguments raise InputError before anything is sent."""
        reserved = sorted(set(self.parameters) & NAMED_PIPELINE_BUILD_ARGUMENTS)
        if reserved:
            raise InputError(
                f"pipeline {self.name!r}: {reserved} are build arguments of their own "
                "(device_id is the daemon's), not parameters"
            )
        try:
            parameters = json.dumps(dict(self.parameters), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise InputError(
                f"pipeline {self.name!r}: parameters travel as JSON and this one cannot: {error}"
            ) from None
        try:
            return RegisterNamedPipeline(
                name=self.name,
                parameters=parameters,
                batch_size=self.batch_size,
                num_threads=self.num_threads,
                prefetch_queue_depth=self.prefetch_queue_depth,
                seed=self.seed,
            )
        except ValueError as error:
            raise InputError(f"pipeline {self.name!r}: {error}") from None


def named_pipeline(
    name: str,
    *,
    batch_size: int | None = None,
    num_threads: int | None = None,
    prefetch_queue_depth: int | None = None,
    seed: int | None = None,
    **parameters: Any,
) -> RepositoryPipeline:
    """``RepositoryPipeline(name, ...)`` with the parameters as keyword arguments."""
    return RepositoryPipeline(
        name, batch_size, num_threads, prefetch_queue_depth, seed, parameters=parameters
    )
