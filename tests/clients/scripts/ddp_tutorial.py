"""PyTorch's DDP tutorial pattern ("multi-GPU training with torchrun" / fault-tolerant training), on CPU.

A ``Trainer`` that loads a snapshot at every start if there is one, trains with a
``DistributedSampler``, has the process with ``LOCAL_RANK`` 0 save a snapshot every ``save_every``
epochs, and calls ``destroy_process_group()`` at the end.  Only the backend (gloo) and the device
(CPU) differ from the tutorial.  It knows nothing about elastrun.

    torchrun --nproc-per-node=2 --max-restarts=1 ddp_tutorial.py 8 1 --snapshot-path snap.pt
"""

import argparse
import os
import time

import step_times
import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class RandomData(Dataset):
    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every: int, snapshot_path: str, pause: float) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.pause = pause
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, path: str) -> None:
        snapshot = torch.load(path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets) -> None:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        time.sleep(self.pause)

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[RANK{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for i, (source, targets) in enumerate(self.train_data):
            t0 = step_times.begin()
            self._run_batch(source, targets)
            step_times.end(epoch, i, t0)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        tmp = self.snapshot_path + ".tmp"
        torch.save(snapshot, tmp)
        os.replace(tmp, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.local_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def main() -> None:
    p = argparse.ArgumentParser(description="simple distributed training job")
    p.add_argument("total_epochs", type=int)
    p.add_argument("save_every", type=int)
    p.add_argument("--batch_size", default=32, type=int)
    p.add_argument("--snapshot-path", default="snapshot.pt")
    p.add_argument("--step-seconds", type=float, default=0.0, help="pretend each step is heavier")
    args = p.parse_args()

    init_process_group(backend="gloo")
    dataset = RandomData(512)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset, batch_size=args.batch_size, pin_memory=False, shuffle=False,
                        sampler=DistributedSampler(dataset))
    trainer = Trainer(model, loader, optimizer, args.save_every, args.snapshot_path, args.step_seconds)
    trainer.train(args.total_epochs)
    destroy_process_group()
    print(f"[RANK{trainer.global_rank}] done")


if __name__ == "__main__":
    main()
