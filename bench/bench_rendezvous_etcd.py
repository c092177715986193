"""Benchmark of the etcd rendezvous on a real single-member etcd (loopback).

- one round with N agents (real handlers, no workers): time from one "go" to the last
  ``next_round`` returning (wall clock of one machine).  The agents are spread over ``--procs``
  processes (threads inside each), so N agents' Python is not squeezed through one GIL;
- with each round: the requests the agents sent to etcd, per agent and by kind (lease grant,
  keep-alive, range, put, txn, watch stream), the requests per second etcd served, the CPU
  seconds etcd itself used, and the watch events delivered (each agent watches only what it acts
  on, so this grows with N, not N²).  ``--token`` gives every agent a job token;
- the lease renewals: their latency (p50/p90/p99/max per process, ``renew_ms``), the agent leases
  etcd answered "expired" (``leases_lost``: each costs a new grant and a registration) and the
  last renewals of a few of them (``lost_examples``: sent, answered, TTL; seconds after "go");
- lost-node detection with the defaults: a process holding a handler is SIGKILLed and the
  survivor's ``poll()`` is watched until it reports the loss;
- keys left in etcd after every agent closed.

**What this machine adds.**  On a cluster every agent runs on its own machine and etcd on its
own; here N agents and etcd share two cores.  Every agent still sends every request it would
send on a cluster (nothing is shared or skipped), so the agents' own CPU — 15-31 ms of Python
per agent per round (threads, HTTP through ``requests``), all agents' worth in series — is paid
on etcd's two cores: the figure is an upper bound of a real round, and the etcd CPU seconds
printed with it are what the member itself needed.  The load average printed with each round is
taken just before it (the agents' own threads raise it during the round).

The data directory is on tmpfs (``/dev/shm``) by default: a real member runs on an SSD, whose
fsync takes well under a millisecond, and this VM's shared virtual disk is no model of one.  At
64 agents the disk made no difference beyond the noise (1.72 s on it, 0.9-1.7 s on tmpfs): the
round is bound by CPU.  ``--disk`` puts the data directory in ``/tmp`` instead.

``--etcd-cpus K`` pins the member to the first K CPUs and the agents (this process and its
children) to the others: on a machine with more cores than this VM's two, that models a cluster
where the agents run elsewhere and etcd has K cores of its own, so the round measures the
protocol and the member rather than N agents' Python queued on etcd's cores.

``--busy K`` runs K busy loops beside it all, to overload the member (docs/etcd.md, "When etcd is
overloaded").  A round that does not form by ``join_timeout`` is reported with the number of
agents done and their first errors; failed requests are counted by cause, job-lease grants apart.

Run: ``.venv/bin/python -m bench.bench_rendezvous_etcd [--procs 4] [--repeat 3] [--token] [--disk]
[--busy K] [--etcd-cpus K] [--conf KEY=VALUE,...] [N ...]`` (default 2 8 32; ``--conf`` is the agents' ``--rdzv-conf``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

from bench.common import PYTHON, ROOT, read_lines, tell

ROUND_TIMEOUT = 300.0
TOKEN = "bench-token-0123456789abcdef0123456789abcdef"

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


def _count_requests() -> collections.Counter:
    """Count every request this process's etcd clients send, by kind (wraps the client's one entry
    point), the streams they open, the messages sent on them, and the distinct leases granted."""
    from elastrun.rendezvous.etcd import client, lease_keeper, streams

    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()
    request, open_stream, grant = client.EtcdClient.request, streams.open_stream, client.EtcdClient.grant

    def counted_request(self, path: str, body: dict, timeout: float | None = None) -> dict:
        kind = {"/kv/range": "range", "/kv/put": "put", "/kv/txn": "txn", "/lease/grant": "lease grant",
                "/lease/keepalive": "keep-alive", "/kv/deleterange": "delete",
                "/kv/lease/revoke": "lease revoke"}.get(path, path)
        if kind == "txn" and all("request_range" in op for op in body.get("success", [])):
            kind = "txn (reads only)"
        if kind == "lease grant" and int(body.get("TTL", 0)) >= 60:
            kind = "lease grant (job)"  # job_ttl; an agent's lease has lease_ttl
        with lock:
            counts[kind] += 1
        try:
            return request(self, path, body, timeout)
        except Exception as exc:
            text = str(exc).lower()
            why = next((w for w in ("timed out", "applied index", "lease not found", "too many requests",
                                    "lease already exists") if w in text), type(exc).__name__)
            with lock:
                counts[f"failed {kind}: {why}"] += 1
            raise

    def counted_grant(self, ttl: int, lease_id: int = 0) -> int:
        lease = grant(self, ttl, lease_id)
        with lock:
            counts["leases granted (job)" if ttl >= 60 else "leases granted"] += 1
        return lease

    def counted_open(client_, index: int, path: str, timeout: float):
        with lock:
            counts[f"stream {path}"] += 1
        ws = open_stream(client_, index, path, timeout)
        send = ws.send

        def counted_send(text, *args, **kwargs):
            with lock:
                counts[f"message on {path}"] += 1
            return send(text, *args, **kwargs)

        ws.send = counted_send
        return ws

    answer = lease_keeper.LeaseKeeper._answer

    def traced_answer(self, lease: int, sent: float, ttl: int) -> None:
        now, wall = time.monotonic(), time.time()
        with lock:
            RENEWALS.setdefault(lease, []).append((wall - (now - sent), wall, ttl, lease == self.job_lease))
        return answer(self, lease, sent, ttl)

    renew = lease_keeper.KeepAliveStream.renew

    def counted_renew(self, lease: int, timeout: float) -> int:
        try:
            return renew(self, lease, timeout)
        except Exception as exc:
            text = str(exc).lower()
            why = next((w for w in ("applied index", "no answer", "timed out") if w in text), type(exc).__name__)
            with lock:
                counts[f"failed renewal: {why}"] += 1
            raise

    client.EtcdClient.request = counted_request
    client.EtcdClient.grant = counted_grant
    lease_keeper.KeepAliveStream.renew = counted_renew
    streams.open_stream = lease_keeper.open_stream = counted_open
    lease_keeper.LeaseKeeper._answer = traced_answer
    return counts


#: lease -> [(sent, answered, TTL, job lease?)] of every renewal etcd answered (stream or second path).
RENEWALS: dict[int, list] = {}


def _renewal_figures(go: float) -> dict:
    """Renewal latencies (percentiles, ms), the agent leases etcd said expired, and the last
    renewals of a few of them (seconds after "go", TTL answered)."""
    took = sorted(a - s for events in RENEWALS.values() for s, a, _, _ in events if a >= go)
    pick = (lambda q: round(1000 * took[min(len(took) - 1, int(q * len(took)))])) if took else (lambda q: None)
    lost = [[(round(s - go, 2), round(a - go, 2), ttl) for s, a, ttl, _ in events[-6:]]
            for events in RENEWALS.values() if any(ttl <= 0 and not job for _, _, ttl, job in events)]
    return {"renew_ms": {"n": len(took), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99),
                         "max": round(1000 * took[-1]) if took else None}, "leases_lost": len(lost),
            "lost_examples": lost[:3]}


def child(endpoints: str, run_id: str, first: int, count: int, nodes: int, conf: str) -> None:
    """One process of agents: create the handlers, say ready, join on "go", report, close on "close"."""
    import torch.distributed  # noqa: F401 - group rank 0 hosts a TCPStore; keep the import out of the timing

    from elastrun.rendezvous.api import NodeInfo, RendezvousParameters
    from elastrun.rendezvous.conf import split
    from elastrun.rendezvous.etcd import create_handler

    config = split(conf)
    handlers = {i: create_handler(RendezvousParameters("etcd", endpoints, run_id, nodes, nodes, config=config))
                for i in range(first, first + count)}
    counts = _count_requests()
    ends: dict[int, float] = {}
    errors: list[str] = []
    go = threading.Event()

    def join(i: int) -> None:
        go.wait()
        try:
            handlers[i].next_round(NodeInfo(f"n{i:05d}", "127.0.0.1", 1))
            ends[i] = time.time()
        except Exception as exc:
            errors.append(f"agent {i}: {exc}")

    # Every agent's thread exists and waits before "go", so the round does not include the
    # process's main thread creating and starting them one after another.
    threads = [threading.Thread(target=join, args=(i,)) for i in handlers]
    for t in threads:
        t.start()
    print(json.dumps({"ready": len(handlers)}), flush=True)
    sys.stdin.readline()  # "go"
    cpu = time.process_time()
    go_at = time.time()
    go.set()
    for t in threads:
        t.join(ROUND_TIMEOUT)
    events = sum(h._watch.seq for h in handlers.values() if h._watch is not None)
    print(json.dumps({"ends": list(ends.values()), "errors": errors, "requests": dict(counts),
                      "renewals": _renewal_figures(go_at),
                      "events": events, "cpu_s": time.process_time() - cpu}), flush=True)
    sys.stdin.readline()  # "close"
    for h in handlers.values():
        h.close()
    os._exit(0)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(cluster, nodes: int, procs: int, token: bool, tag: int, conf: str = "") -> dict:
    """One measured round of ``nodes`` agents in ``procs`` processes; returns its figures."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ELASTRUN_JOB_TOKEN", None)
    if token:
        env["ELASTRUN_JOB_TOKEN"] = TOKEN
    procs = max(1, min(procs, nodes))
    share = [nodes // procs + (1 if p < nodes % procs else 0) for p in range(procs)]
    children = [subprocess.Popen([PYTHON, "-m", "bench.bench_rendezvous_etcd", "--child", cluster.endpoints,
                                  f"bench{nodes}-{tag}", str(sum(share[:p])), str(share[p]), str(nodes), conf],
                                 cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for p in range(procs)]

    try:
        if sum(r.get("ready", 0) for r in read_lines(children)) != nodes:
            raise RuntimeError("set-up incomplete")
        time.sleep(1.0)  # let the set-up's own requests settle
        load = os.getloadavg()[0]
        etcd_pid = cluster.procs[0].pid
        etcd_cpu = _cpu_seconds(etcd_pid)
        go = time.time()
        tell(children, "go")
        done = read_lines(children)
        etcd_cpu = _cpu_seconds(etcd_pid) - etcd_cpu
        ends = [e for d in done for e in d.get("ends", [])]
        tell(children, "close")
    finally:
        for c in children:
            try:
                c.wait(60)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
    errors = [e for d in done for e in d.get("errors", [])]
    seconds = (max(ends) if len(ends) == nodes else time.time()) - go
    requests: collections.Counter = collections.Counter()
    for d in done:
        requests.update(d["requests"])
    total = sum(v for k, v in requests.items() if not k.startswith(("failed", "leases", "stream", "message")))
    streams = sum(v for k, v in requests.items() if k.startswith("stream"))
    return {"nodes": nodes, "procs": procs, "token": token, "conf": conf, "round_s": round(seconds, 3),
            "agents_done": len(ends), "errors": errors[:3],
            "load_avg_1min": round(load, 1), "etcd_cpu_s": round(etcd_cpu, 2),
            "agents_cpu_s": round(sum(d["cpu_s"] for d in done), 2),
            "requests_per_agent": round(total / nodes, 2), "streams_per_agent": round(streams / nodes, 2),
            "leases_per_agent": round(requests.get("leases granted", 0) / nodes, 2),
            "by_kind_per_agent": {k: round(v / nodes, 2) for k, v in requests.most_common()},
            "requests_per_s": round(total / seconds), "watch_events": sum(d["events"] for d in done),
            "leases_lost": sum(d["renewals"]["leases_lost"] for d in done),
            "renew_ms": [d["renewals"]["renew_ms"] for d in done],
            "lost_examples": [x for d in done for x in d["renewals"]["lost_examples"]][:4]}


def kill_detection(endpoints: str) -> float:
    from elastrun.rendezvous.api import NodeInfo, RendezvousParameters
    from elastrun.rendezvous.etcd import create_handler

    child = subprocess.Popen([PYTHON, "-c", CHILD.format(repo=str(ROOT), ep=endpoints)], stdout=subprocess.PIPE,
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
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        endpoints, run_id, first, count, nodes, conf = sys.argv[2:8]
        child(endpoints, run_id, int(first), int(count), int(nodes), conf)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("nodes", type=int, nargs="*", default=[2, 8, 32])
    parser.add_argument("--procs", type=int, default=4, help="processes the agents are spread over")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--token", action="store_true", help="every agent holds a job token")
    parser.add_argument("--disk", action="store_true", help="etcd's data directory in /tmp, not on tmpfs")
    parser.add_argument("--no-detection", action="store_true", help="skip the lost-node detection")
    parser.add_argument("--busy", type=int, default=0,
                        help="busy loops competing for the CPU during the rounds (an overloaded etcd)")
    parser.add_argument("--etcd-cpus", type=int, default=0,
                        help="pin etcd to the first K CPUs and the agents to the rest (0: no pinning)")
    parser.add_argument("--conf", default="", help="the agents' --rdzv-conf (KEY=VALUE,...); default: the defaults")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # ``timeout``: still stop etcd and remove its data
    from tests.rendezvous.etcd_cluster import EtcdCluster

    data_root = None if args.disk or not os.path.isdir("/dev/shm") else "/dev/shm"
    wrap = []
    if args.etcd_cpus:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) <= args.etcd_cpus:
            parser.error(f"--etcd-cpus {args.etcd_cpus} leaves no CPU for the agents ({len(cpus)} available)")
        wrap = ["taskset", "-c", ",".join(map(str, cpus[:args.etcd_cpus]))]
        os.sched_setaffinity(0, cpus[args.etcd_cpus:])  # inherited by the agents' processes
        print(json.dumps({"etcd_cpus": cpus[:args.etcd_cpus], "agent_cpus": cpus[args.etcd_cpus:]}), flush=True)
    busy = [subprocess.Popen([PYTHON, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        with EtcdCluster(1, data_root=data_root, wrap=wrap) as cluster:
            print(json.dumps({"etcd_data_dir": str(cluster.dir)}), flush=True)
            for n in args.nodes:
                rows = [one_round(cluster, n, args.procs, args.token, r, args.conf) for r in range(args.repeat)]
                for row in rows:
                    print(json.dumps(row), flush=True)
                if any(r["agents_done"] != n for r in rows):
                    print(f"round with {n} agents: {sum(r['agents_done'] != n for r in rows)} of {len(rows)} rounds "
                          "did not complete (see errors above)", flush=True)
                times = sorted(r["round_s"] for r in rows)
                print(f"round with {n} agents in {rows[0]['procs']} processes: median {statistics.median(times):.3f} s "
                      f"(min {times[0]:.3f}, max {times[-1]:.3f})", flush=True)
            if not args.no_detection:
                detections = sorted(kill_detection(cluster.endpoints) for _ in range(3))
                print(f"SIGKILLed agent detected after: {', '.join(f'{d:.2f}' for d in detections)} s")
            print(f"keys left under /elastrun/ after all agents closed: {len(cluster.list_keys())}")
    finally:
        for loop in busy:
            loop.kill()
            loop.wait()


if __name__ == "__main__":
    main()
