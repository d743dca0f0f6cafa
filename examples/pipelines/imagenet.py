"""A pipeline repository for `dalid serve --pipelines examples/pipelines`.

Clients select these by name: ``session.proxy(dalid.named_pipeline("train", batch_size=64,
size=224))``. ``train`` adds noise with a Python operator, which a serialized pipeline cannot
carry: only the daemon's repository can serve it.
"""

import numpy as np
from nvidia.dali import fn, pipeline_def, types

MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


@pipeline_def(batch_size=64, num_threads=4)
def train(size: int = 224, noise: float = 0.05):
    """Random-resized crop, flip, normalize, then Gaussian noise of ``noise`` (in std units)."""
    paths = fn.external_source(name="paths", no_copy=True)
    images = fn.decoders.image_random_crop(
        fn.io.file.read(paths), output_type=types.RGB, random_area=[0.08, 1.0]
    )
    images = fn.resize(images, size=[size, size])
    images = fn.crop_mirror_normalize(
        images,
        dtype=types.FLOAT,
        output_layout="CHW",
        mean=MEAN,
        std=STD,
        mirror=fn.random.coin_flip(probability=0.5),
    )
    rng = np.random.default_rng()

    def add_noise(image: np.ndarray) -> np.ndarray:
        return (image + rng.normal(0.0, noise, image.shape)).astype(np.float32)

    return fn.python_function(images, function=add_noise)
