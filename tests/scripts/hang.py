"""Sends a few progress heartbeats, then hangs in a function whose name the stack dump must show.

HANG_MODE=sleep: blocks in time.sleep; HANG_MODE=stop: the worker SIGSTOPs itself.
"""

import os
import signal
import time

import elastrun


def stuck_in_the_middle() -> None:
    if os.environ.get("HANG_MODE") == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)


for _ in range(5):
    elastrun.heartbeat()
    time.sleep(0.1)
if os.environ["RANK"] == "1":
    stuck_in_the_middle()
for _ in range(6000):
    elastrun.heartbeat()
    time.sleep(0.1)
