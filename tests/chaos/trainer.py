"""The training script the chaos harness runs under real elastrun agents (one process per rank).

A small MLP learns a fixed regression task with ``elastrun.train`` (``State``, ``ElasticSampler``,
``init_distributed``); gradients are averaged by hand with one ``all_reduce`` (what DDP does,
without its import cost: chaos restarts workers often).  No dropout, so the parameters depend only
on which samples each committed step used and on the world size of that step.

What it records under ``--out`` (read back by :mod:`tests.chaos.verify`):

* ``steps.<pid>.jsonl``: one line per step, written just *before* ``commit()``:
  ``{"g": generation, "s": step, "e": epoch, "w": world size, "r": rank, "i": sample ids,
  "h": SHA-256 of the parameters after the step, "p": pid, "t": time}``.
  A step whose commit did not survive is run again by a later generation, so for every step the
  records of the latest generation that ran it are the committed ones.
* ``restore.<pid>.<generation>.json``: generation, rank, world size, restored step and source, pid,
  SHA-256 of the restored parameters, time.
* ``final.pt`` and ``final.json`` (rank 0, at the end): the parameters and their SHA-256.

With ``--reform`` the training body runs through ``et.run``: a worker that survives a change
keeps its process (same PID, one more ``restore.<pid>.<generation>.json``) instead of being
restarted.

With ``--sharded`` the MLP is sharded with FSDP2 (``fully_shard`` per ``Linear`` and at the root),
so every rank snapshots its own shard and each restore reshards the state to the new world size
(the last layer's one-row weight and its bias leave every rank but one an empty shard).  FSDP2's
reduce-scatter averages the gradients; the flag of the hold file goes in an all-reduce of its own.
Parameters are hashed whole (``full_tensor``, a collective on every rank).  Under ``et.run`` the
model is built and sharded on each new group, inside the body, and handed to ``State.attach``.

Fault hooks: SIGUSR2 makes the worker ``exit(1)`` at once (the harness's "worker exit" fault).

Length: with ``--hold-file``, training goes on (each step sleeping ``--pace`` s) for as long as
that file exists, so the harness can inject any number of faults into one job.  Whether it still
exists travels with the gradient all-reduce (one extra element), so every rank sees the release at
the same step; the job then finishes the current epoch.  The end epoch is part of the committed
state (a ``State`` extra), so a restart after the release ends at the same epoch.  Without
``--hold-file`` the job runs ``--epochs`` epochs (the failure-free reference).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch

import elastrun
import elastrun.train as et

FEATURES = 8


def build(samples: int) -> tuple[torch.utils.data.TensorDataset, torch.nn.Module, torch.optim.Optimizer]:
    """Dataset (sample id, x, y), model and optimizer: identical in every process and in the replay."""
    g = torch.Generator().manual_seed(99)
    xs = torch.randn(samples, FEATURES, generator=g)
    ys = (xs @ torch.linspace(-1, 1, FEATURES, dtype=torch.float32)).unsqueeze(1) + 0.1 * torch.randn(
        samples, 1, generator=g
    )
    dataset = torch.utils.data.TensorDataset(torch.arange(samples), xs, ys)
    net = build_net()
    return dataset, net, optimizer(net)


def build_net() -> torch.nn.Module:
    """The MLP, with the same initial parameters in every process and in the replay."""
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9)


def shard(net: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 on the current group: each ``Linear``, then the root (in place; returns ``net``)."""
    from torch.distributed.fsdp import fully_shard

    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(net)


def local_step(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """This rank's flat gradient of the mean loss over its slice."""
    net.zero_grad(set_to_none=False)
    torch.nn.functional.mse_loss(net(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()])


def apply_grad(net: torch.nn.Module, opt: torch.optim.Optimizer, flat: torch.Tensor) -> None:
    offset = 0
    for p in net.parameters():
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p))
        offset += n
    opt.step()


def full_state(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers whole (a collective on every rank when sharded)."""
    return {k: t.full_tensor() if hasattr(t, "full_tensor") else t for k, t in net.state_dict().items()}


def digest(net: torch.nn.Module, whole: dict[str, torch.Tensor] | None = None) -> str:
    """SHA-256 of the parameters and buffers (``whole``: :func:`full_state` of ``net``, already gathered)."""
    h = hashlib.sha256()
    for t in (whole if whole is not None else full_state(net)).values():
        h.update(t.detach().numpy().tobytes())
    return h.hexdigest()


def _append(fd: int, record: dict) -> None:
    os.write(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", default=None, help="durable checkpoint directory (pre-emption, whole-job loss)")
    p.add_argument("--every", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--pace", type=float, default=0.0)
    p.add_argument("--hold-file", default=None)
    p.add_argument("--max-epochs", type=int, default=10000, help="a bound on a held job")
    p.add_argument("--reform", action="store_true", help="train through et.run (in-process re-forms)")
    p.add_argument("--sharded", action="store_true", help="shard the model with FSDP2")
    a = p.parse_args()

    signal.signal(signal.SIGUSR2, lambda *_: os._exit(1))
    out = Path(a.out)
    dataset, net, opt = build(a.samples)
    sampler = et.ElasticSampler(dataset, batch_size=a.batch, seed=7)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    end_epoch = None if a.hold_file else a.epochs
    if a.reform and a.sharded:  # a sharded model belongs to its group: built again on each one
        state = et.State(sampler=sampler, checkpoint_dir=a.ckpt, checkpoint_every=a.every, end_epoch=end_epoch)
        built: dict[str, torch.nn.Module] = {}

        def body(st: et.State) -> None:
            built["net"] = net = shard(build_net())
            opt = optimizer(net)
            st.attach(net, opt)
            train(a, out, net, opt, sampler, loader, st)

        et.run(body, state)
        net = built["net"]
    elif a.reform:
        state = et.State(model=net, optimizer=opt, sampler=sampler, checkpoint_dir=a.ckpt,
                         checkpoint_every=a.every, end_epoch=end_epoch)
        et.run(lambda st: train(a, out, net, opt, sampler, loader, st), state)
    else:
        et.init_distributed()
        if a.sharded:  # restarted on every change: sharded once, on the one group it has
            net = shard(net)
            opt = optimizer(net)
        state = et.State(model=net, optimizer=opt, sampler=sampler, checkpoint_dir=a.ckpt,
                         checkpoint_every=a.every, end_epoch=end_epoch)
        state.restore()
        train(a, out, net, opt, sampler, loader, state)
    state.flush()
    whole = full_state(net)  # a collective when sharded: every rank
    sha = digest(net, whole)
    if torch.distributed.get_rank() == 0:
        gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        torch.save(whole, out / "final.pt")
        (out / "final.json").write_text(json.dumps({"step": state.step, "g": gen, "sha256": sha}))
    state.close()


def train(a: argparse.Namespace, out: Path, net: torch.nn.Module, opt: torch.optim.Optimizer,
          sampler: et.ElasticSampler, loader: torch.utils.data.DataLoader, state: et.State) -> None:
    """The training body, from a restored state to the end (``fn`` of ``et.run`` with ``--reform``:
    called again in the same process after each re-form, so rank, world size and generation are
    read here)."""
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    restored = {"g": gen, "r": rank, "w": world, "s": state.step, "src": state.last_restore, "p": os.getpid(),
                "h": digest(net), "t": time.time()}
    (out / f"restore.{os.getpid()}.{gen}.json").write_text(json.dumps(restored))
    elastrun.heartbeat()
    log = os.open(out / f"steps.{os.getpid()}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while sampler.epoch < (state.end_epoch if state.end_epoch is not None else a.max_epochs):
            for idx, x, y in loader:
                holding = torch.tensor([1.0 if a.hold_file and os.path.exists(a.hold_file) else 0.0])
                if a.sharded:  # FSDP2 averages the gradients in the backward's reduce-scatter
                    opt.zero_grad(set_to_none=True)
                    torch.nn.functional.mse_loss(net(x), y).backward()
                    torch.distributed.all_reduce(holding)
                    opt.step()
                else:
                    flat = torch.cat([local_step(net, x, y), holding])
                    torch.distributed.all_reduce(flat)
                    apply_grad(net, opt, flat[:-1] / world)
                    holding = flat[-1:]
                held = state.end_epoch is None and holding.item() == world
                if state.end_epoch is None and not held:
                    state.end_epoch = sampler.epoch + 1
                record = {"g": gen, "s": state.step + 1, "e": sampler.epoch, "w": world, "r": rank,
                          "i": idx.tolist(), "h": digest(net), "p": os.getpid(), "t": time.time()}
                _append(log, record)
                state.commit()  # also the progress heartbeat for the agent's hang detection
                if held and a.pace:
                    time.sleep(a.pace)
    finally:
        os.close(log)


if __name__ == "__main__":
    main()
