"""Worker of the recorded job in test_recorded_run.py: waits for a join, crashes once, then finishes.

Alone (WORLD_SIZE 1) it steps until its agent stops it for the join (at most MAX_ALONE seconds,
then it exits 3 so the test fails rather than hangs).  In the first group of two, rank 1 raises
once (``$CRASH_ONCE_FILE`` records it); after that the group runs STEPS steps and exits 0.  Steps
are logged to $STEPS_LOG/rank<r>.log in tests/scripts/steps.py's format, and each step is a progress
heartbeat (``elastrun.heartbeat()``), so the agents report when a restarted group steps again.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import elastrun

MAX_ALONE = 120.0


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
    once = os.environ["CRASH_ONCE_FILE"]
    steps = int(os.environ.get("STEPS", "20"))
    log = open(os.path.join(os.environ["STEPS_LOG"], f"rank{rank}.log"), "a", buffering=1)  # noqa: SIM115
    started = time.monotonic()
    step = 0
    while world == 1 or step < steps:
        if world == 1 and time.monotonic() - started > MAX_ALONE:
            return 3
        if world > 1 and step == steps // 2 and rank == 1 and not os.path.exists(once):
            open(once, "w").close()
            raise RuntimeError(f"injected failure at step {step}")
        value = torch.ones(1)
        dist.all_reduce(value)
        log.write(f"step {step} rank {rank} world {world} gen {gen} t {time.time():.3f}\n")
        elastrun.heartbeat()
        step += 1
        time.sleep(0.05)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
