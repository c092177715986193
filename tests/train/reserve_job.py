"""One rank, no launcher: an FSDP2 model's first commit, then a restore into a new node's memory;
prints how much memory each of the rank's slot files holds after each (``test_sharded.py``)."""

import json
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

import elastrun.train as et
from elastrun.train.slotmem import allocated
from elastrun.train.snapshot import slots_needed

SLOTS = slots_needed(checkpoints=False)  # the State below has no checkpoint directory


def held(directory: Path, nbytes: int) -> list[int]:
    """The slot files' allocated bytes, once all hold ``nbytes`` or after 20 s."""
    paths = [directory / f"shard.r0.{s}.data" for s in range(SLOTS)]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(allocated(p) < nbytes for p in paths):
        time.sleep(0.05)
    return [allocated(p) for p in paths]


def main() -> None:
    out = Path(sys.argv[1])
    first, second = out / "node-a", out / "node-b"
    et.init_distributed()
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(2)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    state = et.State(model=model, optimizer=opt, snapshot_dir=first, handle_signals=False)
    state.commit()
    state.flush()
    nbytes = next(iter(state._sharded.slots().scan())).header["nbytes"]
    after_commit = held(first, nbytes)
    state.close()
    second.mkdir()
    for name in ("shard.r0.0.data", "shard.r0.0.meta"):  # the committed slot, as a peer would have it
        shutil.copy(first / name, second / name)
    again = et.State(model=model, optimizer=opt, snapshot_dir=second, handle_signals=False)
    source = again.restore()
    after_restore = held(second, nbytes)
    print(json.dumps({"nbytes": nbytes, "after_commit": after_commit, "source": source,
                      "after_restore": after_restore}))


if __name__ == "__main__":
    main()
