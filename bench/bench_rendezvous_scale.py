"""One c10d rendezvous round with thousands of simulated nodes, spread over a few processes.

``bench_rendezvous.py`` runs every simulated node as a thread of one process, which stops scaling
past a few hundred nodes (one interpreter, one GIL, thousands of sockets).  Here ``--procs``
processes each hold ``nodes / procs`` handlers (threads, no workers); process 0's first handler
hosts the job's ``TCPStore``.  Every process connects its handlers, reports ready, and on one
"go" from the parent all of them join round 0 at once; the figure is from "go" to the last
node's result (wall clock of one machine).  Then the heartbeats of every node run for
``--beat-seconds``: the achieved heartbeat rate is measured against the configured one (each
beat is one write and three reads on the store).  ``--token`` runs the same with a job token.

    python -m bench.bench_rendezvous_scale --nodes 1024 --procs 4 [--token] [--repeat 3]
    python -m bench.bench_rendezvous_scale --auth-cost --nodes 256 1024 4096
    python -m bench.bench_rendezvous_scale --store-capacity
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

from bench.common import PYTHON, ROOT, free_port

SETUP_TIMEOUT = 900.0
ROUND_TIMEOUT = 300.0
#: Handlers of one process connecting at once (a connection storm only slows the set-up).
CONNECTING = 8
TOKEN = "bench-token-0123456789abcdef0123456789abcdef"


def child(port: int, first: int, count: int, nodes: int, beat_seconds: float) -> None:
    """One process of simulated nodes: connect, say ready, join on "go", report, heartbeat, close."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    from elastrun.rendezvous.api import NodeInfo, RendezvousParameters
    from elastrun.rendezvous.registry import create_handler

    def params(i: int) -> RendezvousParameters:
        return RendezvousParameters(
            backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="bench", min_nodes=nodes, max_nodes=nodes,
            config={"is_host": "true" if i == 0 else "false", "host_linger": "0",
                    "join_timeout": str(SETUP_TIMEOUT), "read_timeout": str(ROUND_TIMEOUT)},
        )

    handlers: dict[int, object] = {}
    errors: list[str] = []
    if first == 0:
        handlers[0] = create_handler(params(0))
    gate = threading.Semaphore(CONNECTING)

    def connect(i: int) -> None:
        try:
            with gate:
                handlers[i] = create_handler(params(i))
        except Exception as exc:
            errors.append(f"node {i}: {exc}")

    threads = [threading.Thread(target=connect, args=(i,)) for i in range(first, first + count) if i != 0]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"ready": len(handlers), "errors": errors[:3]}), flush=True)
    sys.stdin.readline()  # "go"
    ends: list[float] = []

    def join(i: int) -> None:
        try:
            handlers[i].next_round(NodeInfo(node_id=f"node{i:05d}", addr="127.0.0.1", nproc=1, hostname=f"h{i}",
                                            pid=i))
            ends.append(time.time())
        except Exception as exc:
            errors.append(f"node {i}: {exc}")

    threads = [threading.Thread(target=join, args=(i,)) for i in sorted(handlers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(ROUND_TIMEOUT)
    print(json.dumps({"end": max(ends) if ends else None, "joined": len(ends), "errors": errors[:3]}), flush=True)
    sys.stdin.readline()  # "beat": every process's nodes are heartbeating now
    before = sum(h._hb_counter for h in handlers.values())
    time.sleep(beat_seconds)
    after = sum(h._hb_counter for h in handlers.values())
    print(json.dumps({"beats": after - before}), flush=True)
    sys.stdin.readline()  # "close"
    for handler in handlers.values():
        try:
            handler.close()
        except Exception:
            pass
    os._exit(0)


def one_round(nodes: int, procs: int, token: bool, beat_seconds: float) -> dict:
    """Run one measured round (and heartbeat window); returns its figures."""
    import psutil

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_CPP_LOG_LEVEL": "FATAL"}
    env.pop("ELASTRUN_JOB_TOKEN", None)
    if token:
        env["ELASTRUN_JOB_TOKEN"] = TOKEN
    share = [nodes // procs + (1 if p < nodes % procs else 0) for p in range(procs)]
    starts = [sum(share[:p]) for p in range(procs)]
    children = []
    for p in range(procs):
        argv = [PYTHON, "-m", "bench.bench_rendezvous_scale", "--child", str(port), str(starts[p]), str(share[p]),
                str(nodes), str(beat_seconds)]
        children.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True))
        if p == 0:
            time.sleep(1.0)  # let process 0 bind the store first

    def read_all() -> list[dict]:
        return [json.loads(c.stdout.readline() or "{}") for c in children]

    def tell(word: str) -> None:
        for c in children:
            c.stdin.write(word + "\n")
            c.stdin.flush()

    try:
        setup_started = time.time()
        ready = read_all()
        setup = time.time() - setup_started
        if sum(r.get("ready", 0) for r in ready) != nodes:
            raise RuntimeError(f"set-up incomplete: {ready}")
        connections = sum(1 for c in psutil.net_connections("tcp")
                          if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)
        go = time.time()
        tell("go")
        done = read_all()
        if sum(d.get("joined", 0) for d in done) != nodes:
            raise RuntimeError(f"round incomplete: {done}")
        seconds = max(d["end"] for d in done) - go
        tell("beat")
        beats = sum(b.get("beats", 0) for b in read_all())
        tell("close")
    finally:
        for c in children:
            try:
                c.wait(60)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
    return {"nodes": nodes, "procs": procs, "token": token, "round_s": round(seconds, 3),
            "setup_s": round(setup, 1), "store_connections": connections,
            "beats_per_s": round(beats / beat_seconds, 1), "beats_per_s_configured": nodes / 0.5}


def auth_cost(nodes: int, repeat: int = 2000) -> dict:
    """CPU cost of the job token alone: per heartbeat (seal own beat, open the watched one) and per
    round (each member: seal its join, open the closed marker, the result and the store address;
    the closer also opens every join and seals the result)."""
    import timeit

    from elastrun.rendezvous.api import NodeInfo
    from elastrun.rendezvous.auth import JobToken

    token = JobToken(TOKEN.encode(), "bench")
    auth = token.accept(token.new_marker(), "bench")
    key = auth.prefix + "hb/node00001"
    beat = auth.seal(key, "12345:1700000000.000")
    per_beat = timeit.timeit(lambda: (auth.seal(key, "12345:1700000000.000"), auth.open(key, beat)),
                             number=repeat) / repeat
    infos = [NodeInfo(f"node{i:05d}", "10.0.0.1", 8, hostname=f"h{i}", pid=i).to_json() for i in range(nodes)]
    sealed = [auth.seal(f"{auth.prefix}r0/node/{i}", v) for i, v in enumerate(infos)]
    result = json.dumps({"members": [json.loads(v) | {"group_rank": i, "rank_offset": 8 * i}
                                     for i, v in enumerate(infos)]})
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
    children = [subprocess.Popen([PYTHON, "-m", "bench.bench_rendezvous_scale", "--store-ops", str(server.port),
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


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--store-ops":
        store_ops(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        port, first, count, nodes, beat_seconds = sys.argv[2:7]
        child(int(port), int(first), int(count), int(nodes), float(beat_seconds))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1024])
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--token", action="store_true")
    parser.add_argument("--beat-seconds", type=float, default=5.0)
    parser.add_argument("--auth-cost", action="store_true", help="only the CPU cost of the token, per size")
    parser.add_argument("--store-capacity", action="store_true",
                        help="only the operations per second one TCPStore serves (4 processes x 8 clients)")
    args = parser.parse_args()
    if args.store_capacity:
        print(json.dumps(store_capacity(4, 8)), flush=True)
        return
    if args.auth_cost:
        for nodes in args.nodes:
            print(json.dumps(auth_cost(nodes)), flush=True)
        return
    for nodes in args.nodes:
        rows = [one_round(nodes, args.procs, args.token, args.beat_seconds) for _ in range(args.repeat)]
        for row in rows:
            print(json.dumps(row), flush=True)
        if len(rows) > 1:
            print(json.dumps({"nodes": nodes, "token": args.token,
                              "median_round_s": statistics.median(r["round_s"] for r in rows)}), flush=True)


if __name__ == "__main__":
    main()
