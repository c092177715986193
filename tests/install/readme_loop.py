"""The README's ``elastrun.train`` loop, taken from README.md at run time and run as written.

``python readme_loop.py README.md [--kill-at N]``: defines what the README's snippet leaves to
the reader (``dataset``, ``Net``, the imports), executes the snippet, then prints one line per
rank with where the state came from.  With ``--kill-at N``, rank 1 of the job's first attempt
SIGKILLs itself in its N-th forward pass, so the restart's ``State.restore()`` has to gather.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import elastrun

#: 17 steps of 2 × 32 samples per epoch: the README's 3 epochs are 51 steps, one checkpoint (step 50).
SAMPLES = 17 * 64


def readme_snippet(readme: Path) -> str:
    """The first Python block of the README's section on ``elastrun.train``."""
    section = readme.read_text(encoding="utf-8").split("## Recoverable training", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    if match is None:
        raise SystemExit(f"no ```python block in the training section of {readme}")
    return match.group(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("readme", type=Path)
    p.add_argument("--kill-at", type=int, default=0)
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g))
    first_attempt_rank1 = os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 1)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if first_attempt_rank1 and self.calls == a.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return self.fc(x)

    scope = {"torch": torch, "DDP": DDP, "dataset": dataset, "Net": Net}
    setup, loop = readme_snippet(a.readme).split("\nwhile ", 1)
    exec(compile(setup, "<README training snippet>", "exec"), scope)  # ends with source = state.restore()
    state = scope["state"]
    restored = state.step
    exec(compile("while " + loop, "<README training snippet, loop>", "exec"), scope)
    state.flush()
    print(f"rank {os.environ['RANK']} source {scope['source']} restored {restored} step {state.step} "
          f"epoch {scope['sampler'].epoch} elastrun {elastrun.__file__}", flush=True)


if __name__ == "__main__":
    main()
