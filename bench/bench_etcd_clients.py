"""The etcd client, side by side: elastrun's (JSON gateway over HTTP, streams over WebSocket) and a gRPC one.

Why it exists: docs/etcd.md, "Why the JSON gateway": whether a gRPC client would serve an agent
better is decided on these figures.  On one local etcd member it times, for each client, the
requests an agent makes in a round and while it runs:

- ``txn``: one transaction with a put and three reads (an agent's join);
- ``keep-alive``: one lease renewal (elastrun: a message on its keep-alive stream; the gRPC
  client: ``refresh_lease``, one ``LeaseKeepAlive`` stream per renewal, on its one HTTP/2 connection);
- ``watch event``: one key put by another client and seen on a watch held open.

and reports per operation the wall time, the client's CPU and the member's CPU (what a shared
etcd pays per agent request).  The gRPC client is ``etcd-sdk-python`` (module ``pyetcd``:
python-etcd3's API on today's grpcio and protobuf); it is not an elastrun dependency: run this with an interpreter that
has it, e.g. ``python -m venv /tmp/g && /tmp/g/bin/pip install etcd-sdk-python protobuf
etcd3gw websocket-client psutil`` then ``PYTHONPATH=. /tmp/g/bin/python -m bench.bench_etcd_clients``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

ROUNDS = 400


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed(name: str, etcd_pid: int, op, n: int = ROUNDS) -> dict:
    op(0)  # warm up (connections, streams)
    cpu, etcd, wall = time.process_time(), _cpu(etcd_pid), time.perf_counter()
    for i in range(n):
        op(i)
    wall, cpu, etcd = time.perf_counter() - wall, time.process_time() - cpu, _cpu(etcd_pid) - etcd
    return {"op": name, "wall_ms": round(wall / n * 1e3, 3), "client_cpu_ms": round(cpu / n * 1e3, 3),
            "etcd_cpu_ms": round(etcd / n * 1e3, 3)}


def gateway(endpoint: str, etcd_pid: int) -> list[dict]:
    from elastrun.rendezvous.etcd.client import EtcdClient, EtcdSettings, Shared, op_put, op_range
    from elastrun.rendezvous.etcd.lease_keeper import KeepAliveStream
    from elastrun.rendezvous.etcd.streams import WatchSet

    host, port = endpoint.rsplit(":", 1)
    settings = EtcdSettings([(host, int(port))])
    kv = EtcdClient(settings, Shared())
    lease = kv.grant(60)
    txn = lambda i: kv.txn_reads([], [op_put(f"/b/join/{i}", "x" * 120, lease), op_range("/b/result"),  # noqa: E731
                                      op_range("/b/join/", "/b/join0", limit=1), op_range(f"/b/join/{i}")])
    stream = KeepAliveStream(kv)
    renew = lambda i: stream.renew(lease, 3.0)  # noqa: E731
    watch = WatchSet(lambda: EtcdClient(settings, Shared()))
    watch.watch("w", "/b/watched", "/b/watched\0", kv.revision + 1)
    time.sleep(0.5)

    def event(i: int) -> None:
        seen = watch.seq
        kv.put("/b/watched", str(i))
        while watch.seq == seen:
            watch.wait(seen, 1.0)

    rows = [_timed("txn", etcd_pid, txn), _timed("keep-alive", etcd_pid, renew),
            _timed("watch event (with its put)", etcd_pid, event)]
    watch.stop()
    stream.close()
    return [{"client": "elastrun (JSON gateway + WebSocket)", **r} for r in rows]


def grpc(endpoint: str, etcd_pid: int) -> list[dict]:
    import pyetcd as etcd3

    host, port = endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port))
    lease = client.lease(60)
    txn = lambda i: client.transaction(  # noqa: E731
        compare=[], success=[client.transactions.put(f"/g/join/{i}", "x" * 120, lease=lease),
                             client.transactions.get("/g/result"), client.transactions.get("/g/join/"),
                             client.transactions.get(f"/g/join/{i}")], failure=[])
    renew = lambda i: list(client.refresh_lease(lease.id))  # noqa: E731
    seen: list[int] = []
    arrived = threading.Condition()

    def on_event(_response) -> None:
        with arrived:
            seen.append(1)
            arrived.notify_all()

    client.add_watch_callback("/g/watched", on_event)
    time.sleep(0.5)

    def event(i: int) -> None:
        with arrived:
            before = len(seen)
        client.put("/g/watched", str(i))
        with arrived:
            arrived.wait_for(lambda: len(seen) > before, 1.0)

    return [{"client": "gRPC (etcd-sdk-python, grpcio)", **r}
            for r in (_timed("txn", etcd_pid, txn), _timed("keep-alive", etcd_pid, renew),
                      _timed("watch event (with its put)", etcd_pid, event))]


def main() -> None:
    sys.path.insert(0, os.getcwd())
    from tests.rendezvous.etcd_cluster import EtcdCluster

    with EtcdCluster(1, data_root="/dev/shm" if os.path.isdir("/dev/shm") else None) as cluster:
        pid = cluster.procs[0].pid
        for rows in (gateway(cluster.endpoint(0), pid), grpc(cluster.endpoint(0), pid),
                     gateway(cluster.endpoint(0), pid)):
            for row in rows:
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
