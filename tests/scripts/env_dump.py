"""Writes the worker's environment and a few torch facts to $OUT_DIR/env_<rank>.json."""

import json
import os
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
facts = {
    "env": dict(os.environ),
    "argv": sys.argv,
    "torchelastic_launched": dist.is_torchelastic_launched(),
    "rank": dist.get_rank(),
    "world_size": dist.get_world_size(),
}
with open(os.path.join(os.environ["OUT_DIR"], f"env_{dist.get_rank()}.json"), "w") as fh:
    json.dump(facts, fh)
dist.barrier()
dist.destroy_process_group()
