"""One process of simulated rendezvous nodes, for :mod:`bench.bench_rendezvous_scale` (its docstring says
why nodes are *full* or *light*, and what each light node shares with the others of its process).

The parent starts it as ``python -m bench.rdzv_nodes PORT FIRST COUNT NODES BEAT_SECONDS FULL_EVERY IDS``
and drives it over stdin and stdout, one JSON line each way per phase: connected ("ready"), the round
on "go", the heartbeat window on "beat", the end on "close".
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time

SETUP_TIMEOUT = 900.0
ROUND_TIMEOUT = 300.0
#: Handlers of one process connecting at once (a connection storm only slows the set-up).
CONNECTING = 8

try:  # the rosters of elastrun.rendezvous.c10d.seats (absent in the code before it, which this bench also runs)
    from elastrun.rendezvous.c10d import seats as _ROSTER
except ImportError:
    _ROSTER = None


def _seated(handler, key: str, raw: bytes) -> bool:
    """Whether the result ``raw`` is a seated round's header (each node then reads its own seat)."""
    if _ROSTER is None or len(raw) > 4096:  # a full member list of thousands: not a header
        return False
    from elastrun.rendezvous.rounds import decode_result

    return _ROSTER.is_seated(decode_result(handler._auth.open(key, raw)))


def _sink() -> int:
    """A listening port that accepts connections and never answers (see ``_start_link``)."""
    import socket

    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen(512)
    held = []

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            held.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1]


def node_info(i: int, ids: str):
    """Node ``i``'s info: bench ids (``node00042`` on 127.0.0.1), or realistic ones like an agent's
    (``host-pid-xxxx``, a host name, a distinct loopback address per node; node 0 keeps 127.0.0.1,
    where it hosts the store)."""
    from elastrun.rendezvous.api import NodeInfo

    if ids == "bench":
        return NodeInfo(node_id=f"node{i:05d}", addr="127.0.0.1", nproc=1, hostname=f"h{i}", pid=i)
    host = f"gpu-a100-{i:05d}"
    pid = 100_000 + (i * 7919) % 900_000
    j = i + 1
    addr = "127.0.0.1" if i == 0 else f"127.{(j >> 16) & 255}.{(j >> 8) & 255}.{(j & 255) or 1}"
    return NodeInfo(node_id=f"{host}-{pid}-{(i * 40503) & 0xffff:04x}", addr=addr, nproc=8, hostname=host, pid=pid)


class _SharedParse:
    """One parse of a round's result per process, shared by its light nodes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rounds: dict[int, tuple] = {}
        self._rosters: dict[int, object] = {}

    def roster(self, round_: int, members):
        with self.lock:
            if round_ not in self._rosters:
                self._rosters[round_] = _ROSTER.FullRoster(members)
            return self._rosters[round_]

    def get(self, handler, round_: int, key: str, raw: bytes) -> tuple:
        from elastrun.rendezvous.api import Member
        from elastrun.rendezvous.rounds import decode_result

        with self.lock:
            if round_ not in self.rounds:
                doc = decode_result(handler._auth.open(key, raw))
                members = [Member(**m) for m in doc["members"]]
                ring = [m.node_id for m in sorted(members, key=lambda m: m.group_rank)]
                self.rounds[round_] = (doc, members, ring, {m.node_id: m for m in members},
                                       sum(m.nproc for m in members))
            return self.rounds[round_]


class _Beater(threading.Thread):
    """Sends the heartbeats of a process's light nodes, in turn, with each node's real ``_beat``."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.handlers: list = []
        self.lock = threading.Lock()

    def run(self) -> None:
        while True:
            started = time.monotonic()
            with self.lock:
                handlers = list(self.handlers)
            for h in handlers:
                if h._closed:
                    continue
                try:
                    h._beat()
                except Exception as exc:
                    h._on_heartbeat_error(exc)
            time.sleep(max(0.0, self.interval - (time.monotonic() - started)))


def light_handler_class():
    """The real c10d handler with the two per-node steps a light node shares (see the module docstring)."""
    from elastrun.rendezvous.api import RoundResult
    from elastrun.rendezvous.c10d import StoreRendezvousHandler

    class LightHandler(StoreRendezvousHandler):
        shared = _SharedParse()
        beater: _Beater | None = None
        #: Wall-clock phase marks of this process's light nodes: joins written, result fetched.
        joined_at: list[float] = []
        fetched_at: list[float] = []
        result_bytes = 0
        sink_port = 0

        def _await_close(self, round_, idx, deadline):
            self.joined_at.append(time.time())
            return super()._await_close(round_, idx, deadline)

        def _start_link(self, node) -> None:
            # One liveness link per real agent; a simulated node holds none.  With realistic ids it
            # names the port of its process's sink (accepts, never answers: a watcher's link to it
            # then says nothing, as to a silent node), so the bytes of its node info are realistic.
            node.link_port = LightHandler.sink_port

        def _start_heartbeat(self) -> None:
            if self._heartbeat is None:  # the beater's next turn is its first beat, as a thread's would be
                self._heartbeat = True
                with self.beater.lock:
                    self.beater.handlers.append(self)

        def _await_result(self, round_, node, deadline):
            key = self._r(round_, "result")
            fetched_key, raw = self._fetched  # read with ``closed``, as by a full node
            self._fetched = ("", None)
            if fetched_key != key or raw is None:
                while not self._wait(key, 1.0):
                    if time.monotonic() >= deadline:
                        raise self._timeout_error(round_)
                raw = self._peek(key)  # the whole document comes over the wire, as for a full node
            self.fetched_at.append(time.time())
            LightHandler.result_bytes = len(raw)
            if _seated(self, key, raw):  # a member reads its own seat: O(1) per node, the real path
                self._fetched = (key, raw)
                return super()._await_result(round_, node, deadline)
            doc, members, ring, by_id, world = self.shared.get(self, round_, key, raw)
            me = by_id.get(node.node_id)
            if me is None or me.group_rank == 0:
                self._fetched = (key, raw)
                return super()._await_result(round_, node, deadline)
            address = doc.get("store") or self._await_value(self._r(round_, "store"), deadline)
            store_addr, _, store_port = address.rpartition(":")
            result = RoundResult(round=round_, generation=doc["generation"], group_rank=me.group_rank,
                                 group_world_size=len(members), rank_offset=me.rank_offset, world_size=world,
                                 role_rank_offset=me.role_rank_offset, role_world_size=world,
                                 store_addr=store_addr, store_port=int(store_port), members=members)
            if _ROSTER:  # the shared parse's members, not copies
                self._adopt(round_, result, self.shared.roster(round_, members))
            else:  # the code before seats.py (to measure it with this bench)
                self._adopt(round_, result, ring, by_id)
            return result

        def close(self) -> None:
            self._heartbeat = None
            super().close()

    return LightHandler


def _store_thread_cpu() -> float:
    """CPU seconds of this process's threads that are not Python threads (the TCPStore server's)."""
    python_ids = {t.native_id for t in threading.enumerate()}
    total = 0.0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in python_ids:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return total


class _Counted:
    """A store client that counts its operations by name (``--count-ops``)."""

    def __init__(self, store, counts: dict) -> None:
        self._store = store
        self._counts = counts

    def __getattr__(self, name: str):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr
        counts = self._counts

        def counted(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return attr(*args, **kwargs)

        return counted


def child(port: int, first: int, count: int, nodes: int, beat_seconds: float, full_every: int, ids: str) -> None:
    """One process of simulated nodes: connect, say ready, join on "go", report, heartbeat, close."""
    import signal

    from elastrun.shared.prctl import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)  # in a session of its own: no terminal signal reaches it
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    from elastrun.rendezvous.api import RendezvousParameters
    from elastrun.rendezvous.c10d import StoreRendezvousHandler
    from elastrun.rendezvous.endpoint import split_endpoint
    from elastrun.rendezvous.rounds import decode_result

    light = light_handler_class()
    light.beater = _Beater(0.5)
    if ids == "realistic":
        light.sink_port = _sink()

    def params(i: int) -> RendezvousParameters:
        return RendezvousParameters(
            backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="bench", min_nodes=nodes, max_nodes=nodes,
            config={"is_host": "true" if i == 0 else "false", "host_linger": "0",
                    "join_timeout": str(SETUP_TIMEOUT), "read_timeout": str(ROUND_TIMEOUT)},
        )

    def make(i: int):
        p = params(i)
        host, port_ = split_endpoint(p.endpoint, 29400)
        cls = StoreRendezvousHandler if i % full_every == 0 else light
        return cls(p, host, port_, i == 0)

    handlers: dict[int, object] = {}
    errors: list[str] = []
    if first == 0:
        handlers[0] = make(0)
    gate = threading.Semaphore(CONNECTING)

    def connect(i: int) -> None:
        try:
            with gate:
                handlers[i] = make(i)
        except Exception as exc:
            errors.append(f"node {i}: {exc}")

    threads = [threading.Thread(target=connect, args=(i,)) for i in range(first, first + count) if i != 0]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ends: dict[int, float] = {}
    #: CPU seconds of each node's join thread in the round (what the round costs that agent itself).
    join_cpu: dict[int, float] = {}
    results: dict[int, object] = {}
    go = threading.Event()

    def join(i: int) -> None:
        go.wait()
        try:
            cpu = time.thread_time()
            results[i] = handlers[i].next_round(node_info(i, ids))
            ends[i] = time.time()
            join_cpu[i] = time.thread_time() - cpu
        except Exception as exc:
            errors.append(f"node {i}: {exc}")

    # Every node's thread exists and waits before "go": creating and starting 128 threads after it
    # took the process's main thread up to 0.7 s of the round, so the last nodes joined that late.
    threads = [threading.Thread(target=join, args=(i,)) for i in sorted(handlers)]
    for t in threads:
        t.start()
    join_ops: dict[str, int] = {}
    beat_ops: dict[str, int] = {}
    if os.environ.get("ELASTRUN_BENCH_COUNT_OPS"):
        for h in handlers.values():
            h._store = _Counted(h._store, join_ops)
            h._hb_store = _Counted(h._hb_store, beat_ops)
    print(json.dumps({"ready": len(handlers), "errors": errors[:3]}), flush=True)
    sys.stdin.readline()  # "go"
    store_cpu_go = _store_thread_cpu()
    light.beater.start()
    go.set()
    given_up = time.monotonic() + ROUND_TIMEOUT
    report_at = time.monotonic() + 30.0
    for t in threads:
        while t.is_alive() and time.monotonic() < given_up:
            t.join(1.0)
            if time.monotonic() >= report_at:  # a round that drags says where (on the parent's stderr)
                report_at += 30.0
                waiting = sum(1 for t in threads if t.is_alive())
                print(f"nodes {first}-{first + count - 1}: {waiting} still in the round, errors: {errors[:2]}",
                      file=sys.stderr, flush=True)
    store_cpu_round = _store_thread_cpu() - store_cpu_go
    ops = {"join": dict(join_ops), "beat": dict(beat_ops)}
    full = [i for i in ends if i % full_every == 0]
    ranks = sorted(r.group_rank for r in results.values())
    per_node = 1 if ids == "bench" else 8
    agree = all(results[i].group_world_size == nodes and results[i].world_size == nodes * per_node for i in results)
    closed_at = closer = None
    if full:
        raw = handlers[full[0]]._read(handlers[full[0]]._r(0, "result"))
        closed_at = decode_result(raw)["closed_at"] if raw else None
        closer = (handlers[full[0]]._read(handlers[full[0]]._r(0, "closed")) or ":").partition(":")[2]
    print(json.dumps({"end": max(ends.values()) if ends else None, "joined": len(ends), "errors": errors[:3],
                      "full": len(full), "full_end": max((ends[i] for i in full), default=None),
                      "full_join_cpu": [join_cpu[i] for i in full],
                      "closed_at": closed_at, "closer": closer, "ranks": ranks, "agree": agree,
                      "joins_written": max(light.joined_at, default=None),
                      "first_fetch": min(light.fetched_at, default=None),
                      "last_fetch": max(light.fetched_at, default=None), "result_bytes": light.result_bytes,
                      "store_cpu_s": round(store_cpu_round, 3), "ops": ops}), flush=True)
    sys.stdin.readline()  # "beat": every process's nodes are heartbeating now

    def beats() -> int:
        return sum(h._hb_counter for h in handlers.values())

    before, cpu_before = beats(), _store_thread_cpu()
    time.sleep(beat_seconds)
    after, cpu_after = beats(), _store_thread_cpu()
    print(json.dumps({"beats": after - before, "store_cpu_s": round(cpu_after - cpu_before, 3)}), flush=True)
    sys.stdin.readline()  # "close"
    for handler in handlers.values():
        try:
            handler.close()
        except Exception:
            pass
    os._exit(0)


if __name__ == "__main__":
    _port, _first, _count, _nodes, _beat_seconds, _full_every, _ids = sys.argv[1:8]
    child(int(_port), int(_first), int(_count), int(_nodes), float(_beat_seconds), int(_full_every), _ids)
