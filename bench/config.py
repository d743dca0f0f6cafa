"""What one benchmark run is: the settings every trainer subprocess receives as JSON, and the
named configurations (profiles) a run starts from."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from .dataset import WIDTH_RANGE
from .weights import PASSES, PREFETCH, by_weight

# The augmentation every contender performs: decode, random resized crop to CROP x CROP with
# torchvision's default area and aspect-ratio ranges, random horizontal flip, then normalize
# with ImageNet's mean and std (on the 0-255 scale) into float CHW.
CROP = 224
AREA = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


# What the GPU profile's pipelines do instead ("train"): an ImageNet-style training pipeline, as
# DALI's ResNet-50 examples and its hw_decoder_bench "rn50" pipeline: the decoder decodes a
# random crop (the same area and aspect ranges), resized to CROP x CROP, flipped at random and
# normalized into float16 NCHW. "rrc" is the CPU profile's (see pipelines.py).
PIPELINES = ("rrc", "train")


@dataclass(frozen=True)
class Settings:
    """Sizes and knobs shared by every contender of a run, so that they do the same work."""

    profile: str = "cpu"
    images: int = 512
    classes: int = 8
    # How the dataset's JPEGs are saved (bench.dataset.JpegStyle): chroma and quality range.
    jpeg_subsampling: str = "444"
    jpeg_quality: str = "92-100"
    seed: int = 0
    batch_size: int = 32
    epochs: int = 5  # the first `warmup_epochs` are not timed
    warmup_epochs: int = 1
    workers: int = 2  # DataLoader worker processes
    threads: int = 2  # DALI CPU threads per pipeline
    jobs: int = 2  # concurrent trainers in the multi-job contenders
    scaling_jobs: tuple[int, ...] = (1, 2, 4, 8)  # job counts of the scaling runs; () if none
    repeats: int = 3
    transport_iterations: int = 2000
    pipeline: str = "rrc"  # one of PIPELINES
    crop: int = CROP  # the side of the square images every contender outputs
    # How wide the dataset's images are, in pixels (a range; the recipe's own by default).
    image_widths: tuple[int, int] = WIDTH_RANGE
    # The decoder's share of images for the hardware JPEG decoder (None: DALI's default).
    hw_decoder_load: float | None = None
    # DALI's QA decoder configuration (hw_decoder_bench -p rn50: batch 408, 70 threads,
    # hw_decoder_load 0.12), run by the *-qa contenders with the "train" pipeline.
    qa_batch_size: int = 408
    qa_threads: int = 70
    qa_hw_decoder_load: float = 0.12
    # The contenders of the scaling runs (scaling.SCALED: all three).
    scaled: tuple[str, ...] = ("dali", "dalid", "dalid-private")
    # The weight of each job of a run, job 0 first (the weighted run's); (): every job weighs 1.
    weights: tuple[float, ...] = ()
    gpu: bool = False
    quick: bool = False
    # Seconds job 0 of a run waits before each batch it takes: a cohort member that trails the
    # others (the dalid-cohort-trailing runs); 0: none waits.
    trailing_s: float = 0.0
    # A deterministic job (a pipeline of its own, runs in the trainer's order), its pipeline
    # made with enable_checkpointing=True, whose loader takes a state (DataLoader.state_dict(),
    # saved with torch.save) every `checkpoint_every` steps; 0: none (the checkpoint runs).
    deterministic: bool = False
    checkpoint_every: int = 0
    # Processes that each spin on a core for the whole of every run (bench.background): the
    # machine saturated by a load that is not dalid's; 0: none.
    background_load: int = 0
    # Filled in per trainer by the orchestrator.
    dataset_root: str = ""
    socket: str = ""
    daemon_pid: int = 0
    job: int = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.images * self.job_passes // self.batch_size

    @property
    def job_weight(self) -> float:
        """The weight this trainer's job connects with."""
        return self.weights[self.job] if self.weights else 1.0

    @property
    def job_passes(self) -> int:
        """How many times one epoch of this trainer goes over the images: among jobs of
        different weights, ``weights.PASSES`` for the lightest and as many times more as its
        weight is heavier, so that at their shares the jobs end their epochs together
        (``bench.weights``); else 1."""
        return by_weight(PASSES, self.job_weight, self.weights) if self.weights else 1

    @property
    def job_prefetch(self) -> int | None:
        """Batches each DataLoader worker of this trainer keeps in flight: among jobs of
        different weights, as many more as its weight is heavier (a job served three times as
        fast needs three times the batches in flight to keep as many queued in the daemon);
        None otherwise (the DataLoader's default)."""
        if not self.weights or self.workers == 0:
            return None
        return by_weight(PREFETCH, self.job_weight, self.weights)

    @property
    def device(self) -> str:
        """The dalid daemon device for these settings: "cpu", or "0" for the first GPU."""
        return "0" if self.gpu else "cpu"

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def for_qa(self) -> Settings:
        """These settings in DALI's QA decoder configuration (the *-qa contenders)."""
        return self.with_(
            batch_size=self.qa_batch_size,
            threads=self.qa_threads,
            pipeline="train",
            hw_decoder_load=self.qa_hw_decoder_load,
        )

    @classmethod
    def from_json(cls, text: str) -> Settings:
        data = json.loads(text)
        names = ("scaling_jobs", "scaled", "weights", "image_widths")
        tuples = {name: tuple(data[name]) for name in names if name in data}
        return cls(**{**data, **tuples})

    def describe(self) -> dict[str, Any]:
        """The settings that define the run (without per-trainer fields), for the report."""
        data = asdict(self)
        for key in ("dataset_root", "socket", "daemon_pid", "job"):
            data.pop(key)
        return data


QUICK = Settings(
    images=128, epochs=2, repeats=1, transport_iterations=300, scaling_jobs=(1, 2, 4), quick=True,
    qa_batch_size=32, qa_threads=2,
)  # fmt: skip
"""Quick mode of the CPU profile: a smoke test. It also runs the GPU profile's contenders (the
QA configuration scaled down to its batch and threads, staged GPU outputs), so that their code
runs on the CPU too."""

GPU = Settings(
    profile="gpu", images=8192, classes=100, batch_size=256, workers=8, threads=8, repeats=2,
    jobs=1, transport_iterations=1000, pipeline="train", scaled=("dali", "dali-proxy", "dalid"),
)  # fmt: skip
"""The GPU profile (``--profile gpu``): the ImageNet-style training pipeline at batch 256 with 8
DataLoader workers, DALI's QA decoder configuration, and the scaling runs of dalid (shared)
against DALI in-process and DALI's proxy, which hold its runs of several jobs (the private
pipelines are left out, to fit a short stay on a GPU)."""

GPU_QUICK = GPU.with_(
    images=512, epochs=2, repeats=1, batch_size=64, workers=2, threads=2,
    scaling_jobs=(1, 2), transport_iterations=100, qa_batch_size=64, qa_threads=2, quick=True,
)  # fmt: skip
"""Quick mode of the GPU profile: its smoke test, on a GPU or on the CPU."""

SMALL_WIDTHS = (40, 100)
SMALL_CROP = 32
SMALL = Settings(
    profile="small", images=16384, classes=10, batch_size=256, workers=2, threads=2, jobs=4,
    scaling_jobs=(), crop=SMALL_CROP, image_widths=SMALL_WIDTHS, scaled=("dali", "dalid"),
)  # fmt: skip
"""The small profile (``--profile small``): small JPEGs (40-100 px wide) cropped and resized to
32x32, at batch 256 with 2 DataLoader workers and 2 DALI threads, where batches come tens of
times a second and what a loader spends per batch shows beside the decoding: DALI in-process
(its own file reader, and fed by DataLoader workers), DALI's proxy and dalid (shared), with 1
job and with 4 (bench.targets.small_targets)."""

SMALL_QUICK = SMALL.with_(images=2048, epochs=2, repeats=1, quick=True)
"""Quick mode of the small profile: its smoke test."""

PROFILES = {"cpu": (Settings(), QUICK), "gpu": (GPU, GPU_QUICK), "small": (SMALL, SMALL_QUICK)}
"""Each profile's settings, in full and in quick mode."""
