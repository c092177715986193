"""A small elastic DDP job used by the tests: trains step by step and logs each step.

Every rank appends ``step <n> rank <r> world <w> gen <g> t <time>`` lines to $STEPS_LOG (one
file per rank).  Options (environment): STEPS (total steps, default 1000), STEP_SECONDS (sleep
per step), CRASH_AT_STEP + CRASH_RANK (exit 1 there, once per $CRASH_ONCE_FILE), CRASH_FILE + CRASH_RANK
(exit 1 at the first step after that file appears, once per $CRASH_ONCE_FILE), CKPT (a path: rank 0 saves
{"step": n} after each step, every rank resumes from it), HOLD_FILE (a path: the last step waits, up to
300 s, while that file exists, so that a test's checks run while the job is still up).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
    steps = int(os.environ.get("STEPS", "1000"))
    pause = float(os.environ.get("STEP_SECONDS", "0.05"))
    ckpt = os.environ.get("CKPT")
    start = 0
    if ckpt and os.path.exists(ckpt):
        with open(ckpt) as fh:
            start = json.load(fh)["step"]
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = open(os.path.join(os.environ["STEPS_LOG"], f"rank{rank}.log"), "a", buffering=1)  # noqa: SIM115
    crash_at = int(os.environ.get("CRASH_AT_STEP", "-1"))
    crash_rank = int(os.environ.get("CRASH_RANK", "0"))
    once = os.environ.get("CRASH_ONCE_FILE")
    crash_file = os.environ.get("CRASH_FILE")
    hold = os.environ.get("HOLD_FILE")
    for step in range(start, steps):
        if hold and step == steps - 1:
            deadline = time.monotonic() + 300
            while os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.05)
        due = step == crash_at or bool(crash_file and os.path.exists(crash_file))
        if due and rank == crash_rank and not (once and os.path.exists(once)):
            if once:
                open(once, "w").close()
            raise RuntimeError(f"injected failure at step {step}")
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.write(f"step {step} rank {rank} world {world} gen {gen} t {time.time():.3f}\n")
        if ckpt and rank == 0:
            tmp = ckpt + ".tmp"
            with open(tmp, "w") as fh:
                json.dump({"step": step + 1}, fh)
            os.replace(tmp, ckpt)
        time.sleep(pause)
    print(f"done rank {rank} world {world}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
