"""Each training step's start and end, for the goodput of bench/bench_clients.py; a no-op unless $STEP_TIMES_DIR is set.

Not part of the patterns the client scripts reproduce: the benchmark's instrument, the same under
every launcher.  One JSON line per step in ``$STEP_TIMES_DIR/<pid>.jsonl``: ``e`` (epoch), ``i``
(batch in the epoch), ``t0`` and ``t1`` (Unix times).
"""

import json
import os
import time

_DIR = os.environ.get("STEP_TIMES_DIR")
_out = None


def begin() -> float:
    """The step's start (pass it to :func:`end`)."""
    return time.time()


def end(epoch: int, batch: int, t0: float) -> None:
    """Record one finished step."""
    global _out
    if not _DIR:
        return
    if _out is None:
        _out = open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115 - kept open
    _out.write(json.dumps({"e": epoch, "i": batch, "t0": t0, "t1": time.time()}) + "\n")
