"""A PyTorch Lightning DataModule whose batches come from a dalid daemon.

    ./dev run python -m examples.lightning_datamodule [--data DIR] [--epochs 1] [--socket PATH]
        [--checkpoints DIR [--checkpoint-every N]] [--resume CHECKPOINT]

The DataModule opens its dalid session in ``setup`` and closes it in ``teardown``, and its
``train_dataloader`` is a ``dalid.client.DataLoader``: the LightningModule receives the
daemon's outputs as ordinary tensors.

The loader has ``state_dict()`` and ``load_state_dict()`` (torchdata's ``StatefulDataLoader``),
so Lightning keeps its state in each checkpoint, mid-epoch ones included: ``--checkpoints DIR``
saves one every ``--checkpoint-every`` steps, and ``--resume`` one of them carries on from the
batch after it (docs/migration.md, "Checkpoints").
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import dalid.client as dalid
from examples.imagefolder import ImageFolder, add_data_arguments, classifier, dataset_root
from examples.imagefolder_train import SIZE, train_pipeline


class DalidImageFolder(L.LightningDataModule):
    """An ImageFolder decoded and augmented by the dalid daemon of this process's device."""

    def __init__(
        self,
        root: Path,
        batch_size: int = 16,
        num_workers: int = 2,
        socket: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        self.root = root
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.socket = socket
        self.session: dalid.Session | None = None
        self.dataset: ImageFolder | None = None

    def setup(self, stage: str) -> None:
        if self.session is None or self.session.closed:
            self.session = dalid.connect(socket=self.socket, name="lightning")
        pipeline = train_pipeline(batch_size=self.batch_size, num_threads=2, device_id=None)
        self.dataset = ImageFolder(self.root, transform=self.session.proxy(pipeline))

    def train_dataloader(self) -> dalid.DataLoader:
        assert self.session is not None and self.dataset is not None
        return dalid.DataLoader(
            self.session,
            self.dataset,
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.num_workers,
            drop_last=True,
            persistent_workers=self.num_workers > 0,
        )

    def teardown(self, stage: str) -> None:
        if self.session is not None:
            self.session.close()


class Classifier(L.LightningModule):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.model = classifier(num_classes)
        self.images = 0

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        images, labels = batch
        assert images.shape[1:] == (3, SIZE, SIZE)
        self.images += len(labels)
        loss = torch.nn.functional.cross_entropy(self.model(images), labels)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_arguments(parser)
    parser.add_argument("--checkpoints", type=Path, help="save checkpoints into this folder")
    parser.add_argument("--checkpoint-every", type=int, default=2, help="steps between them")
    parser.add_argument("--resume", type=Path, help="a checkpoint to resume from")
    args = parser.parse_args(argv)
    L.seed_everything(0, verbose=False)
    with dataset_root(args) as root:
        data = DalidImageFolder(root, args.batch_size, args.workers, args.socket)
        module = Classifier(num_classes=len(ImageFolder(root).classes))
        callbacks: list[L.Callback] = []
        if args.checkpoints is not None:
            # Mid-epoch checkpoints: each holds the DataLoader's state (Lightning saves the
            # state of a loader that has state_dict(), and restores it on resume).
            callbacks.append(
                ModelCheckpoint(
                    dirpath=args.checkpoints,
                    every_n_train_steps=args.checkpoint_every,
                    save_top_k=-1,
                )
            )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=args.epochs,
            logger=False,
            enable_checkpointing=args.checkpoints is not None,
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, datamodule=data, ckpt_path=args.resume)
    print(f"trained on {module.images} images with Lightning", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
