"""One c10d rendezvous round with thousands of simulated nodes, spread over a few processes.

``bench_rendezvous.py`` runs every simulated node as a full handler in one process, which stops
scaling past a few hundred nodes.  Here ``--procs`` processes each hold ``nodes / procs`` nodes
(threads, no workers), and one more process holds node 0 alone, which hosts the job's ``TCPStore``
(each process in a session of its own: see ``one_round``).  Every process connects
its nodes, reports ready, and on one "go" from the parent all of them join round 0 at once; the
figure is from "go" to the last node's result (wall clock of one machine).  Then every node's
heartbeats run for ``--beat-seconds``: the achieved rate is measured against the configured one,
and the CPU time the store's own thread used in that window (its load).  ``--token`` runs the
same with a job token.

**Full and light nodes.**  On a real cluster each node runs on its own machine; here they share
two cores, so work that a cluster does n times in parallel is paid n times in series.  Every
``--full-every``-th node (node 0, the store host and usually the closer, included) runs the real
handler end to end.  The others are *light*: the real handler class with two steps replaced —

- after fetching the round's result document from the store (the bytes are read, so the store
  serves them as it would), a light node does not parse and check it itself: the first light
  node of a process parses it and the others of that process share that parse.  The parse is
  O(n) per node and runs on every machine at once on a cluster, so it adds its own duration (the
  ``parse_ms`` figure, timed alone) to a real round, not n times that;
- the heartbeats of a process's light nodes are sent by one thread, in turn, each over the node's
  own connection with the real ``_beat`` (same store operations: one write, two reads, and the
  same ring walk over the whole ring).

Everything else — connections (two per node), the join writes, the waits, the closer's work, the
store address — is the real code.  Full nodes check that their result agrees with the light ones'.

**Processes.**  The default is 8 processes of simulated nodes (128 threads each at 1,024 nodes)
plus node 0's.  With 4 (256 threads each) the round's closer, whichever node joined first, was
always one of 256 threads taking turns at one GIL, and its close (read every join, publish the
result) took 0.3–0.7 s of the round; on a cluster the closer is an agent on its own machine.
More processes do not take work away from the bench: every node still makes its own store
operations over its own two connections (2,048 client connections at 1,024 nodes).  The
processes keep Python's default switch interval (5 ms): a shorter one makes hundreds of threads
hand the GIL round so often that most of the CPU goes to the kernel (see docs/benchmarks.md).

**What a node's round costs itself.**  ``full_join_cpu_ms`` is the CPU time of each full node's
joining thread over its round (median and max, the max being the closer's): what one agent pays
for the round on its own machine.  With every node a full handler (``--full-every 1``) the round
time here is n agents' CPU shared by this machine's cores, not the time a round takes on a
cluster; use ``--procs`` of 16 or more there, since hundreds of handlers in one process mostly
measure their threads queueing for its GIL.

torch's ``TCPStore`` looks up the peer's name for every connection (``getnameinfo``); where the
DNS server drops queries (this sandbox) a connection stalls 5 s.  When run as root the bench
re-runs itself in a fresh network namespace (loopback only), where that lookup fails at once.

**Store operations per node** (``--count-ops``): every node's two store clients count their
operations by name between "go" and the end of the round, one count for the joining thread's
client (the join, the wait, the close, the result and seat reads) and one for the heartbeat
client; ``store_ops_per_node`` is each total over n.  The counting wrapper adds a Python call per
operation, so round times of a counted run are not the figures.

    python -m bench.bench_rendezvous_scale --nodes 256 1024 4096 [--procs 16] [--token] [--repeat 3]
    python -m bench.bench_rendezvous_scale --count-ops --nodes 1024 4096
    python -m bench.bench_rendezvous_scale --auth-cost --nodes 256 1024 4096
    python -m bench.bench_rendezvous_scale --store-capacity
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from bench.common import PYTHON, ROOT, free_port, read_lines, tell
from bench.rdzv_costs import TOKEN, auth_cost, parse_ms, store_capacity


def _wire_bytes() -> int | None:
    """Bytes sent on loopback so far, when the bench runs in a network namespace of its own (then all
    of it is the bench's: the round's store traffic); None elsewhere (other traffic shares it)."""
    if not os.environ.get("ELASTRUN_BENCH_NETNS"):
        return None
    with open("/proc/net/dev") as f:  # this namespace's (sysfs shows the one it was mounted in)
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[8])  # bytes transmitted
    return None


def one_round(nodes: int, procs: int, token: bool, beat_seconds: float, full_every: int, ids: str = "bench") -> dict:
    """Run one measured round (and heartbeat window); returns its figures."""
    import psutil

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_CPP_LOG_LEVEL": "FATAL"}
    env.pop("ELASTRUN_JOB_TOKEN", None)
    if token:
        env["ELASTRUN_JOB_TOKEN"] = TOKEN
    # Process 0 holds node 0 alone (the store host); the other nodes are spread over ``procs``
    # processes.  Each process is a session of its own, so the kernel's autogroup scheduling
    # shares the cores between processes rather than between threads: the store's one thread is
    # not starved by thousands of simulated nodes, as on a cluster its host is not.
    rest = nodes - 1
    share = [1] + [rest // procs + (1 if p < rest % procs else 0) for p in range(procs)]
    share = [s for s in share if s > 0]
    starts = [sum(share[:p]) for p in range(len(share))]
    children = []
    for p in range(len(share)):
        argv = [PYTHON, "-m", "bench.rdzv_nodes", str(port), str(starts[p]), str(share[p]),
                str(nodes), str(beat_seconds), str(full_every), ids]
        children.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=None, text=True, start_new_session=True))
        if p == 0:
            time.sleep(1.0)  # let process 0 bind the store first

    try:
        setup_started = time.time()
        ready = read_lines(children)
        setup = time.time() - setup_started
        print(f"{nodes} nodes connected in {setup:.1f} s; round starts", file=sys.stderr, flush=True)
        if sum(r.get("ready", 0) for r in ready) != nodes:
            raise RuntimeError(f"set-up incomplete: {ready}")
        connections = sum(1 for c in psutil.net_connections("tcp")
                          if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)
        load = round(os.getloadavg()[0], 1)
        wire_go = _wire_bytes()
        go = time.time()
        tell(children, "go")
        done = read_lines(children)
        wire_end = _wire_bytes()
        wire_round = None if wire_go is None or wire_end is None else wire_end - wire_go
        if sum(d.get("joined", 0) for d in done) != nodes:
            raise RuntimeError(f"round incomplete: {[{k: d.get(k) for k in ('joined', 'errors')} for d in done]}")
        ranks = sorted(r for d in done for r in d["ranks"])
        if ranks != list(range(nodes)) or not all(d["agree"] for d in done):
            raise RuntimeError("the nodes' results disagree")
        seconds = max(d["end"] for d in done) - go
        closed_at = next(d["closed_at"] for d in done if d.get("closed_at"))
        closer = next(d["closer"] for d in done if d.get("closer"))
        full_end = max(d["full_end"] for d in done if d.get("full_end"))
        join_cpu = [c for d in done for c in d["full_join_cpu"]]
        phases = {name: _since(go, pick, [d[name] for d in done if d.get(name)])
                  for name, pick in (("joins_written", max), ("last_fetch", max), ("first_fetch", min))}
        result_bytes = max(d.get("result_bytes", 0) for d in done)
        ops_per_node = None
        if os.environ.get("ELASTRUN_BENCH_COUNT_OPS"):
            ops_per_node = {}
            for kind in ("join", "beat"):
                total: dict[str, int] = {}
                for d in done:
                    for name, n in d.get("ops", {}).get(kind, {}).items():
                        total[name] = total.get(name, 0) + n
                ops_per_node[kind] = {name: round(n / nodes, 2) for name, n in sorted(total.items())}
        tell(children, "beat")
        beat_rows = read_lines(children)
        beats = sum(b.get("beats", 0) for b in beat_rows)
        store_cpu = beat_rows[0].get("store_cpu_s", 0.0)
        tell(children, "close")
    except BaseException:
        for c in children:  # they wait for a word that will not come
            c.kill()
        raise
    finally:
        for c in children:
            try:
                c.wait(60)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
    return {"nodes": nodes, "procs": procs, "token": token, "ids": ids, "round_s": round(seconds, 3),
            "wire_bytes_in_round": wire_round,
            "wire_bytes_per_node": None if wire_round is None else round(wire_round / nodes),
            "joins_written_s": phases["joins_written"], "closed_after_s": round(closed_at - go, 3), "closer": closer,
            "first_result_fetched_s": phases["first_fetch"], "last_result_fetched_s": phases["last_fetch"],
            "result_bytes": result_bytes, "load_at_go": load, "full_nodes": sum(d["full"] for d in done),
            "full_nodes_done_s": round(full_end - go, 3), "parse_ms": round(parse_ms(nodes, token), 1),
            "full_join_cpu_ms": {"median": round(statistics.median(join_cpu) * 1e3, 1),
                                 "max": round(max(join_cpu) * 1e3, 1)},
            "store_cpu_in_round_s": done[0].get("store_cpu_s"), "store_ops_per_node": ops_per_node,
            "setup_s": round(setup, 1), "store_connections": connections,
            "beats_per_s": round(beats / beat_seconds, 1), "beats_per_s_configured": nodes / 0.5,
            "store_thread_busy": round(store_cpu / beat_seconds, 3)}


def _since(go: float, pick, times: list[float]) -> float | None:
    """``pick`` (min or max) of the light nodes' phase marks, in seconds after "go"; None without light nodes."""
    return round(pick(times) - go, 3) if times else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1024])
    parser.add_argument("--procs", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--token", action="store_true")
    parser.add_argument("--beat-seconds", type=float, default=5.0)
    parser.add_argument("--ids", choices=("bench", "realistic"), default="realistic",
                        help="node ids, hosts and addresses: short bench ones, or like real agents' (node_info)")
    parser.add_argument("--full-every", type=int, default=64,
                        help="every Nth node runs the real handler end to end; the others are light (docstring)")
    parser.add_argument("--count-ops", action="store_true",
                        help="count each node's store operations in the round, by kind (join thread, heartbeats)")
    parser.add_argument("--no-netns", action="store_true", help="stay in this network namespace (see docstring)")
    parser.add_argument("--auth-cost", action="store_true", help="only the CPU cost of the token, per size")
    parser.add_argument("--store-capacity", action="store_true",
                        help="only the operations per second one TCPStore serves (4 processes x 8 clients)")
    args = parser.parse_args()
    if not args.no_netns and os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip") \
            and not os.environ.get("ELASTRUN_BENCH_NETNS"):
        os.environ["ELASTRUN_BENCH_NETNS"] = "1"
        command = "ip link set lo up && exec " + " ".join([PYTHON, "-m", "bench.bench_rendezvous_scale",
                                                           *sys.argv[1:]])
        os.execvp("unshare", ["unshare", "--net", "sh", "-c", command])
    if args.count_ops:
        os.environ["ELASTRUN_BENCH_COUNT_OPS"] = "1"
    if args.store_capacity:
        print(json.dumps(store_capacity(4, 8)), flush=True)
        return
    if args.auth_cost:
        for nodes in args.nodes:
            print(json.dumps(auth_cost(nodes)), flush=True)
        return
    for nodes in args.nodes:
        rows = [one_round(nodes, args.procs, args.token, args.beat_seconds, args.full_every, args.ids)
                for _ in range(args.repeat)]
        for row in rows:
            print(json.dumps(row), flush=True)
        if len(rows) > 1:
            print(json.dumps({"nodes": nodes, "token": args.token,
                              "median_round_s": statistics.median(r["round_s"] for r in rows)}), flush=True)


if __name__ == "__main__":
    main()
