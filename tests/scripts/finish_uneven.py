"""Every rank joins one collective and returns, except rank 0 of a world of more than one, which
then works on alone for $LINGER seconds (once per $LINGER_ONCE file): the other nodes finish while
it runs."""

import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    once = os.environ["LINGER_ONCE"]
    if rank == 0 and world > 1 and not os.path.exists(once):
        open(once, "w").close()
        time.sleep(float(os.environ.get("LINGER", "8")))


if __name__ == "__main__":
    main()
