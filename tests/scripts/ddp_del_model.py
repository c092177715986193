"""A plain DDP script that frees its model right after its last all-reduce.

The shape that exposes torch's process-group teardown race (pytorch#56297): the rank's work is
done and its result written, then the interpreter's exit may hang or abort.  Prints
``done RANK SUM`` as its last act.
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(int(os.environ.get("STEPS", "3"))):
        optimizer.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        optimizer.step()
    total = sum(p.detach().sum().item() for p in model.parameters())
    del model, optimizer
    print(f"done {dist.get_rank()} {total:.6f}", flush=True)


if __name__ == "__main__":
    main()
