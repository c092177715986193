"""Training script the behavioural tests run under the real launcher (one process per rank).

It trains a small MLP with dropout (so RNG state matters) under DDP with elastrun.train, and
writes what the tests check into ``--out``:

* ``batches.r<rank>.jsonl``: one line per step *before* its commit (attempt, step, epoch, indices).
  The latest attempt that logged a step is the one whose commit counted (an uncommitted step is
  re-executed, and logged again, by the next attempt).
* ``restore.r<rank>.a<attempt>.json``: what ``restore()`` returned (``State.last_restore``), and the PID.
* ``final.json`` (rank 0): final step and a SHA-256 of the parameters.

Faults are injected from ``--crash ATTEMPT:RANK:STEP:WHERE`` (repeatable): in attempt ATTEMPT
(``TORCHELASTIC_RESTART_COUNT``) rank RANK SIGKILLs itself at step STEP, WHERE being ``before``
(after ``optimizer.step()``, before ``commit()``), ``after`` (after ``commit()``) or ``copy``
(in the middle of the memory-snapshot copy, between two of its chunks).
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
from torch.nn.parallel import DistributedDataParallel as DDP

import elastrun.train as et
import elastrun.train.copier as et_copier


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--every", type=int, default=0)
    p.add_argument("--snapshot-every", type=int, default=1)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--crash", action="append", default=[])
    p.add_argument("--ddp", action="store_true", help="wrap in DDP (else all-reduce gradients by hand)")
    p.add_argument("--stop-at-step", type=int, default=0, help="exit cleanly once this step is committed")
    p.add_argument("--flush", action="store_true", help="wait for each commit's writes (no checkpoint skipped)")
    p.add_argument("--reform", action="store_true", help="run the training body with et.run (in-process re-forms)")
    p.add_argument("--hold-file", default=None, help="at world size 1, wait (at most 120 s) while this file exists")
    a = p.parse_args()

    out = Path(a.out)
    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(99)
    xs = torch.randn(a.samples, 8, generator=g)
    ys = torch.randn(a.samples, 1, generator=g)
    dataset = torch.utils.data.TensorDataset(torch.arange(a.samples), xs, ys)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    if a.reform:  # in-process re-forms: the group and DDP are made by et.run and train()
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        sampler = et.ElasticSampler(dataset, batch_size=a.batch, seed=7)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=a.workers)
        state = make_state(a, net, opt, sampler)
        et.run(lambda st: train(a, out, net, None, opt, sampler, loader, st), state)
    else:
        info = et.init_distributed()
        model = DDP(net) if a.ddp else net
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sampler = et.ElasticSampler(dataset, batch_size=a.batch, seed=7)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=a.workers)
        state = make_state(a, model, opt, sampler)
        t0 = time.monotonic()
        source = state.restore()
        print(f"rank {info.rank}: restore -> {source} step {state.step} in {time.monotonic() - t0:.3f}s", flush=True)
        if train(a, out, net, model, opt, sampler, loader, state) is None:
            return
    state.close()
    rank = torch.distributed.get_rank()
    if rank == 0:
        digest = hashlib.sha256()
        for t in net.state_dict().values():
            digest.update(t.numpy().tobytes())
        (out / "final.json").write_text(json.dumps({"step": state.step, "sha256": digest.hexdigest()}))
    print(f"rank {rank} done at step {state.step}", flush=True)


def make_state(a: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer, sampler) -> et.State:
    return et.State(
        model=model,
        optimizer=opt,
        sampler=sampler,
        checkpoint_dir=a.ckpt,
        checkpoint_every=a.every,
        snapshot_every=a.snapshot_every,
        losses=[],
    )


def train(a, out: Path, net, model, opt, sampler, loader, state) -> bool | None:
    """The training body (``fn`` of ``et.run`` with ``--reform``); None when stopped early."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if model is None:
        model = DDP(net) if a.ddp else net
    (out / f"restore.r{rank}.a{attempt}.json").write_text(
        json.dumps({"source": state.last_restore, "step": state.step, "world_size": world,
                    "epoch": sampler.epoch, "pid": os.getpid()})
    )
    crashes = {}
    sync_after = set()  # steps after which every rank has committed before someone crashes
    for spec in a.crash:
        at, rk, st, where = spec.split(":")
        if int(at) == attempt and where == "after":
            sync_after.add(int(st))
        if int(at) == attempt and int(rk) == rank:
            crashes[int(st)] = where
    copy_steps = {s for s, where in crashes.items() if where == "copy"}
    if copy_steps:  # tear the memory-snapshot copy of those steps in the middle
        real_chunk = et_copier.copy_chunk
        chunks_of_step: dict[int, int] = {}

        def torn_chunk(destination, source, nbytes):
            if state.step in copy_steps:
                chunks_of_step[state.step] = chunks_of_step.get(state.step, 0) + 1
                if chunks_of_step[state.step] == 3:  # some chunks copied, the rest not
                    kill_self()
            real_chunk(destination, source, nbytes)

        et_copier.copy_chunk = torn_chunk
    log = os.open(out / f"batches.r{rank}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while sampler.epoch < a.epochs:
            for idx, x, y in loader:
                step = state.step + 1
                if a.hold_file and world == 1:  # a re-form interrupts this wait (the node joins)
                    deadline = time.monotonic() + 120
                    while os.path.exists(a.hold_file) and time.monotonic() < deadline:
                        time.sleep(0.05)
                record = {"attempt": attempt, "step": step, "epoch": sampler.epoch, "idx": idx.tolist()}
                os.write(log, (json.dumps(record) + "\n").encode())
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                if not a.ddp:  # what DDP does, without its import cost (tests restart workers often)
                    for prm in net.parameters():
                        torch.distributed.all_reduce(prm.grad)
                        prm.grad /= world
                opt.step()
                if crashes.get(step) == "before":
                    kill_self()
                state.losses = [*state.losses[-4:], round(loss.item(), 6)]
                try:
                    state.commit()
                except SystemExit:
                    (out / f"preempted.r{rank}.json").write_text(json.dumps({"step": state.step}))
                    raise
                if a.flush:
                    state.flush()
                if step in sync_after:  # "after commit" means: after every rank's commit finished
                    state.flush()
                    torch.distributed.barrier()
                if crashes.get(step) == "after":
                    kill_self()
                if a.sleep:
                    time.sleep(a.sleep)
                if a.stop_at_step and state.step >= a.stop_at_step:
                    state.close()
                    return None
    finally:
        os.close(log)
    return True


if __name__ == "__main__":
    main()
