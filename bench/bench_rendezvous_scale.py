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
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time

from bench.common import PYTHON, ROOT, free_port, read_lines, tell

SETUP_TIMEOUT = 900.0
ROUND_TIMEOUT = 300.0
#: Handlers of one process connecting at once (a connection storm only slows the set-up).
CONNECTING = 8
TOKEN = "bench-token-0123456789abcdef0123456789abcdef"


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
        argv = [PYTHON, "-m", "bench.bench_rendezvous_scale", "--child", str(port), str(starts[p]), str(share[p]),
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
        port, first, count, nodes, beat_seconds, full_every, ids = sys.argv[2:9]
        child(int(port), int(first), int(count), int(nodes), float(beat_seconds), int(full_every), ids)
        return
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
