"""Benchmark of the etcd rendezvous on a real single-member etcd (loopback).

- one round with N agents (handlers in threads of one process, no workers): time from the start
  of every ``next_round`` to the last one returning;
- lost-node detection with the defaults: a second process holding a handler is SIGKILLed and the
  survivor's ``poll()`` is watched until it reports the loss;
- keys left in etcd after every agent closed.

With each round its watch events are counted: the events all agents' watches delivered, from the
start of the round to the last ``next_round`` returning (each agent watches only what it acts on,
so this grows with N, not N²).  ``--token`` gives every agent a job token.

Run: ``.venv/bin/python bench/bench_rendezvous_etcd.py [--token] [--repeat 3] [N ...]`` (default 2 8 32).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastrun.rendezvous.api import NodeInfo, RendezvousParameters  # noqa: E402
from elastrun.rendezvous.etcd import create_handler  # noqa: E402
from tests.rendezvous.etcd_cluster import EtcdCluster  # noqa: E402

CHILD = """
import sys, time
sys.path.insert(0, {repo!r})
from elastrun.rendezvous.api import NodeInfo, RendezvousParameters
from elastrun.rendezvous.etcd import create_handler
h = create_handler(RendezvousParameters("etcd", {ep!r}, "kill", 2, 2))
h.next_round(NodeInfo("victim", "127.0.0.1", 1))
print("joined", flush=True)
time.sleep(600)
"""


def one_round(endpoints: str, n: int) -> tuple[float, int]:
    handlers = [create_handler(RendezvousParameters("etcd", endpoints, f"bench{n}", n, n)) for _ in range(n)]
    errors: list[BaseException] = []

    def join(i: int) -> None:
        try:
            handlers[i].next_round(NodeInfo(f"n{i}", "127.0.0.1", 1))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(n)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    took = time.perf_counter() - started
    events = sum(h._watch.seq for h in handlers if h._watch is not None)
    for h in handlers:
        h.close()
    if errors:
        raise errors[0]
    return took, events


def kill_detection(endpoints: str) -> float:
    repo = str(Path(__file__).resolve().parents[1])
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(repo=repo, ep=endpoints)], stdout=subprocess.PIPE,
                             text=True)
    survivor = create_handler(RendezvousParameters("etcd", endpoints, "kill", 2, 2))
    try:
        survivor.next_round(NodeInfo("survivor", "127.0.0.1", 1))
        assert child.stdout is not None and child.stdout.readline().startswith("joined")
        time.sleep(1.0)
        os.kill(child.pid, signal.SIGKILL)
        killed = time.perf_counter()
        while time.perf_counter() - killed < 30:
            if survivor.poll().lost_nodes:
                return time.perf_counter() - killed
            time.sleep(0.01)
        raise RuntimeError("loss not detected in 30 s")
    finally:
        child.kill()
        child.wait()
        survivor.close()


def main() -> None:
    import torch.distributed  # noqa: F401 - group rank 0 hosts a TCPStore; keep the import out of the timing

    args = sys.argv[1:]
    if "--token" in args:
        args.remove("--token")
        os.environ["ELASTRUN_JOB_TOKEN"] = "bench-token-0123456789abcdef0123456789abcdef"
    repeat = 3
    if "--repeat" in args:
        at = args.index("--repeat")
        repeat = int(args[at + 1])
        del args[at:at + 2]
    sizes = [int(a) for a in args] or [2, 8, 32]
    with EtcdCluster(1) as cluster:
        for n in sizes:
            rows = sorted(one_round(cluster.endpoints, n) for _ in range(repeat))
            times = [t for t, _ in rows]
            print(f"round with {n:3d} agents: median {statistics.median(times):.3f} s (min {times[0]:.3f}, "
                  f"max {times[-1]:.3f}); watch events delivered per round: {rows[len(rows) // 2][1]}", flush=True)
        detections = sorted(kill_detection(cluster.endpoints) for _ in range(3))
        print(f"SIGKILLed agent detected after: {', '.join(f'{d:.2f}' for d in detections)} s")
        print(f"keys left under /elastrun/ after all agents closed: {len(cluster.list_keys())}")


if __name__ == "__main__":
    main()
