"""Waits for a signal: writes $OUT_DIR/<signal>_<rank> when one arrives, then exits 0.

With IGNORE_SIGNALS=1 it ignores them instead (to test the grace period and SIGKILL).
Writes $OUT_DIR/ready_<rank> once its handlers are installed.
"""

import os
import signal
import time

rank = os.environ["RANK"]
out = os.environ["OUT_DIR"]


def handler(signum, _frame):
    open(os.path.join(out, f"{signal.Signals(signum).name}_{rank}"), "w").close()
    raise SystemExit(0)


for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, signal.SIG_IGN if os.environ.get("IGNORE_SIGNALS") else handler)
open(os.path.join(out, f"ready_{rank}"), "w").close()
for _ in range(1200):
    time.sleep(0.1)
