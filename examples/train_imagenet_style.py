"""ImageNet-style elastic training on elastrun.train, with generated images (no downloads).

Run it with the launcher, e.g.::

    elastrun --standalone --nproc-per-node=2 examples/train_imagenet_style.py --epochs 2

The training body runs through ``et.run``: when a worker dies (``kill -9``), a node is lost or one
joins, the surviving workers keep their process, roll back to the last commit every rank agrees on
and go on in the new group; only the dead worker is started anew.  ``--plain-loop`` runs the same
body as the usual script (``init_distributed``, ``restore``, the loop), whose workers are all
restarted after a change and resume from the node's memory snapshot, a peer, or the checkpoint
directory.  Either way a job stopped whole (``Ctrl-C``/SIGTERM) and started again resumes, and it
ends with the same parameters.  Works with any number of nodes (``--nnodes=1:4``); the data order
does not depend on how many there are.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import elastrun.train as et


class GeneratedImages(torch.utils.data.Dataset):
    """``n`` 3×32×32 images in ``classes`` classes: a class-specific pattern plus noise.  Each
    image is derived from its index alone, so every process sees the same dataset.  Items are
    ``(image, label, index)``: the index lets ``--audit-dir`` record which samples a step used."""

    def __init__(self, n: int, classes: int = 10, seed: int = 0) -> None:
        self.n, self.classes = n, classes
        g = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(classes, 3, 32, 32, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        label = i % self.classes
        g = torch.Generator().manual_seed(i)
        return self.patterns[label] + 1.5 * torch.randn(3, 32, 32, generator=g), label, i


class Audit:
    """With ``--audit-dir``: one JSON line per event of this process (its restore, then each
    committed step with the sample indices it trained on) in ``samples-g<attempt>-r<rank>.jsonl``,
    so that a checker can prove no committed step was lost and every sample was used once.  Made
    anew at each call of the training body: a worker kept across a re-form has a new attempt."""

    def __init__(self, directory: str | None, rank: int) -> None:
        self._fh = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            self._fh = open(os.path.join(directory, f"samples-g{attempt}-r{rank}.jsonl"), "a")  # noqa: SIM115
        self._base = {"rank": rank, "pid": os.getpid()}

    def write(self, **record: object) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps({**self._base, "t": time.time(), **record}) + "\n")
            self._fh.flush()


class SmallCNN(torch.nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(16)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc = torch.nn.Linear(32 * 8 * 8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


def worker_device() -> torch.device:
    """The device ``et.run`` (``init_distributed``) gives this worker: its ``LOCAL_RANK``'s GPU, else the CPU.
    The model is built on it before the process group exists (the ``State`` is made outside the body)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--checkpoint-dir", default="runs/imagenet_style_ckpt")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--audit-dir", help="record restores and each committed step's samples here (tools/demo.sh)")
    p.add_argument("--plain-loop", action="store_true",
                   help="the usual script instead of et.run: every worker is restarted after a change")
    a = p.parse_args()

    device = worker_device()
    torch.manual_seed(a.seed)
    dataset = GeneratedImages(a.samples, seed=a.seed)
    sampler = et.ElasticSampler(dataset, batch_size=a.batch_size, seed=a.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=a.workers)
    net = SmallCNN().to(device)
    opt = torch.optim.SGD(net.parameters(), lr=a.lr, momentum=0.9)
    state = et.State(
        model=net,
        optimizer=opt,
        sampler=sampler,
        checkpoint_dir=a.checkpoint_dir,
        checkpoint_every=a.checkpoint_every,
    )
    t0 = time.monotonic()
    #: The audit record of the step being committed, until it is written: a re-form that interrupts the
    #: body as commit() returns (its interrupt waits for the commit's end) would leave it unwritten.
    unwritten: list[dict] = []

    def train(state: et.State) -> None:
        """The training body: everything that depends on the group is made here, at every call."""
        rank, world = dist.get_rank(), dist.get_world_size()
        audit = Audit(a.audit_dir, rank)
        source = state.last_restore
        if unwritten and unwritten[0]["step"] == state.step:  # committed, then the re-form came: record it now
            audit.write(**unwritten[0])
        unwritten.clear()  # or rolled back: that step is done again
        audit.write(restored=state.step, source=source, world_size=world)
        if rank == 0:
            if source == "live":  # a re-form: this process held the commit itself
                where = f"kept its process, rolled back to step {state.step}"
            else:
                where = f"restored step {state.step} from {source}" if source else "fresh start"
            print(f"world size {world}: {where} (epoch {sampler.epoch}, sample {sampler.position}; "
                  f"pid {os.getpid()})", flush=True)
        # After a restore every rank holds the same parameters: DDP's own broadcast is needed only at first.
        model = DDP(net, init_sync=source is None)
        loss = torch.zeros(())
        while sampler.epoch < a.epochs:
            correct = seen = 0
            for x, y, index in loader:
                x, y = x.to(device), y.to(device)
                out = model(x)
                loss = F.cross_entropy(out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                correct += (out.argmax(1) == y).sum().item()
                seen += len(y)
                unwritten[:] = [{"step": state.step + 1, "epoch": sampler.epoch, "samples": index.tolist()}]
                state.commit()
                audit.write(**unwritten.pop())
                if rank == 0 and state.step % 10 == 0:
                    print(
                        f"step {state.step:4d}  epoch {sampler.epoch}  loss {loss.item():.4f}  "
                        f"accuracy (this rank, this epoch) {correct / max(seen, 1):.3f}  "
                        f"{time.monotonic() - t0:.1f} s",
                        flush=True,
                    )
        state.flush()
        if rank == 0:
            digest = hashlib.sha256()
            for t in net.state_dict().values():
                digest.update(bytes(t.detach().cpu().clone().untyped_storage()))  # no numpy needed
            print(f"done: {state.step} steps, final loss {loss.item():.4f}, parameters sha256 "
                  f"{digest.hexdigest()[:16]}")

    if a.plain_loop:
        et.init_distributed()
        state.restore()
        train(state)
    else:
        et.run(train, state)


if __name__ == "__main__":
    main()
