"""A script that checkpoints with ``dcp.save``/``dcp.load`` itself, into node memory (issue 24, item 6).

Attempt 0 trains 4 steps, saves step 2 to node memory with ``et.MemoryWriter`` and to disk with
plain DCP, then rank 1 dies.  The next attempt loads with ``et.MemoryReader(fallback=disk)``; rank 0
writes ``load.a<attempt>.json`` (source, loaded digest) and ``saved.json`` (the digest saved).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

import elastrun.train as et


def digest(net: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for t in net.state_dict().values():
        h.update(t.full_tensor().detach().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    out = Path(sys.argv[1])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    et.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(attempt)  # other weights each attempt: a load must bring the saved ones
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in (net[0], net[2], net):
        fully_shard(layer)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)

    def state_dict() -> dict:
        return {"model": net.state_dict(), "optimizer": get_optimizer_state_dict(net, opt)}

    if attempt > 0:
        sd = state_dict()
        reader = et.MemoryReader(fallback=out / "disk")
        dcp.load(sd, storage_reader=reader)
        set_optimizer_state_dict(net, opt, sd["optimizer"])
        sha = digest(net)
        if rank == 0:
            (out / f"load.a{attempt}.json").write_text(json.dumps({"source": reader.source, "sha256": sha}))
        return
    g = torch.Generator().manual_seed(rank)
    for step in range(1, 5):
        net(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 2:
            dcp.save(state_dict(), storage_writer=et.MemoryWriter(step))
            dcp.save(state_dict(), checkpoint_id=out / "disk")
            sha = digest(net)
            if rank == 0:
                (out / "saved.json").write_text(json.dumps({"sha256": sha}))
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


if __name__ == "__main__":
    main()
