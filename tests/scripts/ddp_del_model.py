"""A plain DDP script that frees its model right after its last all-reduce.

The shapes that expose torch's process-group teardown race (pytorch#56297): the rank's work is
done and its result printed, then the process may hang or abort.  ``SHAPE`` (environment):

- ``del`` (default): ``del model`` at the end of ``main()``; the group is destroyed, if ever, in
  interpreter teardown;
- ``destroy``: the DDP tutorial's ending, ``destroy_process_group()`` and then ``main()`` returns,
  so the model (and with it the group's last reference) is freed inside the script.

Prints ``done RANK SUM`` once its work is done.
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
    for _ in range(int(os.environ.get("STEPS", "30"))):
        optimizer.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        optimizer.step()
    total = sum(p.detach().sum().item() for p in model.parameters())
    print(f"done {dist.get_rank()} {total:.6f}", flush=True)
    if os.environ.get("SHAPE", "del") == "destroy":
        dist.destroy_process_group()
    else:
        del model, optimizer


if __name__ == "__main__":
    main()
