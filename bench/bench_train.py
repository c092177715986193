"""Benchmark of elastrun.train on CPU: commit() cost per step and restore time.

Measures, for MLPs of about 10M and 100M parameters trained with SGD + momentum:

* the step time without elastrun.train, the step time with ``state.commit()`` after every step
  (memory snapshots at the default spacing, chosen from what they cost, and every ``k`` commits:
  ``--snapshot-every default,1,4``), and the time ``commit()``
  itself blocks the training thread, from alternating blocks of ``4k`` steps without and with
  ``commit()`` (only one step in ``k`` pays for a copy); the overhead is the median over rounds
  of each pair's ratio, so that a shared VM's drift in speed does not land on one side;
* for the 100M model, ``state.restore()`` from the node's memory, from a peer (two processes,
  one of them with an empty snapshot directory, over gloo) and from disk.

Usage: ``python bench/bench_train.py [--sizes 10,100] [--snapshot-every default,1,4] [--steps 16]``.
Prints a table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import elastrun.train as et  # noqa: E402
from bench.common import run_ranks  # noqa: E402


def make_model(million: int) -> torch.nn.Module:
    """An MLP with about ``million`` × 10^6 parameters (square layers)."""
    width = {10: 1024, 100: 4096}.get(million) or int((million * 1e6 / 6) ** 0.5)
    layers = max(2, round(million * 1e6 / (width * width)))
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    torch.manual_seed(0)
    return torch.nn.Sequential(*mods[:-1])


def width_of(model: torch.nn.Module) -> int:
    return model[0].in_features


def step(model, opt, x) -> None:
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def bench_commit(million: int, steps: int, work: Path, snapshot_every: int | None = 1) -> dict:
    """Blocks of steps without and with ``commit()``, alternated so that drift in the machine's
    speed (a shared VM) hits both alike; each commit block ends with ``flush()`` inside its timing,
    so its last copy is charged to it rather than to the next plain block.  ``snapshot_every=None``:
    the default spacing (blocks of 16 steps; the spacing chosen is reported as ``every``)."""
    model = make_model(million)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    x = torch.randn(64, width_of(model))
    state = et.State(
        model=model, optimizer=opt, checkpoint_dir=work / f"ck{million}", snapshot_dir=work / f"shm{million}",
        handle_signals=False, snapshot_every=snapshot_every,
    )  # fmt: skip
    block = 4 * (snapshot_every or 4)
    for _ in range(block + 1):  # first copies allocate the slots' pages (and the default's spacing is measured)
        step(model, opt, x)
        state.commit()
    state.flush()
    plain_s = commit_s = commit_call_s = 0.0
    ratios = []
    rounds = max(3, -(-steps // block))
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(block):
            step(model, opt, x)
        plain = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(block):
            step(model, opt, x)
            c = time.perf_counter()
            state.commit()
            commit_call_s += time.perf_counter() - c
        state.flush()
        with_commit = time.perf_counter() - t
        plain_s += plain
        commit_s += with_commit
        ratios.append(with_commit / plain - 1)
    t = time.perf_counter()
    state.checkpoint()
    ckpt_s = time.perf_counter() - t
    state.close()
    n = rounds * block
    b, w = plain_s / n, commit_s / n
    return {
        "snapshot_every": snapshot_every,
        "every": state._pipe.every_now,  # the spacing in force at the end (chosen, or the explicit one)
        "params": params,
        "state_mb": (params * 2 * 4) / 2**20,
        "step": b,
        "step_commit": w,
        "commit_call": commit_call_s / n,
        "overhead": statistics.median(ratios),  # per round: robust to the machine's drift
        "checkpoint": ckpt_s,
    }


def restore_once(million: int, snapshot_dir: Path, ckpt: Path) -> tuple[str | None, float]:
    model = make_model(million)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    state = et.State(model=model, optimizer=opt, checkpoint_dir=ckpt, snapshot_dir=snapshot_dir, handle_signals=False)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # time the restore, not the peer still building its model
    t = time.perf_counter()
    source = state.restore()
    elapsed = time.perf_counter() - t
    state.close()
    return source, elapsed


def peer_worker(million: int, snapshot_dir: str, ckpt: str) -> None:
    et.init_distributed()
    source, elapsed = restore_once(million, Path(snapshot_dir), Path(ckpt))
    if torch.distributed.get_rank() == 1:
        print(f"{source} {elapsed}", flush=True)


def bench_peer(million: int, work: Path) -> tuple[str, float]:
    empty = work / "shm-empty"
    empty.mkdir(exist_ok=True)
    argvs = [[sys.executable, __file__, "--peer-worker", str(million), str(snap), str(work / "no-ckpt")]
             for snap in (work / f"shm{million}", empty)]  # fmt: skip
    outs = [out for _, out in run_ranks(argvs, [{}, {}], timeout=300)]
    source, elapsed = outs[1].split()
    return source, float(elapsed)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="10,100", help="model sizes in millions of parameters")
    p.add_argument("--snapshot-every", default="default,1,4",
                   help="values of State(snapshot_every=...) to compare; default: None, the chosen spacing")
    p.add_argument("--steps", type=int, default=16, help="steps of each kind (at least 2 blocks of 4k)")
    p.add_argument("--peer-worker", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.peer_worker:
        peer_worker(int(a.peer_worker[0]), a.peer_worker[1], a.peer_worker[2])
        return
    work = Path(tempfile.mkdtemp(prefix="elastrun-bench-train-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    disk = Path(tempfile.mkdtemp(prefix="elastrun-bench-ckpt-"))
    try:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
        print(
            "| model | state (params+momentum) | snapshot every | step | step + commit | commit() call | overhead "
            "| checkpoint |"
        )
        print("|---|---|---|---|---|---|---|---|")
        sizes = [int(s) for s in a.sizes.split(",")]
        for m in sizes:
            for k in [None if v == "default" else int(v) for v in a.snapshot_every.split(",")]:
                r = bench_commit(m, a.steps, work, k)
                shutil.rmtree(disk / f"ck{m}", ignore_errors=True)
                shutil.move(str(work / f"ck{m}"), str(disk / f"ck{m}"))
                every = k if k else f"default (chose {r['every']})"
                print(
                    f"| {r['params'] / 1e6:.1f}M | {r['state_mb']:.0f} MiB | {every} | {r['step'] * 1e3:.0f} ms | "
                    f"{r['step_commit'] * 1e3:.0f} ms | {r['commit_call'] * 1e3:.1f} ms | "
                    f"{r['overhead'] * 100:+.1f} % | {r['checkpoint']:.2f} s |",
                    flush=True,
                )
        m = max(sizes)
        print(f"\nrestore of the {m}M model:\n| source | time |\n|---|---|")
        src, t = restore_once(m, work / f"shm{m}", disk / f"ck{m}")
        print(f"| {src} | {t:.2f} s |", flush=True)
        src, t = bench_peer(m, work)
        print(f"| {src} (gloo, 2 processes) | {t:.2f} s |", flush=True)
        src, t = restore_once(m, work / "shm-cold", disk / f"ck{m}")
        print(f"| {src} | {t:.2f} s |", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
