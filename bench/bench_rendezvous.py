"""One rendezvous round with N simulated nodes: elastrun's c10d backend beside torch's own handler.

Each simulated node is a handler in a thread (no workers); all N threads of one process join
one round at once, and the figure is the time from the joins until the last node has its
result.  Each measurement runs in a fresh process (``python -m bench.bench_rendezvous IMPL N``)
so that no state or thread survives between them.  torch's handler is
``DynamicRendezvousHandler`` with ``C10dRendezvousBackend`` (benchmark-only use).
"""

from __future__ import annotations

import datetime
import json
import resource
import subprocess
import sys
import threading
import time

from bench.common import PYTHON, ROOT, Row, free_port, log

SIZES = (16, 64, 256)
#: torch's handler is measured up to this size; beyond it a round outlasts the benchmark's budget.
TORCH_MAX = 64
TIMEOUT = 240.0


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


#: Nodes connecting at once; more overflows the store's listen backlog (connect retries, not the round).
_CONNECTING = threading.Semaphore(64)


def _run_threads(nodes: int, join) -> float:
    """Start ``join(i)`` in ``nodes`` threads at once; seconds until the last one returned."""
    errors: list[BaseException] = []
    go = threading.Barrier(nodes + 1)

    def body(i: int) -> None:
        try:
            with _CONNECTING:
                ready = join(i)
            go.wait()
            ready()
        except BaseException as exc:
            errors.append(exc)
            go.abort()

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(nodes)]
    for t in threads:
        t.start()
    go.wait(timeout=TIMEOUT)
    started = time.perf_counter()
    for t in threads:
        t.join(TIMEOUT)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"round not done within {TIMEOUT:g} s")
    return time.perf_counter() - started


def elastrun_round(nodes: int) -> float:
    from elastrun.rendezvous.api import NodeInfo, RendezvousParameters
    from elastrun.rendezvous.registry import create_handler

    port = free_port()
    handlers = []

    def join(i: int):
        params = RendezvousParameters(
            backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="bench", min_nodes=nodes, max_nodes=nodes,
            config={"is_host": "true" if i == 0 else "false", "host_linger": "0", "join_timeout": str(TIMEOUT)},
        )
        if i != 0:
            host_ready.wait(TIMEOUT)
        handler = create_handler(params)
        if i == 0:
            host_ready.set()
        handlers.append(handler)
        node = NodeInfo(node_id=f"node{i:04d}", addr="127.0.0.1", nproc=1, hostname=f"h{i}", pid=i)
        return lambda: handler.next_round(node)

    host_ready = threading.Event()
    took = _run_threads(nodes, join)
    for handler in handlers:
        try:
            handler.close()
        except Exception:
            pass
    return took


def torch_round(nodes: int) -> float:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True)
    timeout = RendezvousTimeout(join=datetime.timedelta(seconds=TIMEOUT), last_call=datetime.timedelta(seconds=1))

    def join(i: int):
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        backend = C10dRendezvousBackend(store, "bench")
        handler = DynamicRendezvousHandler.from_backend("bench", store, backend, nodes, nodes,
                                                        local_addr="127.0.0.1", timeout=timeout)
        return handler.next_rendezvous

    took = _run_threads(nodes, join)
    del server
    return took


def measure(impl: str, nodes: int) -> float | None:
    """One round in a fresh process; None if it failed or ran out of time."""
    try:
        proc = subprocess.run([PYTHON, "-m", "bench.bench_rendezvous", impl, str(nodes)], cwd=ROOT,
                              capture_output=True, text=True, timeout=TIMEOUT + 60)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        log(f"rendezvous {impl} {nodes}: failed\n{proc.stderr[-2000:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]


def run(repeat: int) -> tuple[list[Row], list[str]]:
    rows = []
    for nodes in SIZES:
        torch_times: list[float | None] = []
        ours: list[float | None] = []
        for i in range(repeat):
            ours.append(measure("elastrun", nodes))
            if nodes <= TORCH_MAX:
                torch_times.append(measure("torch", nodes))
            log(f"rendezvous {nodes} nodes #{i}: elastrun {ours[-1]} torch {torch_times[-1] if torch_times else '-'}")
        rows.append(Row(f"rendezvous round, {nodes} simulated nodes", torch_times, ours,
                        goal="≤ 2 s" if nodes == 256 else "",
                        note="torch not run (a 128-node round outlasted its 600 s join timeout, BRIEF)"
                        if nodes > TORCH_MAX else ""))
    return rows, ["Rendezvous rounds: all simulated nodes are threads of one process (one TCPStore client "
                  "each); the figure is from the joins to the last node's result."]


if __name__ == "__main__":
    _raise_fd_limit()
    impl, count = sys.argv[1], int(sys.argv[2])
    seconds = (elastrun_round if impl == "elastrun" else torch_round)(count)
    print(json.dumps({"impl": impl, "nodes": count, "seconds": seconds}))
