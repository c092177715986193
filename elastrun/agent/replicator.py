"""Copies of this node's committed shards into other nodes' memory, in the background.

A worker that wants a committed shard file copied leaves a push request in the snapshot directory
(:class:`~elastrun.shared.replicas.PushRequest`: which slot, which step, the meta's CRC, the snapshot
servers to copy it to, how often the worker commits).  The :class:`Replicator`, threads of the
agent, picks the request up as soon as it is written (the directory is watched with inotify where
the platform has it, else polled every :data:`POLL` seconds) and, for each target:

1. checks that the slot still holds that step (its meta's CRC);
2. sends a ``put`` (:mod:`elastrun.shared.snapshot_wire`) with the meta file, waits for the receiver's go;
3. sends the data block by block, each block's CRC32 computed from the original just before it
   goes out with ``sendfile``;
4. checks the slot's meta again: if the worker rewrote the slot meanwhile, the trailer says so and
   the receiver drops what it got; else the trailer carries the CRCs, which the receiver compares
   with its own before it publishes the replica.

Then it writes the outcome (:class:`~elastrun.shared.replicas.PushStatus`) and removes the request:
the worker asks for the next copy only once every rank's request is gone (the decision is taken
together, at a commit, so that every rank's copies are of the same steps).  A target that cannot be
reached costs that copy, never a wait in training.

**Priority (the pacing rule).**  A copy starts on a thread at ``SCHED_IDLE`` (nice 19 where that
could not be left again: :mod:`elastrun.shared.priority`): it takes only CPU time a core would
otherwise leave idle, so where training leaves any, the copy costs training nothing.  On a host
whose cores training (or anything else) keeps busy, an idle thread may not run for seconds, and the
replicas would fall many commits behind.  So a copy still unfinished one commit interval after it
began (the interval the worker measured, in the request; :data:`GRACE` when unknown) is taken over,
from the next piece of at most :data:`PIECE` bytes, by a second thread at nice :data:`LATE_NICE`:
the kernel's fair scheduler gives it all of a core no one else wants and, against one busy thread at
nice 0, about 5 % of a contended core (weight 56 against 1024): the issue's budget for the copies'
cost to a step.  Two threads, not one raised: an unprivileged thread can lower its priority but
never raise it again.

**Low-priority threads live only while they copy.**  Each copy gets its own threads, which end
with it; the dispatcher that waits for requests runs at normal priority.  A process's end waits
for every one of its threads to run its exit, and the last one out tears the address space down
before the kernel closes the process's descriptors: an agent that kept an idle-priority thread
parked took 10-13 s to die of a SIGKILL on a busy host (30 ms on an idle one), its sockets open all
that time, so its peers' liveness links could not see it gone, and every agent's own exit waited
as long (measured 2026-11-27, docs/benchmarks.md).
"""

from __future__ import annotations

import base64
import mmap
import os
import re
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from elastrun.agent.dirwatch import Watch
from elastrun.shared import priority
from elastrun.shared import snapshot_wire as wire
from elastrun.shared.replicas import (
    BLOCK,
    PushRequest,
    PushStatus,
    meta_crc,
    pending_pushes,
    read_meta_crc,
    status_path,
)

_PUSH_NAME = re.compile(r"push\.[a-z]+\.r\d+\.json")

#: Seconds between looks for new push requests where the directory cannot be watched.
POLL = 0.05
#: Seconds a copy runs at idle priority before it is taken over at :data:`LATE_NICE`, when the
#: request does not say how often its worker commits.
GRACE = 1.0
#: The nice value of the thread that takes over a late copy (see the module docstring).
LATE_NICE = 15
#: False: copies stay at idle priority however late (the rule before; for comparisons).
TAKE_OVER = True
#: Bytes sent between two looks at whether the copy changed hands (a late copy waits at most for
#: one piece still held by the idle thread).
PIECE = 1 << 20
#: Seconds between the dispatcher's looks at ``close()`` while a late copy runs.
POLL_STOP = 0.5
#: Seconds to connect to a target, and to wait on one during a copy.
CONNECT_TIMEOUT = 5.0
IO_TIMEOUT = 60.0


def set_late() -> None:
    """Put the calling thread at nice :data:`LATE_NICE` (never higher than it is; best effort)."""
    priority.nice_at_least(LATE_NICE)


class Replicator:
    """Serves the push requests of one node's workers (see the module docstring).

    ``source``: this node's name in the receivers' ``replicas/<source>/``::

        replicator = Replicator(runtime.snapshot_dir, key, "node-a", warn=console.warn)
        replicator.start()
        ...
        replicator.close()
    """

    def __init__(self, directory: Path, key: bytes | None, source: str, warn: Callable[[str], None]) -> None:
        self.dir = Path(directory)
        self.key = key
        self.source = source
        self.warn = warn
        self._conns: dict[str, socket.socket] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        # The dispatcher (normal priority, mostly waiting): finds requests and starts each copy on a
        # thread of its own at SCHED_IDLE, then, when it is late, a second one at LATE_NICE.
        self._thread = threading.Thread(target=self._loop, name="elastrun-replicator", daemon=True)
        self._copiers: list[threading.Thread] = []  # this copy's threads (the dispatcher's only)
        self._turn = threading.Lock()  # held by the thread advancing the copy in progress
        self._watch: Watch | None = None
        self._warned: set[str] = set()
        #: Copies made and bytes sent, copies taken over late, for benchmarks and the report.
        self.stats = {"copies": 0, "failed": 0, "bytes": 0, "seconds": 0.0, "late": 0}

    def start(self) -> None:
        self._watch = Watch(self.dir, _PUSH_NAME, self._wake)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        for conn in list(self._conns.values()):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread.is_alive():
            self._thread.join(10)
        # A copy's thread at idle priority may not run for a while on a busy host; it is a daemon, and
        # its copy is abandoned (the receiver keeps its last complete replica).
        deadline = time.monotonic() + 1.0
        for t in list(self._copiers):
            t.join(max(0.0, deadline - time.monotonic()))
        if self._watch is not None:
            self._watch.close()
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    # -- the dispatcher and each copy's threads -----------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            for path in pending_pushes(self.dir):
                if self._stop.is_set():
                    return
                self._dispatch(path)
            self._wake.wait(self._watch.timeout if self._watch is not None else POLL)

    def _dispatch(self, path: Path) -> None:
        """Serve one request: on an idle-priority thread while it keeps pace, then on a late one too."""
        job = _Job(self, path)
        self._copiers = [t for t in self._copiers if t.is_alive()]
        self._start_copier(job, late=False)
        while True:
            late_at = job.began + job.grace
            timeout = max(0.0, late_at - time.monotonic()) if TAKE_OVER and not job.late else POLL_STOP
            if job.finished.wait(timeout) or self._stop.is_set():
                return
            if TAKE_OVER and not job.late and time.monotonic() >= late_at:
                job.late = True
                self.stats["late"] += 1
                self._start_copier(job, late=True)

    def _start_copier(self, job: _Job, late: bool) -> None:
        thread = threading.Thread(target=self._copy, args=(job, late), daemon=True,
                                  name=f"elastrun-replicator-{'late' if late else 'idle'}")
        self._copiers.append(thread)
        thread.start()

    def _copy(self, job: _Job, late: bool) -> None:
        """A copy's thread: lower its own priority (for good: it ends with the copy), then advance it."""
        if late:
            set_late()
        else:
            priority.lower()
        self._advance(job, late=late)

    def _advance(self, job: _Job, late: bool) -> None:
        """Run ``job`` a piece at a time until it is done or, on the idle thread, taken over."""
        while not job.finished.is_set():
            with self._turn:
                if job.late and not late:
                    return
                try:
                    next(job.steps)
                except StopIteration:
                    job.finished.set()
                except Exception as e:  # a bug must not stop the copies (nor the agent)
                    job.finished.set()
                    self.warn(f"replicator: {type(e).__name__}: {e}")

    def push(self, path: Path) -> PushStatus | None:
        """Serve the request at ``path`` on the calling thread (every target), record the outcome,
        remove the request."""
        job = _Job(self, path)
        self._advance(job, late=True)
        return job.status

    def _steps(self, path: Path, req: PushRequest | None, job: _Job) -> Iterator[None]:
        """The work of one request, a piece at a time (a generator: either thread may advance it)."""
        if req is None:
            path.unlink(missing_ok=True)
            return
        for gone in set(self._conns) - set(req.targets):  # a re-form changed the targets: a node that left
            self._drop(gone)  # or died would otherwise keep its connection open for the agent's whole life
        began = time.monotonic()
        errors = []
        for target in req.targets:
            try:
                yield from self._send(req, target)
            except (OSError, ValueError) as e:
                self._drop(target)
                errors.append(f"{target}: {e}")
        took = time.monotonic() - began
        status = PushStatus(req.step, not errors, req.targets, req.nbytes, round(took, 4), "; ".join(errors),
                            late=job.late)  # fmt: skip
        status.write(status_path(self.dir, req.kind, req.rank))
        path.unlink(missing_ok=True)
        job.status = status
        if errors:
            self.stats["failed"] += 1
            key = errors[0].split(":", 1)[0]
            if key not in self._warned:  # once per target: a lost node fails every copy until the re-form
                self._warned.add(key)
                self.warn(f"copy of rank {req.rank}'s shard of step {req.step} to another node failed: {errors[0]}")
        else:
            self.stats["copies"] += 1
            self.stats["bytes"] += req.nbytes * len(req.targets)
            self.stats["seconds"] += took

    def _conn(self, target: str) -> socket.socket:
        conn = self._conns.get(target)
        if conn is None:
            conn = socket.create_connection(wire.split_address(target), timeout=CONNECT_TIMEOUT)
            try:
                wire.tune(conn)
                conn.settimeout(IO_TIMEOUT)
                wire.client_handshake(conn, self.key, target)
            except BaseException:
                conn.close()
                raise
            self._conns[target] = conn
        return conn

    def _drop(self, target: str) -> None:
        conn = self._conns.pop(target, None)
        if conn is not None:
            conn.close()

    def _send(self, req: PushRequest, target: str) -> Iterator[None]:
        meta_path = self.dir / f"{req.name}.meta"
        try:
            meta = meta_path.read_bytes()
        except FileNotFoundError:
            raise ValueError(f"{req.name} of step {req.step} was rewritten before it could be copied") from None
        if meta_crc(meta) != req.meta_crc:
            raise ValueError(f"{req.name} of step {req.step} was rewritten before it could be copied")
        conn = self._conn(target)
        wire.send_msg(conn, {"op": "put", "src": self.source, "kind": req.kind, "rank": req.rank, "step": req.step,
                             "world_size": req.world_size, "nbytes": req.nbytes, "block": BLOCK,
                             "meta": base64.b64encode(meta).decode()})  # fmt: skip
        wire.expect_ok(wire.recv_msg(conn), f"snapshot server {target}")
        crcs = []
        with open(self.dir / f"{req.name}.data", "rb") as f:
            if os.fstat(f.fileno()).st_size < req.nbytes:
                raise ValueError(f"{req.name}.data is shorter than its meta says")
            if req.nbytes:
                with mmap.mmap(f.fileno(), req.nbytes, prot=mmap.PROT_READ) as mm:
                    view = memoryview(mm)
                    try:
                        for lo in range(0, req.nbytes, BLOCK):
                            hi = min(lo + BLOCK, req.nbytes)
                            crc = 0
                            for at in range(lo, hi, PIECE):  # the CRC of each piece just before it goes
                                end = min(at + PIECE, hi)
                                crc = zlib.crc32(view[at:end], crc)
                                conn.sendfile(f, at, end - at)
                                yield
                            crcs.append(crc)
                    finally:
                        view.release()
        if read_meta_crc(meta_path) != req.meta_crc:
            wire.send_msg(conn, {"ok": False, "error": f"{req.name} was rewritten while it was being copied"})
            wire.recv_msg(conn)
            raise ValueError(f"{req.name} of step {req.step} was rewritten while it was being copied")
        wire.send_msg(conn, {"ok": True, "crcs": crcs})
        wire.expect_ok(wire.recv_msg(conn), f"snapshot server {target}")



class _Job:
    """A request being served: its steps (advanced by one thread at a time), when it began, how long it
    may stay at idle priority, whether the late thread took it over, and its outcome."""

    def __init__(self, replicator: Replicator, path: Path) -> None:
        self.began = time.monotonic()
        req = PushRequest.read(path)
        self.grace = req.interval if req is not None and req.interval > 0 else GRACE
        self.late = False
        self.finished = threading.Event()
        self.status: PushStatus | None = None
        self.steps = replicator._steps(path, req, self)
