"""Functions launched through ``elastrun.launcher.launch`` by the tests."""

import os


def allreduce_rank(scale: int) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    result = {"rank": dist.get_rank(), "sum": value.item() * scale, "world": int(os.environ["WORLD_SIZE"])}
    dist.destroy_process_group()
    return result


def fail_on_rank_one() -> None:
    if os.environ["RANK"] == "1":
        raise KeyError("missing shard")
