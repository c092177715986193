"""A job whose rank 0 is left in a gloo send that can never return (``test_reform``'s lost-send test).

``python lost_send.py OUT`` under ``elastrun --nproc-per-node=2``, with ``elastrun.train.run``.

First attempt of each rank: rank 1 posts a receive of a 32 MB tensor and stops itself (SIGSTOP) before
reading any of it; rank 0 waits until that receive is announced, writes ``OUT/sending``, and sends the
tensor.  Its bytes fill the connection, the rest waits in gloo's write queue.  The test then kills
rank 1: gloo fails the connection but never ends that queued send (:mod:`elastrun.train.stuck`).
Later attempts (every rank started anew) return at once, so the job ends.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import elastrun.train as et

NUMEL = 8 << 20  # float32: 32 MB, many times a socket's buffer


def body(out: Path) -> int:
    rank = dist.get_rank()
    marker = out / f"attempted.r{rank}"
    if marker.exists():
        return 0
    marker.write_text(str(os.getpid()))
    if rank == 1:
        dist.irecv(torch.empty(NUMEL), src=0)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)  # the test kills it first
        return 1
    time.sleep(1.0)  # rank 1's receive is announced first: the send goes straight to the wire
    (out / "sending").write_text(str(os.getpid()))
    dist.send(torch.ones(NUMEL), dst=1)
    return 0


def main() -> None:
    out = Path(sys.argv[1])
    state = et.State(model=torch.nn.Linear(2, 2), handle_signals=False)
    et.run(lambda _state: body(out), state)


if __name__ == "__main__":
    main()
