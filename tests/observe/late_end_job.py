"""Worker of test_one_goodput.py: 20 committed elastrun.train steps, then a script's end of $END_SECONDS.

The end (after the last step, before the exit) is idle time of the job, not a step: the agent's last
line and ``elastrun goodput`` must both count it so.
"""

import os
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import elastrun.train as et


def main() -> None:
    et.init_distributed()
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    state = et.State(model=net, optimizer=opt)
    state.restore()
    model = DDP(net)
    while state.step < 20:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.commit()
        time.sleep(0.02)
    state.flush()
    time.sleep(float(os.environ.get("END_SECONDS", "1.5")))


if __name__ == "__main__":
    main()
