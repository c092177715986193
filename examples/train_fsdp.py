"""A torchtitan-shaped FSDP2 job that loses a node and gains one, on this machine, with nothing lost.

Run it from the repository (no arguments needed; a few dozen seconds on a laptop CPU)::

    python examples/train_fsdp.py

It starts three elastrun agents on loopback, each a "node" with one worker (``--nnodes=2:3``, gloo).
The workers train a small Transformer (embedding, blocks of attention and MLP, norm, output), each
block and the whole model ``fully_shard``-ed (FSDP2), AdamW, built on the meta device inside the
function ``et.run`` calls and handed to the ``State`` with ``state.attach``.  Every commit snapshots
each rank's shard into its node's memory, and the agents copy it into the next node's memory (two
copies: the default).  Then the script

1. SIGKILLs the third agent and its worker (a node loss: its memory is gone): the two survivors
   re-form in their own processes and load their new shards from memory, the lost node's shard
   from the replica on a surviving node;
2. starts a fourth agent (a join): the joiner reads its new shard from the survivors' snapshot
   servers, and the survivors keep their processes again.

It prints, for each event, the committed steps lost (0), where every rank read every old shard
from (``memory``, ``replica``, ``peer``, ``peer replica``, ``disk``) and the time to the first step.
Logs stay in the printed directory.  The worker side (``--worker``) is what a user's script looks like.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------------- the model


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def init_weights(self) -> None:
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x)
        return self.output(self.norm(x))


class Sequences(torch.utils.data.Dataset):
    """Token sequences that follow a rule the model can learn (each derived from its index alone)."""

    def __init__(self, n: int, length: int = 33, vocab: int = 512) -> None:
        self.n, self.length, self.vocab = n, length, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        start, stride = torch.randint(0, self.vocab, (2,), generator=g).tolist()
        return (start + (stride | 1) * torch.arange(self.length)) % self.vocab


# ----------------------------------------------------------------------------------- the worker


def worker(a: argparse.Namespace) -> None:
    """What a user's script is: the model built and sharded inside ``train``, ``state.attach``."""
    from torch.distributed.fsdp import fully_shard

    import elastrun.train as et

    out = Path(a.out)
    dataset = Sequences(a.samples)
    sampler = et.ElasticSampler(dataset, batch_size=a.batch, seed=0)
    state = et.State(sampler=sampler, checkpoint_dir=str(out / "ckpt"), checkpoint_every=20)

    def record(**what: object) -> None:
        line = json.dumps({"pid": os.getpid(), "t": time.time(), **what}) + "\n"
        with open(out / "events.jsonl", "a") as f:
            f.write(line)

    def train(state: et.State) -> None:
        began = time.time()
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        with torch.device("meta"):
            model = Transformer()
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if state.attach(model, opt) is None:  # nothing saved yet: a fresh start
            torch.manual_seed(0)
            model.init_weights()
        record(event="restore", rank=rank, world=world, source=state.last_restore, step=state.step,
               shards=state.restored_from, began=began, restore_s=time.time() - began)  # fmt: skip
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
        first, copied = True, None
        while sampler.epoch < a.epochs:
            for tokens in loader:
                loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
                state.commit()
                if first:
                    record(event="first_step", rank=rank, world=world, step=state.step, seconds=time.time() - began)
                    first = False
                if state.copied_step != copied:
                    copied = state.copied_step
                    record(event="copied", rank=rank, world=world, step=copied)
                if rank == 0:
                    record(event="step", world=world, step=state.step, loss=round(loss.item(), 4))
                time.sleep(a.pace)

    et.run(train, state)
    state.close()


# ----------------------------------------------------------------------------------- the driver


class Job:
    """The agents of one job on this machine, and what their workers recorded."""

    def __init__(self, out: Path, a: argparse.Namespace) -> None:
        self.out, self.a = out, a
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.run_id = f"fsdp-example-{uuid.uuid4().hex[:6]}"
        self.agents: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> None:
        cmd = [sys.executable, "-m", "elastrun", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}",
               f"--rdzv-id={self.run_id}", "--nnodes=2:3", "--nproc-per-node=1", "--max-restarts=3",
               __file__, "--worker", "--out", str(self.out), "--samples", str(self.a.samples),
               "--epochs", str(self.a.epochs), "--batch", str(self.a.batch), "--pace", str(self.a.pace)]  # fmt: skip
        with open(self.out / f"agent-{name}.log", "wb") as log:
            self.agents[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self, name: str) -> None:
        p = self.agents.pop(name)
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the agent and its worker: the node is gone
        except ProcessLookupError:
            pass  # it had ended
        p.wait(10)

    def events(self, kind: str, since: float = 0.0) -> list[dict]:
        try:
            lines = (self.out / "events.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        return [e for e in map(json.loads, lines) if e["event"] == kind and e["t"] >= since]

    def wait(self, what: str, predicate, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = predicate()
            if got:
                return got
            for name, p in self.agents.items():
                if p.poll() not in (None, 0):
                    raise SystemExit(f"agent {name} failed (exit {p.returncode}); logs in {self.out}")
            time.sleep(0.1)
        raise SystemExit(f"timed out waiting for {what}; logs in {self.out}")

    def world(self, size: int, since: float) -> dict[int, dict]:
        """Once every rank of a group of ``size`` restored and committed its first step: rank -> both."""
        restores = {e["rank"]: e for e in self.events("restore", since) if e["world"] == size}
        firsts = {e["rank"]: e for e in self.events("first_step", since) if e["world"] == size}
        if len(restores) == size and len(firsts) == size:
            return {r: {**restores[r], "first": firsts[r]} for r in range(size)}
        return {}

    def stop(self) -> None:
        for name in list(self.agents):
            self.kill(name)


def show(group: dict[int, dict], since: float, event: str, pids: set[int]) -> None:
    for rank, e in sorted(group.items()):
        shards = ", ".join(f"old rank {old}: {src}" for old, src in sorted(e["shards"].items(), key=_by_rank))
        kept = "same process" if e["pid"] in pids else "new process"
        after = f"{e['first']['t'] - since:.2f} s after {event}, "
        print(f"  rank {rank} ({kept}): restored step {e['step']} from {e['source']} in {e['restore_s']:.2f} s; "
              f"first step {after}{e['first']['seconds']:.2f} s after its training function started")
        print(f"    its new shard came from: {shards or '-'}")


def drive(a: argparse.Namespace) -> None:
    out = Path(tempfile.mkdtemp(prefix="elastrun-fsdp-example-"))
    job = Job(out, a)
    try:
        t0 = time.time()
        job.start("a")  # it hosts the rendezvous store (c10d): the node that is not lost
        job.wait("agent a's rendezvous store", lambda: _listening(job.port), 60)
        job.start("b")  # the job starts at 2 nodes (--nnodes=2:3): b and c, started together, make
        job.start("c")  # its first round together
        three = job.wait("3 nodes", lambda: job.world(3, t0))
        pids = {e["pid"] for e in three.values()}
        print(f"3 nodes x 1 worker training (FSDP2, gloo); logs in {out}")
        # a few copy steps at world 3, then the loss of node c
        job.wait("copies at world 3", lambda: all(
            any(e["rank"] == r and e["world"] == 3 and e["step"] is not None and e["step"] >= 5
                for e in job.events("copied", t0)) for r in range(3)))  # fmt: skip
        committed = max(e["step"] for e in job.events("step", t0))
        lost_at = time.time()
        job.kill("c")
        safe = min(max(e["step"] for e in job.events("copied", t0) if e["rank"] == r and e["step"] is not None)
                   for r in range(3))  # fmt: skip
        two = job.wait("the survivors", lambda: job.world(2, lost_at))
        restored = two[0]["step"]
        print(f"\nnode c lost at step {committed} (copies in another node's memory finished through step {safe}):")
        print(f"  committed steps lost: {max(0, safe - restored)}  (steps redone: {max(0, committed - restored)})")
        show(two, lost_at, "the loss", pids)
        pids |= {e["pid"] for e in two.values()}
        job.wait("progress at world 2", lambda: any(e["world"] == 2 and e["step"] >= restored + 5
                                                    for e in job.events("step", lost_at)))  # fmt: skip
        joined_at = time.time()
        job.start("d")
        three = job.wait("the join", lambda: job.world(3, joined_at))
        print(f"\nnode d joined at step {three[0]['step']}:")
        show(three, joined_at, "agent d was started", pids)
        end = job.agents["a"].wait(600)
        steps = job.events("step")
        print(f"\njob finished (exit {end}): {steps[-1]['step']} steps, loss {steps[0]['loss']} -> {steps[-1]['loss']}")
    finally:
        job.stop()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _by_rank(item: tuple[str, str]) -> int:
    return int(item[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--worker", action="store_true", help="run as a worker (the agents start it so)")
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--samples", type=int, default=4800)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pace", type=float, default=0.05, help="seconds of sleep after each step (to watch it)")
    a = p.parse_args()
    worker(a) if a.worker else drive(a)


if __name__ == "__main__":
    main()
