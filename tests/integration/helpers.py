"""Pipelines, datasets and reference runs shared by the integration tests and their jobs."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode
from nvidia.dali.pipeline import Pipeline

from ..dali_typing import pipeline_def

BATCH = 8

# Job processes print their own lines on stdout; torch's advice on worker counts (these tests run
# more workers than a small machine has cores, on purpose) would come first.
warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)


@pipeline_def(batch_size=BATCH, num_threads=2, device_id=None, seed=1234)
def two_output_pipeline() -> tuple[DataNode, DataNode]:
    """One input, two outputs, deterministic operators only."""
    data = fn.external_source(name="data", no_copy=True)
    scaled = fn.cast(data, dtype=types.DALIDataType.FLOAT) * 0.5 + 1.0
    return scaled, data + 7


@pipeline_def(batch_size=BATCH, num_threads=2, device_id=None, seed=1234)
def two_input_pipeline() -> tuple[DataNode, DataNode]:
    a = fn.external_source(name="a", no_copy=True)
    b = fn.external_source(name="b", no_copy=True)
    return a + b, a - b


@pipeline_def(batch_size=BATCH, num_threads=2, device_id=None, seed=99)
def random_pipeline() -> DataNode:
    """Output depends on the order batches run in: the pipeline's RNG advances per run."""
    data = fn.external_source(name="data", no_copy=True)
    noise = fn.random.uniform(range=(0.0, 1.0), shape=[3])
    return fn.cast(data, dtype=types.DALIDataType.FLOAT) + noise


@pipeline_def(batch_size=BATCH, num_threads=2, device_id=0, seed=1234)
def gpu_pipeline() -> tuple[DataNode, DataNode]:
    """The two outputs of ``two_output_pipeline``, the first computed on and delivered from the
    GPU, the second on the CPU: a pipeline with outputs on both devices."""
    data = fn.external_source(name="data", no_copy=True)
    scaled = fn.cast(data.gpu(), dtype=types.DALIDataType.FLOAT) * 0.5 + 1.0
    return scaled, data + 7


def sample(index: int, offset: int = 0) -> np.ndarray:
    """A small int32 sample whose values identify it."""
    return np.arange(12, dtype=np.int32).reshape(4, 3) + 100 * (index + offset)


class ProxyDataset(torch.utils.data.Dataset[tuple[Any, int]]):
    """Returns ``(proxy(sample), index)``, as a transform-style dataset does."""

    def __init__(
        self,
        proxy: Callable[..., Any],
        length: int,
        offset: int = 0,
        keyword: str | None = None,
    ) -> None:
        self.proxy = proxy
        self.length = length
        self.offset = offset
        self.keyword = keyword

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Any, int]:
        data = sample(index, self.offset)
        out = self.proxy(**{self.keyword: data}) if self.keyword else self.proxy(data)
        return out, index


class TwoInputDataset(torch.utils.data.Dataset[tuple[Any, int]]):
    def __init__(self, proxy: Callable[..., Any], length: int) -> None:
        self.proxy = proxy
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Any, int]:
        a = sample(index)
        b = np.full((4, 3), index, dtype=np.int32)
        return self.proxy(a=a, b=b), index


def run_in_process(
    pipeline: Pipeline, batches: list[dict[str, list[np.ndarray]]]
) -> list[list[np.ndarray]]:
    """The same pipeline run in this process on the same batches: the reference outputs."""
    pipeline.build()
    results = []
    for inputs in batches:
        for name, samples in inputs.items():
            pipeline.feed_input(name, samples)
        outputs = pipeline.run()
        # as_cpu(): a GPU output comes to the host; a CPU one stays as it is.
        results.append([np.array(out.as_cpu().as_tensor()) for out in outputs])
    return results


def index_batches(length: int, batch: int = BATCH) -> list[list[int]]:
    return [list(range(start, min(start + batch, length))) for start in range(0, length, batch)]


def job_arguments(default_length: int) -> argparse.Namespace:
    """The command line of the job processes the multi-process tests start."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--length", type=int, default=default_length)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--together", type=int, default=0, help="wait for this many jobs")
    return parser.parse_args()
