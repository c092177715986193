"""A PyTorch Lightning script, as a user would write it for torchrun: ``Trainer(strategy="ddp")``.

Lightning sees the launcher's environment (``torch.distributed.is_torchelastic_launched()`` and
the ranks torchrun sets) and uses those processes instead of starting its own.  ``ModelCheckpoint``
keeps ``last.ckpt`` and ``fit(ckpt_path=...)`` resumes from it after a restart.  It knows nothing
about elastrun.

    torchrun --nproc-per-node=2 lightning_train.py --checkpoint-dir ckpt
"""

import argparse
import os
import time

import pytorch_lightning as pl
import step_times
import torch
from pytorch_lightning.callbacks import ModelCheckpoint


class Regression(pl.LightningModule):
    def __init__(self, step_seconds: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.step_seconds = step_seconds

    def training_step(self, batch, _index):
        x, y = batch
        time.sleep(self.step_seconds)
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_train_batch_start(self, _batch, _index) -> None:
        self._t0 = step_times.begin()

    def on_train_batch_end(self, _outputs, _batch, index) -> None:
        step_times.end(self.current_epoch, index, self._t0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def on_train_start(self) -> None:
        t = self.trainer
        print(f"global_rank {t.global_rank} world_size {t.world_size} epoch {t.current_epoch}", flush=True)

    def on_train_epoch_end(self) -> None:
        if self.trainer.is_global_zero:
            print(f"epoch {self.current_epoch} done", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--step-seconds", type=float, default=0.0, help="pretend each step is heavier")
    args = p.parse_args()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), strategy="ddp",
        max_epochs=args.epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True)],
    )
    last = os.path.join(args.checkpoint_dir, "last.ckpt")
    trainer.fit(Regression(args.step_seconds), loader, ckpt_path=last if os.path.exists(last) else None)
    if trainer.is_global_zero:
        print(f"done: {trainer.current_epoch} epochs, world_size {trainer.world_size}", flush=True)


if __name__ == "__main__":
    main()
