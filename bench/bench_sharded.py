"""Benchmark of sharded states (FSDP2) in elastrun.train on CPU: commit() cost and restore times.

A 100M-parameter MLP (6 square layers of 4096, each ``fully_shard``-ed, AdamW), 2 ranks on gloo,
each rank a process of its own with its own snapshot directory (as on two nodes):

* ``commit()`` every step: step time without and with it, from alternating blocks of 4 steps (the
  overhead is the median over rounds of each pair's ratio, robust to a shared VM's drift), and the
  time ``commit()`` itself blocks the training thread;
* restore of the committed step into freshly built models, timed from a barrier after the model is
  built: from memory at the same world size (2 → 2, each rank from its own node), from memory at a
  new world size (2 → 3: the third rank's node is empty, so every rank reads part of its new shard
  from a peer), from the DCP checkpoint on disk at 3 ranks (``State.restore()`` with empty node
  memory: manifest check, then DCP's reader), and plain ``dcp.load`` of that checkpoint at 3 ranks.
  The checkpoint was just written: its files are in the page cache (a warm disk).

With ``--peer`` (issue 24, wave 2), each "node" also gets what its agent runs under elastrun: a
snapshot server and a replicator (here in the benchmark's own process, one of each per node
directory), and the figures add:

* ``commit()`` with the peer copy on (``copies=2``: each rank's committed shard is copied into the
  other node's memory in the background) beside the same job without it, and the node memory
  that takes (own slots and replicas);
* the 2 → 3 restore through the snapshot servers, and the peer transfer rate it reached;
* one rank reading a whole shard file from a server over loopback (the raw transfer rate);
* a DDP joiner's restore (a 100M plain model, 1 → 2: the new rank's node is empty), over the
  process group (gloo broadcast, what restores did before) and through the snapshot server.

Usage: ``python bench/bench_sharded.py [--million 100] [--rounds 3] [--peer]``.  Prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import elastrun.train as et  # noqa: E402
from bench.common import run_ranks  # noqa: E402
from elastrun.train.snapclient import STREAMS  # noqa: E402

BATCH = 32


def make_model(million: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    width = 4096 if million >= 50 else 1024
    layers = max(2, round(million * 1e6 / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def step(model, opt, x) -> None:
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def worker_commit(a: argparse.Namespace) -> dict:
    """One rank of the 2-rank job: timing rounds, then a durable checkpoint of the last commit."""
    model = make_model(a.million)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.randn(BATCH, model[0].in_features)
    state = et.State(model=model, optimizer=opt, checkpoint_dir=a.ckpt, snapshot_dir=a.snap, handle_signals=False,
                     copies=a.copies)  # fmt: skip
    state.restore()  # a fresh start; it also finds the other nodes' snapshot servers (the copies' targets)
    lags: list[int] = []  # at each commit with copies: commits since the newest step every copy of which finished
    for _ in range(5):  # AdamW's state exists after the first step; the first copies allocate the slots' pages
        step(model, opt, x)
        state.commit()
        if a.copies > 1 and state.step > 1:
            lags.append(state.step - (state.copied_step or 0))
    state.flush()
    plain_s = commit_s = call_s = 0.0
    ratios = []
    for _ in range(a.rounds):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(4):
            step(model, opt, x)
        plain = time.perf_counter() - t
        dist.barrier()
        t = time.perf_counter()
        for _ in range(4):
            step(model, opt, x)
            c = time.perf_counter()
            state.commit()
            call_s += time.perf_counter() - c
            if a.copies > 1:
                lags.append(state.step - (state.copied_step or 0))
        state.flush()
        with_commit = time.perf_counter() - t
        plain_s, commit_s = plain_s + plain, commit_s + with_commit
        ratios.append(with_commit / plain - 1)
    state.checkpoint()
    state.flush()
    if a.copies > 1:  # the last copy lands (the agents' work, not the step's)
        deadline = time.monotonic() + 120
        while state._sharded.copies.busy() and time.monotonic() < deadline:
            time.sleep(0.05)
    nbytes = sum(p.stat().st_size for p in Path(a.snap).glob(f"shard.r{dist.get_rank()}.*.data"))
    replicas = sum(p.stat().st_size for p in Path(a.snap).glob("replicas/*/*.data"))
    state.close()
    n = 4 * a.rounds
    return {"step": plain_s / n, "step_commit": commit_s / n, "call": call_s / n,
            "overhead": statistics.median(ratios), "shm_bytes": nbytes, "replica_bytes": replicas,
            "lags": lags}  # fmt: skip


def worker_ddp(a: argparse.Namespace) -> dict:
    """A plain (DDP-shaped) 100M model: ``--mode commit`` saves it at 1 rank; ``--mode restore``
    restores it at 2 ranks, the second rank's node empty (a joiner)."""
    torch.manual_seed(0)
    width = 4096
    layers = max(2, round(a.million * 1e6 / width**2))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    if a.mode == "torch.load":  # what a torchrun job does: every rank reloads the checkpoint file
        dist.barrier()
        t = time.perf_counter()
        saved = torch.load(a.step_dir, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        elapsed = time.perf_counter() - t
        check = [float(v.double().sum()) for v in model.state_dict().values()]
        return {"source": "torch.load", "seconds": elapsed, "transfer": None, "check": check}
    state = et.State(model=model, optimizer=opt, snapshot_dir=a.snap, handle_signals=False)
    if a.mode == "commit":
        state.commit()
        state.flush()
        state.close()
        if a.step_dir:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, a.step_dir)
        return {}
    dist.barrier()
    t = time.perf_counter()
    source = state.restore()
    elapsed = time.perf_counter() - t
    state.close()
    check = [float(v.double().sum()) for v in model.state_dict().values()]  # the same on every rank
    return {"source": source, "seconds": elapsed, "transfer": state.last_transfer, "check": check}


def worker_restore(a: argparse.Namespace) -> dict:
    model = make_model(a.million)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    if a.mode == "plain-dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        dist.barrier()
        t = time.perf_counter()
        sd = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=a.step_dir)
        set_optimizer_state_dict(model, opt, sd["optimizer"])
        return {"source": "dcp.load", "seconds": time.perf_counter() - t}
    state = et.State(model=model, optimizer=opt, checkpoint_dir=a.ckpt, snapshot_dir=a.snap, handle_signals=False)
    dist.barrier()  # time the restore, not the peers still building their models
    t = time.perf_counter()
    source = state.restore()
    elapsed = time.perf_counter() - t
    state.close()
    return {"source": source, "seconds": elapsed, "transfer": state.last_transfer}


class Nodes:
    """What each node's agent runs under elastrun, for the benchmark's "nodes" (directories): a
    snapshot server and a replicator each, in this process."""

    def __init__(self, dirs: list[Path]) -> None:
        from elastrun.agent.replicator import Replicator
        from elastrun.agent.snapserver import SnapshotServer

        self.servers, self.replicators = [], []
        for i, d in enumerate(dirs):
            d.mkdir(parents=True, exist_ok=True)
            server = SnapshotServer(d, None, ("127.0.0.1", 0), "127.0.0.1")
            server.start()
            rep = Replicator(d, None, f"node{i}", warn=lambda m: print(f"warning: {m}", file=sys.stderr))
            rep.start()
            self.servers.append(server)
            self.replicators.append(rep)

    def env(self, i: int) -> dict[str, str]:
        return {"ELASTRUN_SNAPSHOT_SERVER": self.servers[i].address}

    def close(self) -> None:
        for rep in self.replicators:
            rep.close()
        for server in self.servers:
            server.close()


def raw_rate(directory: Path, server: str) -> tuple[int, float]:
    """One client reads the whole of the newest shard file under ``directory`` from ``server``."""
    from elastrun.train.sharded import slots
    from elastrun.train.snapclient import Get, fetch, writable

    f = max(slots.scan(directory, "bench-sharded"), key=lambda f: f.step)
    nbytes = f.header["nbytes"]
    into = torch.empty(nbytes, dtype=torch.uint8)  # fresh pages, as a restore's new tensors
    t = time.perf_counter()
    errors = fetch(server, None, [Get("", f.name, f.meta_crc, 0, nbytes, writable(into))])
    elapsed = time.perf_counter() - t
    assert errors == [None], errors
    return nbytes, elapsed


def rate(transfer: dict | None) -> str:
    if not transfer or not transfer.get("seconds"):
        return "-"
    return f"{transfer['bytes'] / 2**20:.0f} MiB at {transfer['bytes'] / transfer['seconds'] / 1e9:.2f} GB/s"


def run_job(a: argparse.Namespace, role: str, snaps: list[Path], extra: list[str],
            envs: list[dict[str, str]] | None = None) -> list[dict]:  # fmt: skip
    argvs = [[sys.executable, __file__, "--worker", role, "--snap", str(snap), "--million", str(a.million),
              "--rounds", str(a.rounds), "--copies", str(a.copies), *extra] for snap in snaps]  # fmt: skip
    ran = run_ranks(argvs, [dict(TORCHELASTIC_RUN_ID="bench-sharded", **(envs[r] if envs else {}))
                            for r in range(len(snaps))], timeout=900)  # fmt: skip
    if any(code for code, _ in ran):
        raise RuntimeError(f"{role} job failed: {[code for code, _ in ran]}")
    outs = [out for _, out in ran]
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def ddp_joiner(a: argparse.Namespace, shm: Path) -> None:
    """A DDP joiner's restore (plain model saved at 1 rank, restored at 2, the new node empty), over
    the process group and through the holder's snapshot server."""
    ddp = [shm / f"ddp{i}" for i in range(2)]
    ckpt = Path(tempfile.mkdtemp(prefix="elastrun-bench-ddp-ckpt-")) / "state.pt"  # on disk (page cache warm)
    run_job(a, "ddp", ddp[:1], ["--mode", "commit", "--step-dir", str(ckpt)])
    print(f"\n| DDP joiner restore (plain {a.million}M model, SGD), 1 → 2 | source | time (holder / joiner) | moved |"
          "\n|---|---|---|---|")  # fmt: skip
    ddp_nodes = Nodes(ddp)
    try:
        for what, envs, mode in (
            ("over the process group (gloo broadcast)", None, "restore"),
            ("through the holder's snapshot server (the default under elastrun)", [ddp_nodes.env(i) for i in range(2)],
             "restore"),
            ("torchrun's way: every rank torch.load()s the checkpoint file", None, "torch.load"),
        ):  # fmt: skip
            res = run_job(a, "ddp", ddp, ["--mode", mode, "--step-dir", str(ckpt)], envs)
            if res[0]["check"] != res[1]["check"]:
                raise RuntimeError("the joiner's restored model differs from the holder's")
            times = " / ".join(f"{x['seconds']:.2f} s" for x in res)
            print(f"| {what} | {', '.join(str(x['source']) for x in res)} | {times} | {rate(res[1]['transfer'])} |",
                  flush=True)
    finally:
        ddp_nodes.close()
        shutil.rmtree(ckpt.parent, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--million", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3, help="pairs of 4-step blocks without and with commit()")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--snap", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--step-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--copies", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--peer", action="store_true", help="also the peer copy, the snapshot servers, DDP joiners")
    p.add_argument("--ddp", action="store_true", help="only the DDP joiner's restore (over gloo and the server)")
    p.add_argument("--commit-only", action="store_true", help="only the commit() rows (with --peer: 1 and 2 copies)")
    p.add_argument("--copy-counts", default="1,2", help="with --peer: the copies= values of the commit() rows")
    p.add_argument("--busy", type=int, default=0, help="this many busy-loop processes beside the job (a loaded host)")
    p.add_argument("--idle-only", action="store_true",
                   help="copies stay at idle priority however late (the rule before, for comparison)")
    a = p.parse_args()
    if a.worker:
        et.init_distributed()
        workers = {"commit": worker_commit, "restore": worker_restore, "ddp": worker_ddp}
        out = workers[a.worker](a)
        print(json.dumps(out), flush=True)
        dist.destroy_process_group()
        return
    shm = Path(tempfile.mkdtemp(prefix="elastrun-bench-sharded-", dir="/dev/shm"))
    if a.ddp:
        try:
            print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
            ddp_joiner(a, shm)
            print(f"\nload average after: {os.getloadavg()[0]:.1f}")
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        return
    disk = Path(tempfile.mkdtemp(prefix="elastrun-bench-sharded-ckpt-"))
    node = [shm / f"node{i}" for i in range(4)]
    if a.idle_only:
        from elastrun.agent import replicator

        replicator.TAKE_OVER = False
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        if busy:
            print(f"{len(busy)} busy-loop process(es) beside the job (a loaded host)")
        if a.idle_only:
            print("copies at idle priority only (the rule before)")
        print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        ckpt = ["--ckpt", str(disk)]
        print(f"\n{a.million}M parameters, FSDP2 at 2 ranks (gloo), AdamW; batch {BATCH}")
        print("| copies | step | step + commit() | commit() call | overhead (median of rounds) | node memory per rank "
              "(own slots + replicas) |\n|---|---|---|---|---|---|")  # fmt: skip
        nodes = None
        for copies in [int(c) for c in a.copy_counts.split(",")] if a.peer else (1,):
            a.copies = copies
            if copies > 1:
                for d in node[:2]:
                    shutil.rmtree(d, ignore_errors=True)
                nodes = Nodes(node[:3])
            where = ckpt if copies == 1 else ["--ckpt", str(disk / "with-copies")]  # a fresh start, as the first
            r = run_job(a, "commit", node[:2], where, [nodes.env(i) for i in range(2)] if nodes else None)
            for rank, x in enumerate(r):
                print(f"| {copies} | {x['step'] * 1e3:.0f} ms | {x['step_commit'] * 1e3:.0f} ms | "
                      f"{x['call'] * 1e3:.1f} ms | {x['overhead'] * 100:+.1f} % | "
                      f"{(x['shm_bytes'] + x['replica_bytes']) / 2**30:.2f} GiB = {x['shm_bytes'] / 2**30:.2f} + "
                      f"{x['replica_bytes'] / 2**30:.2f} (rank {rank}) |", flush=True)  # fmt: skip
            if nodes is not None:
                lags = sorted(lag for x in r for lag in x["lags"])
                late = sum(rep.stats["late"] for rep in nodes.replicators)
                made = sum(rep.stats["copies"] for rep in nodes.replicators)
                print(f"\nreplica lag at each commit (commits since the newest step whose copies all finished): "
                      f"median {statistics.median(lags)}, max {max(lags)}; copies {made}, of which taken over "
                      f"late {late}", flush=True)  # fmt: skip
        if a.commit_only:
            if nodes is not None:
                nodes.close()
            print(f"\nload average after: {os.getloadavg()[0]:.1f}")
            return
        a.copies = 1
        plain = ["--mode", "plain-dcp", "--step-dir", str(max(disk.glob("step-*")))]  # the first job's
        print("\n| restore of the committed step | source (per rank) | time (slowest rank) |\n|---|---|---|")
        for what, snaps, extra in (
            ("2 → 2, node memory", node[:2], []),
            ("2 → 3, node memory (third node empty)", node[:3], []),
            ("2 → 3, DCP checkpoint (State.restore)", [shm / f"empty{i}" for i in range(3)], ckpt),
            ("2 → 3, plain dcp.load of that checkpoint", node[:3], plain),
        ):  # fmt: skip
            res = run_job(a, "restore", snaps, extra)
            print(f"| {what} | {', '.join(str(x['source']) for x in res)} | {max(x['seconds'] for x in res):.2f} s |",
                  flush=True)  # fmt: skip
        if nodes is not None:
            res = run_job(a, "restore", node[:3], [], [nodes.env(i) for i in range(3)])
            print(f"| 2 → 3, node memory, through the snapshot servers | {', '.join(str(x['source']) for x in res)} "
                  f"| {max(x['seconds'] for x in res):.2f} s (peer ranges: "
                  f"{'; '.join(rate(x['transfer']) for x in res)}) |", flush=True)  # fmt: skip
            nbytes, took = raw_rate(node[0], nodes.servers[0].address)
            print(f"\nraw transfer: one rank read a {nbytes / 2**20:.0f} MiB shard file from a snapshot server "
                  f"over loopback (snapclient.fetch, {STREAMS} connections) in {took:.3f} s: "
                  f"{nbytes / took / 1e9:.2f} GB/s", flush=True)  # fmt: skip
            ddp_joiner(a, shm)
            nodes.close()
        print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    finally:
        for p in busy:
            p.kill()
            p.wait()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
