"""What the client reads of a DALI pipeline: its serialized form, made without building it for
its device."""

from __future__ import annotations

import numpy as np
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode
from nvidia.dali.pipeline import Pipeline

from dalid.client.pipelines import registration_request, serialize
from dalid.protocol import RegisterPipeline
from dalid.server.pipelines.sharing import read_graph

from ..dali_typing import pipeline_def


@pipeline_def(batch_size=4, num_threads=1, device_id=None, seed=7)
def cpu_pipeline() -> DataNode:
    return fn.external_source(name="x", no_copy=True) * 2


@pipeline_def(batch_size=4, num_threads=1, device_id=0, seed=7)
def gpu_pipeline() -> tuple[DataNode, DataNode]:
    jpegs = fn.external_source(name="jpegs", no_copy=True)
    images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)  # type: ignore[attr-defined]
    images = fn.resize(images, size=[32, 32])  # type: ignore[assignment]
    return fn.crop_mirror_normalize(images.gpu()), jpegs


def test_a_cpu_pipeline_serializes_as_dali_serializes_it() -> None:
    ours = serialize(cpu_pipeline())
    assert ours == cpu_pipeline().serialize()
    rebuilt = Pipeline.deserialize(
        serialized_pipeline=ours,
        batch_size=4,
        num_threads=1,
        device_id=None,
        prefetch_queue_depth=1,
    )
    rebuilt.build()
    rebuilt.feed_input("x", [np.arange(3, dtype=np.int32)] * 4)
    (out,) = rebuilt.run()
    assert out.at(0).tolist() == [0, 2, 4]


def test_a_gpu_pipeline_serializes_without_a_backend_for_its_device() -> None:
    # DALI's serialize() builds a backend for GPU 0 first: without CUDA it fails, with it the
    # trainer's object would hold GPU resources that only the daemon needs.
    pipeline = gpu_pipeline()
    serialized = serialize(pipeline)
    graph = read_graph(serialized)
    assert [op.schema for op in graph.operators] == [
        "ExternalSource",
        "decoders__Image",
        "Resize",
        "CropMirrorNormalize",
    ]
    assert not pipeline._backend_prepared and pipeline._pipe is None
    # Twice, alike: the copy it serialized left the pipeline's graph as it was.
    assert serialize(pipeline) == serialized
    request = registration_request(pipeline)
    assert isinstance(request, RegisterPipeline)
    assert bytes(request.serialized) == serialized
    assert request.input_names == ("jpegs",) and request.num_outputs == 2
