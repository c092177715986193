"""Training script the behavioural tests run under the real launcher (one process per rank).

It trains a small MLP with dropout (so RNG state matters) under DDP with elastrun.train, and
writes what the tests check into ``--out``:

* ``batches.r<rank>.jsonl``: one line per step *before* its commit (attempt, step, epoch, indices).
  The latest attempt that logged a step is the one whose commit counted (an uncommitted step is
  re-executed, and logged again, by the next attempt).
* ``restore.r<rank>.a<attempt>.json``: what ``restore()`` returned (``State.last_restore``), the PID and its
  agent's PID (which node's worker it is: a node's group rank can change between rounds).
* ``final.json`` (rank 0): final step and a SHA-256 of the parameters.

Faults are injected from ``--crash ATTEMPT:RANK:STEP:WHERE`` (repeatable): in attempt ATTEMPT
(``TORCHELASTIC_RESTART_COUNT``) rank RANK SIGKILLs itself at step STEP, WHERE being ``before``
(after ``optimizer.step()``, before ``commit()``), ``after`` (after ``commit()``) or ``copy``
(in the middle of the memory-snapshot copy, between two of its chunks).

``--fsdp`` shards the model with FSDP2 (``fully_shard``, AdamW) instead; rank 0 then also writes
``digest.jsonl`` (attempt, step, world size, SHA-256 of the full parameters of each committed step: taken
just before the commit, written with it) and
the restore records carry the digest of what was restored.  ``--truncate ATTEMPT:RANK:STEP``
truncates that rank's newest shard snapshot file just before a crash injected at the same step.
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
from elastrun.train import reform


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--every", type=int, default=0)
    p.add_argument("--snapshot-every", type=int, default=1, help="0: the default spacing (chosen from the cost)")
    p.add_argument("--wide", action="store_true", help="a model of 2 MiB of state (build_net)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--crash", action="append", default=[])
    p.add_argument("--ddp", action="store_true", help="wrap in DDP (else all-reduce gradients by hand)")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) and use AdamW")
    p.add_argument("--cuda", action="store_true", help="with --fsdp: the model and batches on this rank's GPU")
    p.add_argument("--hsdp", action="store_true", help="with --fsdp: HSDP, 2 replica groups (an even world size)")
    p.add_argument("--load-dcp", default=None, help="on a fresh start, load this DCP checkpoint (State.load_dcp)")
    p.add_argument("--truncate", default=None, help="ATTEMPT:RANK:STEP: truncate a shard snapshot before a crash")
    p.add_argument("--stop-at-step", type=int, default=0, help="exit cleanly once this step is committed")
    p.add_argument("--flush", action="store_true", help="wait for each commit's writes (no checkpoint skipped)")
    p.add_argument("--reform", action="store_true", help="run the training body with et.run (in-process re-forms)")
    p.add_argument("--hold-file", default=None, help="below --hold-world, wait (at most 120 s) while this file exists")
    p.add_argument("--hold-world", type=int, default=2)
    p.add_argument("--pause-file", default=None,
                   help="from step --pause-after (or the step the file holds), wait (120 s at most) while it exists, "
                   "in OUT/paused.rRANK")
    p.add_argument("--pause-after", type=int, default=0)
    a = p.parse_args()

    out = Path(a.out)
    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(99)
    xs = torch.randn(a.samples, 8, generator=g)
    ys = torch.randn(a.samples, 1, generator=g)
    dataset = torch.utils.data.TensorDataset(torch.arange(a.samples), xs, ys)
    net = build_net(a.wide)
    if a.reform and a.fsdp:  # issue 24: the model is built and sharded on each group, inside train()
        sampler = et.ElasticSampler(dataset, batch_size=a.batch, seed=7)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=a.workers)
        state = make_state(a, None, None, sampler)
        built: dict[str, torch.nn.Module] = {}

        def body(st: et.State) -> bool | None:
            torch.manual_seed(1234)
            built["net"] = fresh = build_net(a.wide)
            model = fsdp(fresh, a.cuda)
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            st.attach(model, opt)
            return train(a, out, fresh, model, opt, sampler, loader, st)

        et.run(body, state)
        net = built["net"]
    elif a.reform:  # in-process re-forms: the group and DDP are made by et.run and train()
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        sampler = et.ElasticSampler(dataset, batch_size=a.batch, seed=7)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=a.workers)
        state = make_state(a, net, opt, sampler)
        et.run(lambda st: train(a, out, net, None, opt, sampler, loader, st), state)
    else:
        info = et.init_distributed()
        model = fsdp(net, a.cuda, a.hsdp) if a.fsdp else DDP(net) if a.ddp else net
        opt = torch.optim.AdamW(model.parameters(), lr=0.01) if a.fsdp else torch.optim.SGD(
            model.parameters(), lr=0.05, momentum=0.9)
        sampler = et.ElasticSampler(dataset, batch_size=a.batch, seed=7)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=a.workers)
        state = make_state(a, model, opt, sampler)
        t0 = time.monotonic()
        source = state.restore()
        if source is None and a.load_dcp:
            state.load_dcp(a.load_dcp)
        print(f"rank {info.rank}: restore -> {source} step {state.step} in {time.monotonic() - t0:.3f}s", flush=True)
        if train(a, out, net, model, opt, sampler, loader, state) is None:
            return
    state.close()
    rank = torch.distributed.get_rank()
    sha = digest(net)
    if rank == 0:
        (out / "final.json").write_text(json.dumps({"step": state.step, "sha256": sha}))
    print(f"rank {rank} done at step {state.step}", flush=True)


def pause_from(path: str) -> float:
    """The step from which a rank waits while ``path`` exists (the number it holds, else 0); inf without it."""
    try:
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        return float("inf")
    return int(text) if text else 0


def build_net(wide: bool = False) -> torch.nn.Module:
    """The model; ``wide``: 2 MiB of state with SGD momentum instead of a few hundred bytes (over the 1 MiB
    from which a snapshot is copied in the background, and spaced by its measured cost by default)."""
    if wide:
        return torch.nn.Sequential(torch.nn.Linear(8, 512), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                   torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))


def fsdp(net: torch.nn.Module, cuda: bool = False, hsdp: bool = False) -> torch.nn.Module:
    """FSDP2 per layer; ``hsdp``: on a 2-D mesh (2 replica groups × world/2 shards) when the world
    size is even, so rank r's twin (the same chunks) is rank r + world/2."""
    from torch.distributed.fsdp import fully_shard

    if cuda:
        net.to(torch.device("cuda", torch.cuda.current_device()))
    mesh = None
    world = torch.distributed.get_world_size()
    if hsdp and world % 2 == 0:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda" if cuda else "cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def digest(net: torch.nn.Module) -> str:
    """SHA-256 of the full parameters and buffers (collective under FSDP2)."""
    h = hashlib.sha256()
    for t in net.state_dict().values():
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        h.update(t.detach().cpu().numpy().tobytes())
    return h.hexdigest()


_copied: dict[int, int] = {}


def record_copies(out: Path, rank: int) -> None:
    """Append this rank's newest copy to another node's memory, as its agent reported it, to
    ``copied.r<rank>.jsonl`` (step, ok) when it changed."""
    from elastrun.shared.replicas import PushStatus, status_path

    status = PushStatus.read(status_path(Path(os.environ.get("ELASTRUN_SNAPSHOT_DIR", "/nonexistent")), "shard", rank))
    if status is None or _copied.get(rank) == status.step:
        return
    _copied[rank] = status.step
    with open(out / f"copied.r{rank}.jsonl", "a") as f:
        f.write(json.dumps({"step": status.step, "ok": status.ok, "error": status.error}) + "\n")


def truncate_newest_shard(rank: int) -> None:
    from elastrun.train.sharded import slots

    snap = Path(os.environ["ELASTRUN_SNAPSHOT_DIR"])
    mine = [f for f in slots.scan(snap, os.environ["TORCHELASTIC_RUN_ID"]) if f.rank == rank]
    newest = max(mine, key=lambda f: f.step)
    os.truncate(newest.data, newest.header["nbytes"] // 2)


def make_state(a: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer, sampler) -> et.State:
    return et.State(
        model=model,
        optimizer=opt,
        sampler=sampler,
        checkpoint_dir=a.ckpt,
        checkpoint_every=a.every,
        snapshot_every=a.snapshot_every or None,
        losses=[],
    )


def train(a, out: Path, net, model, opt, sampler, loader, state) -> bool | None:
    """The training body (``fn`` of ``et.run`` with ``--reform``); None when stopped early."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if model is None:
        model = DDP(net) if a.ddp else net
    restored = {"source": state.last_restore, "step": state.step, "world_size": world,
                "epoch": sampler.epoch, "pid": os.getpid(), "agent": int(os.environ.get("ELASTRUN_AGENT_PID", "0")),
                "from": state.restored_from,
                "transfer": state.last_transfer}  # fmt: skip
    if a.fsdp:
        restored["sha256"] = digest(net)
    record = out / f"restore.r{rank}.a{attempt}.json"  # whole or absent: the tests poll for it
    record.with_suffix(".tmp").write_text(json.dumps(restored))
    os.replace(record.with_suffix(".tmp"), record)
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
                if a.hold_file and world < a.hold_world:  # a re-form interrupts this wait (the node joins)
                    deadline = time.monotonic() + 120
                    while os.path.exists(a.hold_file) and time.monotonic() < deadline:
                        time.sleep(0.05)
                record = {"attempt": attempt, "step": step, "epoch": sampler.epoch, "idx": idx.tolist()}
                if a.cuda:
                    x, y = x.cuda(), y.cuda()
                os.write(log, (json.dumps(record) + "\n").encode())
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                if not a.ddp and not a.fsdp:  # what DDP does, without its import cost (tests restart workers often)
                    for prm in net.parameters():
                        torch.distributed.all_reduce(prm.grad)
                        prm.grad /= world
                opt.step()
                if crashes.get(step) == "before":
                    kill_self()
                state.losses = [*state.losses[-4:], round(loss.item(), 6)]
                # The digest is collective: taken before the commit, so that a peer lost in between cannot
                # leave a committed step without its line; the line goes with the commit (one re-form section).
                sha = digest(net) if a.fsdp else None
                try:
                    with reform.section():
                        state.commit()
                        if sha is not None and rank == 0:
                            line = json.dumps({"attempt": attempt, "step": step, "world": world, "sha256": sha})
                            with open(out / "digest.jsonl", "a") as f:
                                f.write(line + "\n")
                except SystemExit:
                    (out / f"preempted.r{rank}.json").write_text(json.dumps({"step": state.step}))
                    raise
                if a.flush:
                    state.flush()
                if step in sync_after:  # "after commit" means: after every rank's commit finished
                    state.flush()
                    torch.distributed.barrier()
                if a.fsdp:
                    record_copies(out, rank)
                if crashes.get(step) == "after":
                    if a.truncate == f"{attempt}:{rank}:{step}":
                        state.flush()
                        truncate_newest_shard(rank)
                    kill_self()
                if a.sleep:
                    time.sleep(a.sleep)
                if a.pause_file and step >= max(a.pause_after, pause_from(a.pause_file)):
                    # the test acts on a paused job (the agents go on); it knows from this file that this rank waits
                    (out / f"paused.r{rank}").write_text(str(step))
                    deadline = time.monotonic() + 120
                    while os.path.exists(a.pause_file) and time.monotonic() < deadline:
                        if a.fsdp:
                            record_copies(out, rank)
                        time.sleep(0.05)
                if a.stop_at_step and state.step >= a.stop_at_step:
                    state.close()
                    return None
    finally:
        os.close(log)
    return True


if __name__ == "__main__":
    main()
