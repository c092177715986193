"""A small DDP job on CUDA with NCCL, one GPU per worker, used by the GPU tests.

Every rank appends ``step <n> rank <r> world <w> gen <g> cuda <device>`` lines to $STEPS_LOG/rank<r>.log.
Options (environment): STEPS (default 20), CRASH_AT_STEP + CRASH_RANK (exit 1 there, once per
$CRASH_ONCE_FILE), DESTROY (1: ``destroy_process_group()`` before the script returns, the tutorial
ending that races in torch's teardown).
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 8).cuda(), device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crash_at = int(os.environ.get("CRASH_AT_STEP", "-1"))
    crash_rank = int(os.environ.get("CRASH_RANK", "0"))
    once = os.environ.get("CRASH_ONCE_FILE")
    with open(os.path.join(os.environ["STEPS_LOG"], f"rank{rank}.log"), "a", buffering=1) as log:
        for step in range(int(os.environ.get("STEPS", "20"))):
            if step == crash_at and rank == crash_rank and not (once and os.path.exists(once)):
                if once:
                    open(once, "w").close()
                raise RuntimeError(f"injected failure at step {step}")
            loss = model(torch.randn(16, 64, device="cuda")).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            log.write(f"step {step} rank {rank} world {world} gen {gen} cuda {torch.cuda.current_device()}\n")
    if os.environ.get("DESTROY") == "1":
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
