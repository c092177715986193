"""Copies of this node's committed shards into other nodes' memory, in the background.

A worker that wants a committed shard file copied leaves a push request in the snapshot directory
(:class:`~elastrun.peer.replicas.PushRequest`: which slot, which step, the meta's CRC, the snapshot
servers to copy it to).  The :class:`Replicator`, a thread of the agent at ``SCHED_IDLE`` priority
(it only takes CPU time a core would otherwise leave idle, as the workers' own snapshot copy does),
picks the request up within :data:`POLL` seconds and, for each target:

1. checks that the slot still holds that step (its meta's CRC);
2. sends a ``put`` (:mod:`elastrun.peer.wire`) with the meta file, waits for the receiver's go;
3. sends the data block by block, each block's CRC32 computed from the original just before it
   goes out with ``sendfile``;
4. checks the slot's meta again: if the worker rewrote the slot meanwhile, the trailer says so and
   the receiver drops what it got; else the trailer carries the CRCs, which the receiver compares
   with its own before it publishes the replica.

Then it writes the outcome (:class:`~elastrun.peer.replicas.PushStatus`) and removes the request:
the worker asks for the next copy only once every rank's request is gone (the decision is taken
together, at a commit, so that every rank's copies are of the same steps).  A target that cannot be
reached costs that copy, never a wait in training.
"""

from __future__ import annotations

import base64
import mmap
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from elastrun.peer import wire
from elastrun.peer.replicas import BLOCK, PushRequest, PushStatus, meta_crc, pending_pushes, read_meta_crc, status_path

#: Seconds between looks for new push requests.
POLL = 0.05
#: Seconds to connect to a target, and to wait on one during a copy.
CONNECT_TIMEOUT = 5.0
IO_TIMEOUT = 60.0


def set_idle() -> None:
    """Put the calling thread at ``SCHED_IDLE`` where the platform allows it (Linux; best effort)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        pass


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
        self._thread = threading.Thread(target=self._loop, name="elastrun-replicator", daemon=True)
        self._warned: set[str] = set()
        #: Copies made and bytes sent, for benchmarks and the report.
        self.stats = {"copies": 0, "failed": 0, "bytes": 0, "seconds": 0.0}

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        for conn in list(self._conns.values()):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread.is_alive():
            self._thread.join(10)
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    def _loop(self) -> None:
        set_idle()
        while not self._stop.is_set():
            for path in pending_pushes(self.dir):
                if self._stop.is_set():
                    return
                self.push(path)
            self._stop.wait(POLL)

    def push(self, path: Path) -> PushStatus | None:
        """Serve the request at ``path`` (every target), record the outcome, remove the request."""
        req = PushRequest.read(path)
        if req is None:
            path.unlink(missing_ok=True)
            return None
        began = time.monotonic()
        errors = []
        for target in req.targets:
            try:
                self._send(req, target)
            except (OSError, ValueError) as e:
                self._drop(target)
                errors.append(f"{target}: {e}")
        took = time.monotonic() - began
        status = PushStatus(req.step, not errors, req.targets, req.nbytes, round(took, 4), "; ".join(errors))
        status.write(status_path(self.dir, req.kind, req.rank))
        path.unlink(missing_ok=True)
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
        return status

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

    def _send(self, req: PushRequest, target: str) -> None:
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
                            crcs.append(zlib.crc32(view[lo:hi]))
                            conn.sendfile(f, lo, hi - lo)
                    finally:
                        view.release()
        if read_meta_crc(meta_path) != req.meta_crc:
            wire.send_msg(conn, {"ok": False, "error": f"{req.name} was rewritten while it was being copied"})
            wire.recv_msg(conn)
            raise ValueError(f"{req.name} of step {req.step} was rewritten while it was being copied")
        wire.send_msg(conn, {"ok": True, "crcs": crcs})
        wire.expect_ok(wire.recv_msg(conn), f"snapshot server {target}")

