"""A pipeline repository for `dalid serve --pipelines examples/pipelines` (its python_function
needs `--repository-operators PythonFunction`).

Clients select these by name: ``session.proxy(dalid.named_pipeline("train", batch_size=64,
size=224))``. ``train`` adds noise with a Python operator, which a serialized pipeline cannot
carry: only the daemon's repository can serve it.
"""

import numpy as np
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode
from nvidia.dali.pipeline import pipeline_def

MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


@pipeline_def(batch_size=64, num_threads=4)
def train(size: int = 224, noise: float = 0.05) -> DataNode:
    """Random-resized crop, flip, normalize, then Gaussian noise of ``noise`` (in std units)."""
    # The ignores: DALI's stubs lack fn.io, and type resize's result as a union.
    paths = fn.external_source(name="paths", no_copy=True)
    images = fn.decoders.image_random_crop(
        fn.io.file.read(paths),  # type: ignore[attr-defined]
        output_type=types.DALIImageType.RGB,
        random_area=[0.08, 1.0],
    )
    images = fn.crop_mirror_normalize(
        fn.resize(images, size=[size, size]),  # type: ignore[arg-type]
        dtype=types.DALIDataType.FLOAT,
        output_layout="CHW",
        mean=MEAN,
        std=STD,
        mirror=fn.random.coin_flip(probability=0.5),
    )
    rng = np.random.default_rng()

    def add_noise(image: np.ndarray) -> np.ndarray:
        return (image + rng.normal(0.0, noise, image.shape)).astype(np.float32)

    return fn.python_function(images, function=add_noise)
