"""A pipeline repository for the tests: `dalid serve --pipelines tests/integration/repository`.

``scaled`` uses a Python operator, so it cannot be serialized: only a repository serves it.
"""

import numpy as np
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode
from nvidia.dali.pipeline import pipeline_def
from shared_constants import OFFSET  # a sibling file of the repository


@pipeline_def(batch_size=8, num_threads=1)
def scaled(factor: int = 2) -> tuple[DataNode, DataNode]:
    """``data * factor`` computed by a Python function, and ``data + OFFSET``."""
    data = fn.external_source(name="data", no_copy=True)
    multiplied = fn.python_function(data, function=lambda array: np.asarray(array) * factor)
    return multiplied, data + OFFSET


@pipeline_def(batch_size=8, num_threads=1)
def rotated(fill: float = 0.0) -> DataNode:
    """Two inputs: an image and a per-sample angle, as a second external_source."""
    images = fn.external_source(name="images", no_copy=True, layout="HWC")
    angles = fn.external_source(name="angles", no_copy=True)
    return fn.rotate(
        images, angle=angles, keep_size=True, fill_value=fill, dtype=types.DALIDataType.UINT8
    )


@pipeline_def(batch_size=8, num_threads=1)
def strict(mode: str = "fast") -> DataNode:
    if mode not in {"fast", "exact"}:
        raise ValueError(f"mode must be 'fast' or 'exact', not {mode!r}")
    return fn.external_source(name="data", no_copy=True)
