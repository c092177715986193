"""The rendezvous costs that :mod:`bench.bench_rendezvous_scale` measures apart from a round: the job token's
CPU per heartbeat and per round, one result's parse (what a light node skips), and the operations per
second one ``TCPStore`` serves.

``python -m bench.rdzv_costs PORT THREADS SECONDS`` is a client process of :func:`store_capacity`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from bench.common import PYTHON, ROOT

TOKEN = "bench-token-0123456789abcdef0123456789abcdef"


def parse_ms(nodes: int, token: bool) -> float:
    """What a light node skips, timed alone: open (with a token) and parse an n-member result, build its view."""
    from elastrun.rendezvous.api import Member, NodeInfo
    from elastrun.rendezvous.auth import JobToken, NoAuth
    from elastrun.rendezvous.rounds import assign_ranks, decode_result, encode_result, member_view, result_document

    members = assign_ranks([NodeInfo(f"node{i:05d}", "10.0.0.1", 8, hostname=f"h{i}", pid=i) for i in range(nodes)])
    doc = result_document(members, 0, 0, 0, None, 1, [])
    auth = JobToken(TOKEN.encode(), "bench") if token else None
    auth = auth.accept(auth.new_marker(), "bench") if auth else NoAuth("bench")
    key = auth.prefix + "r0/result"
    raw = auth.seal(key, encode_result(doc))
    raw = raw.encode() if isinstance(raw, str) else raw
    started = time.perf_counter()
    repeat = 5
    for _ in range(repeat):
        d = decode_result(auth.open(key, raw))
        ms = [Member(**m) for m in d["members"]]
        me = next(m for m in ms if m.node_id == "node00007")
        member_view(0, d, ms, me, "10.0.0.1", 1234)
        sorted(ms, key=lambda m: m.group_rank)
    return (time.perf_counter() - started) / repeat * 1e3


def auth_cost(nodes: int, repeat: int = 2000) -> dict:
    """CPU cost of the job token alone: per heartbeat (seal own beat, open the watched one) and per
    round (each member: seal its join, open the closed marker, the result and the store address;
    the closer also opens every join and seals the result)."""
    import timeit

    from elastrun.rendezvous.api import NodeInfo
    from elastrun.rendezvous.auth import JobToken
    from elastrun.rendezvous.rounds import assign_ranks, encode_result, result_document

    token = JobToken(TOKEN.encode(), "bench")
    auth = token.accept(token.new_marker(), "bench")
    key = auth.prefix + "hb/node00001"
    beat = auth.seal(key, "12345:1700000000.000")
    per_beat = timeit.timeit(lambda: (auth.seal(key, "12345:1700000000.000"), auth.open(key, beat)),
                             number=repeat) / repeat
    infos = [NodeInfo(f"node{i:05d}", "10.0.0.1", 8, hostname=f"h{i}", pid=i).to_json() for i in range(nodes)]
    sealed = [auth.seal(f"{auth.prefix}r0/node/{i}", v) for i, v in enumerate(infos)]
    result = encode_result(result_document(assign_ranks([NodeInfo.from_json(v) for v in infos]), 0, 0, 0, None,
                                           1, []))
    rkey = auth.prefix + "r0/result"
    sealed_result = auth.seal(rkey, result)

    def member() -> None:
        auth.seal(f"{auth.prefix}r0/node/1", infos[0])
        auth.open(auth.prefix + "r0/closed", auth.seal(auth.prefix + "r0/closed", f"{nodes}:node00000"))
        auth.open(rkey, sealed_result)
        auth.open(auth.prefix + "r0/store", auth.seal(auth.prefix + "r0/store", "10.0.0.1:1234"))

    def closer() -> None:
        for i, v in enumerate(sealed):
            auth.open(f"{auth.prefix}r0/node/{i}", v)
        auth.seal(rkey, result)

    rounds = max(3, repeat // max(1, nodes // 8))
    return {"nodes": nodes, "heartbeat_us": round(per_beat * 1e6, 2),
            "member_round_us": round(timeit.timeit(member, number=rounds) / rounds * 1e6, 1),
            "closer_round_us": round(timeit.timeit(closer, number=rounds) / rounds * 1e6, 1),
            "result_bytes": len(result)}


def store_ops(port: int, threads: int, seconds: float) -> None:
    """Child of :func:`store_capacity`: ``threads`` clients doing heartbeat-like set+get pairs."""
    import datetime

    import torch.distributed as dist

    stores = [dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
              for _ in range(threads)]
    counts = [0] * threads
    sys.stdin.readline()
    stop = time.monotonic() + seconds

    def loop(i: int) -> None:
        key = f"/bench/hb/{os.getpid()}-{i}"
        while time.monotonic() < stop:
            stores[i].set(key, f"{counts[i]}:{time.time():.3f}")
            stores[i].get(key)
            counts[i] += 2

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    print(json.dumps({"ops": sum(counts)}), flush=True)


def store_capacity(procs: int, threads: int, seconds: float = 3.0) -> dict:
    """Store operations per second one ``TCPStore`` served to ``procs`` x ``threads`` busy clients."""
    import datetime

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True,
                           timeout=datetime.timedelta(seconds=30))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_CPP_LOG_LEVEL": "FATAL"}
    children = [subprocess.Popen([PYTHON, "-m", "bench.rdzv_costs", str(server.port),
                                  str(threads), str(seconds)], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    time.sleep(3.0)
    for c in children:
        c.stdin.write("go\n")
        c.stdin.flush()
    ops = sum(json.loads(c.stdout.readline())["ops"] for c in children)
    for c in children:
        c.wait(30)
    return {"clients": procs * threads, "store_ops_per_s": round(ops / seconds)}


if __name__ == "__main__":
    store_ops(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
