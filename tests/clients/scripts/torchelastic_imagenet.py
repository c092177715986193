"""A training script in the style of TorchElastic's ImageNet example, with generated images.

The pattern of that example, not its code: ``init_process_group(init_method="env://")``, a DDP
model, ``torch.distributed.elastic.utils.data.ElasticDistributedSampler``, a ``State`` object that
is checkpointed by global rank 0 at the end of every epoch to a file that may be on local disk,
and ``load_checkpoint`` at every start, which finds the rank holding the newest checkpoint (an
all-reduce over a temporary gloo group) and broadcasts it to the others, so a node joining with an
empty disk receives the state.  It knows nothing about elastrun.

    torchrun --nnodes=1:2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 torchelastic_imagenet.py \
        --checkpoint-file /local/disk/checkpoint.pt
"""

import argparse
import io
import os
import time
from contextlib import contextmanager

import step_times
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.utils.data import ElasticDistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP


class Images(torch.utils.data.Dataset):
    """``n`` 3x16x16 images of ``classes`` classes: a pattern per class plus noise, made from the index."""

    def __init__(self, n: int, classes: int = 4) -> None:
        self.n, self.classes = n, classes
        self.patterns = torch.randn(classes, 3, 16, 16, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        noise = torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(i))
        return self.patterns[i % self.classes] + noise, i % self.classes


def make_model(classes: int = 4) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(4),
        torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, classes),
    )


class State:
    """What a checkpoint holds: the epoch last completed, the best accuracy, the model and optimizer."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.epoch = -1
        self.best_acc1 = 0.0
        self.model = model
        self.optimizer = optimizer

    def capture_snapshot(self) -> dict:
        return {"epoch": self.epoch, "best_acc1": self.best_acc1,
                "state_dict": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def apply_snapshot(self, obj: dict) -> None:
        self.epoch = obj["epoch"]
        self.best_acc1 = obj["best_acc1"]
        self.model.load_state_dict(obj["state_dict"])
        self.optimizer.load_state_dict(obj["optimizer"])

    def save(self, f) -> None:
        torch.save(self.capture_snapshot(), f)

    def load(self, f) -> None:
        self.apply_snapshot(torch.load(f, map_location="cpu"))


@contextmanager
def tmp_process_group(backend: str):
    group = dist.new_group(backend=backend)
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def load_checkpoint(checkpoint_file: str, model, optimizer) -> State:
    """The newest checkpoint of any rank, broadcast to all (the files need not be on shared disk)."""
    state = State(model, optimizer)
    if os.path.isfile(checkpoint_file):
        print(f"=> loading checkpoint file: {checkpoint_file}")
        state.load(checkpoint_file)
        print(f"=> loaded checkpoint file: {checkpoint_file} (epoch {state.epoch})")
    with tmp_process_group(backend="gloo") as pg:
        rank = dist.get_rank(group=pg)
        epochs = torch.zeros(dist.get_world_size(), dtype=torch.int32)
        epochs[rank] = state.epoch
        dist.all_reduce(epochs, op=dist.ReduceOp.SUM, group=pg)
        t_max_epoch, t_max_rank = torch.max(epochs, dim=0)
        max_epoch, max_rank = t_max_epoch.item(), t_max_rank.item()
        if max_epoch == -1:
            print("=> no workers have checkpoints, starting from epoch 0")
            return state
        print(f"=> using checkpoint from rank: {max_rank}, max_epoch: {max_epoch}")
        with io.BytesIO() as f:
            torch.save(state.capture_snapshot(), f)
            raw = bytearray(f.getvalue())
        length = torch.tensor(len(raw), dtype=torch.int64)
        dist.broadcast(length, src=max_rank, group=pg)
        if rank == max_rank:
            blob = torch.frombuffer(raw, dtype=torch.uint8)
        else:
            blob = torch.zeros(int(length.item()), dtype=torch.uint8)
        dist.broadcast(blob, src=max_rank, group=pg)
        if rank != max_rank:
            with io.BytesIO(blob.numpy().tobytes()) as f:
                state.apply_snapshot(torch.load(f, map_location="cpu"))
            print(f"=> received checkpoint of epoch {state.epoch} from rank {max_rank}")
        dist.barrier(group=pg)
    return state


def save_checkpoint(state: State, filename: str) -> None:
    """Write to a temporary file, then rename: a job killed mid-write keeps the previous checkpoint."""
    os.makedirs(os.path.dirname(filename) or ".", exist_ok=True)
    tmp = filename + ".tmp"
    with open(tmp, "wb") as f:
        state.save(f)
    os.replace(tmp, filename)
    print(f"=> saved checkpoint for epoch {state.epoch} at {filename}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--checkpoint-file", required=True)
    p.add_argument("--step-seconds", type=float, default=0.0, help="pretend each step is heavier")
    args = p.parse_args()

    dist.init_process_group(backend="gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank} of world {world}, restart count {os.environ.get('TORCHELASTIC_RESTART_COUNT')}")
    torch.manual_seed(0)
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_set, val_set = Images(args.samples), Images(64)
    sampler = ElasticDistributedSampler(train_set)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=args.batch_size)

    state = load_checkpoint(args.checkpoint_file, model, optimizer)
    start_epoch = state.epoch + 1
    print(f"=> start_epoch: {start_epoch}, best_acc1: {state.best_acc1:.3f}")
    for epoch in range(start_epoch, args.epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch)
        model.train()
        for i, (x, y) in enumerate(train_loader):
            t0 = step_times.begin()
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(args.step_seconds)
            step_times.end(epoch, i, t0)
        model.eval()
        correct = torch.zeros(2)
        with torch.no_grad():
            for x, y in val_loader:
                correct += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
        acc1 = (correct[0] / correct[1]).item()
        state.best_acc1 = max(state.best_acc1, acc1)
        print(f"epoch {epoch} world {world} acc1 {acc1:.3f}")
        if dist.get_rank() == 0:
            save_checkpoint(state, args.checkpoint_file)
    print(f"done: epoch {args.epochs - 1} reached, best_acc1 {state.best_acc1:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
