"""The contenders: four ways of getting the same augmented batches into a training loop, the
last of them, dalid, with its jobs sharing one pipeline in the daemon or each with its own, or
with its GPU outputs staged through shared memory; and DALI in-process and dalid in DALI's QA
decoder configuration.

Each is a context manager that sets its loader up, then yields a function returning one
epoch's iterator of ``(images, labels)``; :func:`bench.measure.timed_loop` times it. Each runs
in a trainer subprocess of its own (see :mod:`bench.trainer`), so that CPU time and peak
memory are that contender's alone; the orchestrator also runs some as several concurrent jobs.

DALI and dalid are imported inside the contenders that use them, so that a trainer process
loads only what its contender needs: peak memory is one of the measured figures.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from .config import AREA, CROP, MEAN, RATIO, STD, Settings
from .dataset import read_imagefolder
from .measure import EpochFactory
from .weights import JOB_WEIGHTS, WEIGHTS


def _loader(
    settings: Settings, dataset: Dataset[Any], make: Any = DataLoader, **options: Any
) -> Any:
    """A DataLoader (``make``: torch's, DALI's or dalid's) with the shared settings; in the
    weighted run, each job's workers keep batches in flight by its weight."""
    prefetch = settings.job_prefetch
    return make(
        dataset,
        batch_size=settings.batch_size,
        num_workers=settings.workers,
        shuffle=True,
        drop_last=True,
        persistent_workers=settings.workers > 0,
        **({"prefetch_factor": prefetch} if prefetch is not None else {}),
        **options,
    )


# --- (1) torch DataLoader with PIL -------------------------------------------------------------


def random_resized_crop_box(width: int, height: int) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``: area and aspect ratio drawn at random."""
    area = width * height
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * random.uniform(*AREA)
        ratio = math.exp(random.uniform(*log_ratio))
        w = round(math.sqrt(target * ratio))
        h = round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            x = random.randint(0, width - w)
            y = random.randint(0, height - h)
            return x, y, x + w, y + h
    # Fallback: a central crop at the nearest allowed aspect ratio.
    ratio = width / height
    if ratio < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif ratio > RATIO[1]:
        w, h = round(height * RATIO[1]), height
    else:
        w, h = width, height
    x, y = (width - w) // 2, (height - h) // 2
    return x, y, x + w, y + h


class PilDataset(Dataset[tuple[torch.Tensor, int]]):
    """Decode with PIL, then torchvision's RandomResizedCrop, flip and Normalize, by hand."""

    def __init__(self, paths: list[Path], labels: list[int], crop: int = CROP) -> None:
        self.paths = paths
        self.labels = labels
        self.crop = crop
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.paths[index]) as file:
            image = file.convert("RGB")
        box = random_resized_crop_box(image.width, image.height)
        # Crop and resize in one step, as torchvision's resized_crop does with PIL images.
        image = image.resize((self.crop, self.crop), Image.Resampling.BILINEAR, box=box)
        if random.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        array = torch.from_numpy(np.array(image)).permute(2, 0, 1)  # a writable copy
        return (array.float() - self.mean) / self.std, self.labels[index]


@contextlib.contextmanager
def torch_pil(settings: Settings) -> Iterator[EpochFactory]:
    folder = read_imagefolder(settings.dataset_root)
    loader = _loader(settings, PilDataset(list(folder.paths), list(folder.labels), settings.crop))
    yield lambda: iter(loader)


# --- (2) DALI in-process -----------------------------------------------------------------------


@contextlib.contextmanager
def dali_inprocess(settings: Settings) -> Iterator[EpochFactory]:
    from nvidia.dali.plugin.base_iterator import LastBatchPolicy
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    from .pipelines import reader_pipeline

    pipe = reader_pipeline(
        settings.dataset_root,
        settings.batch_size,
        settings.threads,
        settings.gpu,
        settings.seed + settings.job,
        pipeline=settings.pipeline,
        hw_decoder_load=settings.hw_decoder_load,
        crop=settings.crop,
    )
    iterator = DALIGenericIterator(
        [pipe],
        ["images", "labels"],
        reader_name="Reader",
        last_batch_policy=LastBatchPolicy.DROP,
        auto_reset=True,
    )
    yield functools.partial(_dali_epoch, iterator)


def _dali_epoch(iterator: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for outputs in iterator:
        yield outputs[0]["images"], outputs[0]["labels"]


class JpegDataset(Dataset[tuple[np.ndarray, int]]):
    """Yields ``(file bytes, label)``: a DataLoader worker reads the file, the trainer's DALI
    pipeline decodes it."""

    def __init__(self, root: str) -> None:
        folder = read_imagefolder(root)
        self.paths = list(folder.paths)
        self.labels = list(folder.labels)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        return np.fromfile(self.paths[index], dtype=np.uint8), self.labels[index]


def collate_jpegs(samples: list[tuple[np.ndarray, int]]) -> tuple[list[np.ndarray], np.ndarray]:
    """A batch as ``external_source`` takes it: the files' bytes, and the labels."""
    return [jpeg for jpeg, _ in samples], np.array([label for _, label in samples], np.int64)


class LoaderSource:
    """A DataLoader as an ``external_source`` iterable: its batches, an epoch at a time. The
    loader's end of epoch ends the pipeline's, and the next call starts the loader's next
    epoch (DALI's reset does not ask an iterable for a new iterator)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self._batches: Iterator[Any] | None = None

    def __iter__(self) -> LoaderSource:
        return self

    def __next__(self) -> Any:
        if self._batches is None:
            self._batches = iter(self._loader)
        try:
            return next(self._batches)
        except StopIteration:
            self._batches = None
            raise


@contextlib.contextmanager
def dali_fed(settings: Settings) -> Iterator[EpochFactory]:
    """DALI in-process fed by DataLoader workers: the workers read the files, the trainer's
    DALI pipeline takes their batches through ``external_source`` and decodes them."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    from .pipelines import fed_pipeline

    loader = _loader(settings, JpegDataset(settings.dataset_root), collate_fn=collate_jpegs)
    pipe = fed_pipeline(
        LoaderSource(loader),
        settings.batch_size,
        settings.threads,
        settings.gpu,
        settings.seed + settings.job,
        pipeline=settings.pipeline,
        hw_decoder_load=settings.hw_decoder_load,
        crop=settings.crop,
    )
    # No reader: the loader's StopIteration ends each epoch, and the pipeline's reset starts
    # the next one's iterator.
    iterator = DALIGenericIterator([pipe], ["images", "labels"], auto_reset=True)
    yield functools.partial(_dali_epoch, iterator)


# --- (3) DALI's proxy, and (4) dalid, which is a drop-in for it --------------------------------


class PathDataset(Dataset[tuple[Any, int]]):
    """Yields ``(proxy(path bytes), label)``: the pipeline reads and decodes the file. With
    ``passes``, every image ``passes`` times per epoch (the jobs of the weighted run)."""

    def __init__(self, proxy: Any, root: str, passes: int = 1) -> None:
        folder = read_imagefolder(root)
        self.proxy = proxy
        paths = [np.frombuffer(str(path).encode(), dtype=np.int8) for path in folder.paths]
        self.paths = paths * passes
        self.labels = list(folder.labels) * passes

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.proxy(self.paths[index]), self.labels[index]


@contextlib.contextmanager
def dali_proxy(settings: Settings) -> Iterator[EpochFactory]:
    from .pipelines import patch_nvtx_for_cpu_torch

    patch_nvtx_for_cpu_torch()  # must come before the proxy module is imported
    from nvidia.dali.plugin.pytorch.experimental import proxy

    pipe = _path_pipeline(settings)
    # Not timed: leaving the DALIServer takes 5 s (its thread polls with a 5 s timeout), and
    # joining its DataLoader workers at exit about 5 s each.
    with proxy.DALIServer(pipe) as server:
        dataset = PathDataset(server.proxy, settings.dataset_root)
        loader = _loader(settings, dataset, functools.partial(proxy.DataLoader, server))
        yield lambda: iter(loader)


def _path_pipeline(settings: Settings) -> Any:
    from .pipelines import path_pipeline

    return path_pipeline(
        settings.batch_size,
        settings.threads,
        settings.gpu,
        settings.seed + settings.job,
        pipeline=settings.pipeline,
        hw_decoder_load=settings.hw_decoder_load,
        enable_checkpointing=settings.checkpoint_every > 0,
        crop=settings.crop,
    )


class DalidEpochs:
    """The epochs of a dalid loader (an ``EpochFactory``), counting as each epoch ends the
    slabs and batch events the session has opened so far: each is opened once, so every epoch
    after the pools have filled should open none (GPU outputs: CUDA IPC handle opens)."""

    def __init__(self, session: Any, loader: Any) -> None:
        self._session = session
        self._loader = loader
        self.slabs_opened: list[int] = []
        self.events_opened: list[int] = []

    def __call__(self) -> Iterator[Any]:
        yield from self._loader
        self.slabs_opened.append(self._session.slabs_opened)
        self.events_opened.append(self._session.events_opened)

    def handles(self) -> dict[str, Any]:
        """The counts at the end of each epoch (cumulative), with the session's job id."""
        return {
            "job_id": self._session.job_id,
            "slabs_opened": self.slabs_opened,
            "events_opened": self.events_opened,
        }


@contextlib.contextmanager
def dalid_client(settings: Settings) -> Iterator[EpochFactory]:
    import dalid.client as dalid

    pipe = _path_pipeline(settings)
    name = f"bench job {settings.job}"
    with dalid.connect(
        settings.device, settings.socket, autostart=False, name=name, weight=settings.job_weight
    ) as session:
        proxy = session.proxy(pipe, deterministic=settings.deterministic)
        dataset = PathDataset(proxy, settings.dataset_root, settings.job_passes)
        loader = _loader(settings, dataset, functools.partial(dalid.DataLoader, session))
        if settings.checkpoint_every:
            yield CheckpointingEpochs(session, loader, settings.checkpoint_every)
        else:
            yield DalidEpochs(session, loader)


class CheckpointingEpochs(DalidEpochs):
    """The epochs of a job that saves its loader's state every ``every`` steps, as a training
    loop saves it in its checkpoint (``torch.save``, into memory here: the bench times the
    data path, not a disk)."""

    def __init__(self, session: Any, loader: Any, every: int) -> None:
        super().__init__(session, loader)
        self._every = every
        self._steps = 0
        self.states = 0

    def __call__(self) -> Iterator[Any]:
        for batch in super().__call__():
            yield batch
            self._steps += 1
            if self._steps % self._every == 0:
                torch.save(self._loader.state_dict(), io.BytesIO())
                self.states += 1

    def handles(self) -> dict[str, Any]:
        return {**super().handles(), "loader_states": self.states}


# The cohort of the ``dalid-cohort`` runs: a sweep's jobs, same pipeline, data and sampler seed.
COHORT = "bench-sweep"
# The cohort runs' memory (dalid serve --cohort-memory), half of it for trailing members: a few
# batches, so that a member slowed by TRAILING_S a batch falls past it within a run.
COHORT_MEMORY = ("--cohort-memory", "256M")
TRAILING_S = 0.1


class TrailingEpochs(DalidEpochs):
    """The epochs of a member that waits ``wait_s`` before each batch it takes: it trails the
    other members, further and further."""

    def __init__(self, session: Any, loader: Any, wait_s: float) -> None:
        super().__init__(session, loader)
        self._wait_s = wait_s

    def __call__(self) -> Iterator[Any]:
        for batch in super().__call__():
            time.sleep(self._wait_s)
            yield batch


@contextlib.contextmanager
def dalid_cohort(settings: Settings) -> Iterator[EpochFactory]:
    """``dalid_client`` as a member of one cohort, whose DataLoader shuffles with the same
    seed as every other member's: their batches are the same, each run once in the daemon."""
    import dalid.client as dalid

    pipe = _path_pipeline(settings)
    name = f"bench job {settings.job}"
    with dalid.connect(
        settings.device,
        settings.socket,
        autostart=False,
        name=name,
        weight=settings.job_weight,
        cohort=COHORT,
    ) as session:
        dataset = PathDataset(session.proxy(pipe), settings.dataset_root, settings.job_passes)
        sampler_seed = torch.Generator().manual_seed(settings.seed)
        loader = _loader(
            settings, dataset, functools.partial(dalid.DataLoader, session), generator=sampler_seed
        )
        if settings.trailing_s and settings.job == 0:
            yield TrailingEpochs(session, loader, settings.trailing_s)
        else:
            yield DalidEpochs(session, loader)


def _trailing(settings: Settings) -> Settings:
    return settings.with_(trailing_s=TRAILING_S)


# Steps between two loader states in the checkpoint runs: a training loop's checkpoint period.
CHECKPOINT_EVERY = 100


def _deterministic(settings: Settings) -> Settings:
    return settings.with_(deterministic=True)


def _checkpointed(settings: Settings) -> Settings:
    # An epoch shorter than that (the default CPU run has 16 steps) takes one a epoch.
    every = min(CHECKPOINT_EVERY, max(settings.batches_per_epoch, 1))
    return settings.with_(deterministic=True, checkpoint_every=every)


# --- the registry ------------------------------------------------------------------------------


def _same(settings: Settings) -> Settings:
    return settings


def _weighted(settings: Settings) -> Settings:
    return settings.with_(weights=JOB_WEIGHTS)


@dataclass(frozen=True)
class Contender:
    key: str
    label: str
    description: str
    run: Callable[[Settings], contextlib.AbstractContextManager[EpochFactory]]
    needs_daemon: bool = False
    daemon_args: tuple[str, ...] = ()  # options of ``dalid serve`` beyond the bench's own
    # The run's settings as this contender uses them (the QA configuration's, say).
    configure: Callable[[Settings], Settings] = _same
    # Whether the orchestrator reads the jobs' queues in the daemon while they run.
    watch_queues: bool = False


CONTENDERS: dict[str, Contender] = {
    c.key: c
    for c in (
        Contender(
            "torch-pil",
            "torch + PIL",
            "torch DataLoader whose workers decode with PIL, then crop, flip and normalize",
            torch_pil,
        ),
        Contender(
            "dali",
            "DALI in-process",
            "a DALI pipeline in the trainer: fn.readers.file and DALIGenericIterator",
            dali_inprocess,
        ),
        Contender(
            "dali-fed",
            "DALI in-process, fed by workers",
            "a DALI pipeline in the trainer fed by DataLoader workers that read the files: "
            "fn.external_source and DALIGenericIterator",
            dali_fed,
        ),
        Contender(
            "dali-proxy",
            "DALI proxy",
            "DALI's experimental proxy: DataLoader workers feed paths to a DALIServer thread",
            dali_proxy,
        ),
        Contender(
            "dalid",
            "dalid (shared)",
            "the same path pipeline, run by a dalid daemon through dalid.client; jobs that "
            "register it share one pipeline in the daemon (the default)",
            dalid_client,
            needs_daemon=True,
        ),
        Contender(
            "dalid-cohort",
            "dalid (cohort)",
            "as dalid, its jobs members of one cohort with the same sampler seed: each batch "
            "runs once in the daemon and every job gets its outputs",
            dalid_cohort,
            needs_daemon=True,
            daemon_args=COHORT_MEMORY,
            watch_queues=True,
        ),
        Contender(
            "dalid-cohort-trailing",
            "dalid (cohort, one trailing)",
            "as dalid (cohort), its first job waiting 0.1 s before each batch: a member that "
            "falls further and further behind, past the cohort's window; what it costs the "
            "others",
            dalid_cohort,
            needs_daemon=True,
            daemon_args=COHORT_MEMORY,
            configure=_trailing,
            watch_queues=True,
        ),
        Contender(
            "dalid-private",
            "dalid (private)",
            "as dalid, with a pipeline of its own in the daemon for every job "
            "(dalid serve --share-pipelines no)",
            dalid_client,
            needs_daemon=True,
            daemon_args=("--share-pipelines", "no"),
        ),
        Contender(
            "dalid-deterministic",
            "dalid (deterministic)",
            "as dalid, its job deterministic=True: a pipeline of its own whose batches run in "
            "the trainer's order; no loader state taken (the checkpoint row's baseline)",
            dalid_client,
            needs_daemon=True,
            configure=_deterministic,
        ),
        Contender(
            "dalid-checkpoint",
            "dalid (deterministic, checkpoints)",
            "as dalid (deterministic), its pipeline made with enable_checkpointing=True and a "
            f"loader state (with the pipeline's DALI checkpoint) saved every {CHECKPOINT_EVERY} "
            "steps (once an epoch if shorter): what resuming mid-epoch costs",
            dalid_client,
            needs_daemon=True,
            configure=_checkpointed,
        ),
        Contender(
            "dalid-staged",
            "dalid (staged)",
            "as dalid, with its GPU outputs staged through shared memory as where CUDA IPC "
            "cannot work (dalid serve --gpu-outputs staged): what the fallback costs",
            dalid_client,
            needs_daemon=True,
            daemon_args=("--gpu-outputs", "staged"),
        ),
        Contender(
            "dali-qa",
            "DALI in-process, QA configuration",
            "DALI in-process in DALI's QA decoder configuration (hw_decoder_bench -p rn50: "
            "batch 408, 70 threads, hw_decoder_load 0.12)",
            dali_inprocess,
            configure=Settings.for_qa,
        ),
        Contender(
            "dalid-qa",
            "dalid, QA configuration",
            "the QA configuration through dalid: the job's own pipeline in the daemon keeps "
            "its batch and threads (dalid serve --share-pipelines no)",
            dalid_client,
            needs_daemon=True,
            daemon_args=("--share-pipelines", "no"),
            configure=Settings.for_qa,
        ),
        Contender(
            WEIGHTS,
            "dalid (shared), weights 1 and 3",
            "two dalid jobs of weights 1 and 3 sharing one pipeline in the daemon (the "
            "default), both kept busy: an epoch goes over the images twice, the heavier's six "
            "times, whose workers keep three times the batches in flight",
            dalid_client,
            needs_daemon=True,
            configure=_weighted,
            watch_queues=True,
        ),
    )
}

QA_KINDS = ("dali-qa", "dalid-qa")
SMALL_KINDS = ("dali", "dali-fed", "dali-proxy", "dalid")
"""The small profile's contenders (``dali-fed`` runs elsewhere only when asked)."""
CHECKPOINT_KINDS = ("dalid-deterministic", "dalid-checkpoint")
"""The checkpoint rows, side by side: run when asked (``--only``), not by default."""
GPU_KINDS = ("dalid-staged", *QA_KINDS)
"""Contenders of the GPU profile, which the CPU profile runs in quick mode only (their code
runs, scaled down; their figures mean nothing on the CPU)."""
