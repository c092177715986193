"""An ``et.run`` job with a second fault during the re-form that follows a first (issue 35's tests).

Two ranks train a tiny model for $STEPS steps (default 40), each commit a heartbeat.  In the first
attempt rank 1 SIGKILLs itself at step 10: its agent keeps rank 0's process (an in-process
re-form) and starts rank 1 anew.  Then, by $FAULT:

* ``block-restore``: the kept process blocks in ``State.restore`` (in ``blocked_in_restore``, the
  name its stack dump must show) while the new rank 1 waits for it in the restore's collective: a
  group that formed and never steps, with no heartbeat from either.  Only once: a marker file in
  $STALL_DIR says the block happened, so the worker started in its place goes on.
* ``exit-during-init``: the new rank 1 exits (code 3) 1.5 s after its start, before it sets up
  its process group, while the kept rank 0 waits for it in its own set-up: the agent pauses rank 0
  in the middle of its ``init_process_group``, which fails, and hands it the next round, where it
  must meet a fresh rank 1 again.

Either way the job then finishes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import elastrun.train as et


def blocked_in_restore() -> None:
    threading.Event().wait()  # as a wait in C would: no signal handler takes it out


class StallingState(et.State):
    """A State whose second restore in one process (the first after a re-form) blocks, once per job."""

    restores = 0

    def restore(self) -> str | None:
        self.restores += 1
        marker = Path(os.environ["STALL_DIR"]) / "blocked"
        if os.environ["FAULT"] == "block-restore" and self.restores == 2 and not marker.exists():
            marker.write_text(str(os.getpid()))
            print(f"pid {os.getpid()} blocks in its restore", flush=True)
            blocked_in_restore()
        return super().restore()


def train(state: et.State, net: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank, world = dist.get_rank(), dist.get_world_size()
    while state.step < steps:
        if gen == 0 and rank == 1 and state.step == 10:
            os.kill(os.getpid(), signal.SIGKILL)
        net.zero_grad()
        net(torch.randn(4, 8)).pow(2).mean().backward()
        for p in net.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        state.commit()
        time.sleep(0.05)


def main() -> None:
    if os.environ["FAULT"] == "exit-during-init" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "1":
        time.sleep(1.5)  # rank 0, kept, is in its process group's set-up, waiting for this one
        sys.exit(3)
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    state = StallingState(model=net, optimizer=opt)
    steps = int(os.environ.get("STEPS", "40"))
    et.run(lambda st: train(st, net, opt, steps), state)
    print(f"done rank {dist.get_rank()} step {state.step}", flush=True)
    state.close()


if __name__ == "__main__":
    main()
