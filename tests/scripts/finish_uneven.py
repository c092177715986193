"""Every rank joins one collective and returns, except rank 0, which then works on alone for
$LINGER seconds the first time (once per $LINGER_ONCE file): another node finishes while it runs."""

import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    rank = dist.get_rank()
    dist.destroy_process_group()
    once = os.environ["LINGER_ONCE"]
    if rank == 0 and not os.path.exists(once):
        open(once, "w").close()
        time.sleep(float(os.environ.get("LINGER", "8")))


if __name__ == "__main__":
    main()
