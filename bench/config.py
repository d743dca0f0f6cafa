"""What one benchmark run is: the settings every trainer subprocess receives as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

# The augmentation every contender performs: decode, random resized crop to CROP x CROP with
# torchvision's default area and aspect-ratio ranges, random horizontal flip, then normalize
# with ImageNet's mean and std (on the 0-255 scale) into float CHW.
CROP = 224
AREA = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


@dataclass(frozen=True)
class Settings:
    """Sizes and knobs shared by every contender of a run, so that they do the same work."""

    images: int = 512
    classes: int = 8
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
    gpu: bool = False
    quick: bool = False
    # Filled in per trainer by the orchestrator.
    dataset_root: str = ""
    socket: str = ""
    daemon_pid: int = 0
    job: int = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.images // self.batch_size

    @property
    def device(self) -> str:
        """The dalid daemon device for these settings: "cpu", or "0" for the first GPU."""
        return "0" if self.gpu else "cpu"

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Settings:
        data = json.loads(text)
        return cls(**{**data, "scaling_jobs": tuple(data["scaling_jobs"])})

    def describe(self) -> dict[str, Any]:
        """The settings that define the run (without per-trainer fields), for the report."""
        data = asdict(self)
        for key in ("dataset_root", "socket", "daemon_pid", "job"):
            data.pop(key)
        return data


QUICK = Settings(
    images=128, epochs=2, repeats=1, transport_iterations=300, scaling_jobs=(1, 2, 4), quick=True
)
