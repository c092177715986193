"""The agent's snapshot server: the node's snapshots and replicas, served from memory to other nodes.

A node service (:class:`SnapshotService`): it starts with the agent, outlives every worker, and is
closed when the agent exits.  Its server (:class:`SnapshotServer`) answers, on one TCP port:

* ``get``: a byte range of a snapshot file of this node (a worker's shard or DDP state, or a
  replica held for another node), sent with ``sendfile`` straight from the file in ``/dev/shm``.
  A replica's blocks are checked against their CRCs first: a corrupt one is refused, not sent;
* ``put``: a replica of another node's committed shard (:mod:`elastrun.agent.replicator` on the
  sending side), received straight into its file in ``replicas/<source>/``, checked against the
  sender's CRCs and published (meta last) only if they match.  The two newest steps of each
  ``(kind, rank)`` are kept.

Access (the protocol is :mod:`elastrun.shared.snapshot_wire`): with a job token every connection proves the
job's snapshot key (derived from the token and the run id) before it may ask anything, and the
server listens on every address; without a token it listens on the agent's own address only.  The
workers find the server's address in ``ELASTRUN_SNAPSHOT_SERVER`` and the key in the file named by
``ELASTRUN_SNAPSHOT_KEY_FILE`` (mode 0600, in the agent's runtime directory).
"""

from __future__ import annotations

import base64
import mmap
import os
import shutil
import socket
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastrun.agent.replicator import Replicator, set_late
from elastrun.agent.runtime import NodeRuntime, NodeService
from elastrun.rendezvous.auth import hkdf_sha256
from elastrun.shared import log
from elastrun.shared import snapshot_wire as wire
from elastrun.shared.protocol import SNAPSHOT_KEY_ENV, SNAPSHOT_SERVER_ENV
from elastrun.shared.replicas import (
    REPLICAS,
    CorruptReplica,
    Sums,
    meta_crc,
    read_meta_crc,
    replica_dirs,
    verify,
)

_log = log.get("agent")

#: Connections served at once; more wait in the listen backlog.
MAX_CONNECTIONS = 64
#: Seconds an authenticated connection may stay idle between requests.
IDLE_TIMEOUT = 300.0
#: Complete steps of each ``(kind, rank)`` kept among the replicas (older ones are removed).
KEEP_STEPS = 2
#: Node memory left free when a replica is accepted.
HEADROOM = 64 << 20


def snapshot_key(token: bytes, run_id: str) -> bytes:
    """The job's snapshot key: what its servers and their clients prove they hold (not the token)."""
    return hkdf_sha256(token, b"elastrun snapshot server v1", run_id.encode())


class _Refused(Exception):
    """A request answered with an error; the connection goes on."""


class SnapshotServer:
    """Serves ``directory`` (the node's snapshot directory) on ``bind``; see the module docstring.

    ``key``: the job's snapshot key, or None (no token: bind to the agent's own address only)::

        server = SnapshotServer(runtime.snapshot_dir, key, ("10.0.0.5", 0))
        server.start()
        server.address          # "10.0.0.5:41235", what the workers are told
        server.close()
    """

    def __init__(self, directory: Path, key: bytes | None, bind: tuple[str, int], advertise: str) -> None:
        self.dir = Path(directory)
        self.key = key
        family = socket.getaddrinfo(bind[0] or advertise, bind[1], type=socket.SOCK_STREAM)[0][0]
        self._listener = socket.create_server(bind, family=family, backlog=128)
        self.address = wire.join_address(advertise, self._listener.getsockname()[1])
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._put_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="elastrun-snapshot-server", daemon=True)
        #: Bytes and seconds served (``get``) and received (``put``), for benchmarks and the report.
        self.stats = {"sent": 0, "received": 0, "refused": 0}

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(5)

    # -- connections --------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            if not self._slots.acquire(timeout=1.0):
                conn.close()  # too many at once: the client retries or reports it
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="elastrun-snapshot-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            wire.tune(conn)
            conn.settimeout(wire.HANDSHAKE_TIMEOUT)
            wire.server_handshake(conn, self.key)
            conn.settimeout(IDLE_TIMEOUT)
            while not self._closed:
                try:
                    req = wire.recv_msg(conn)
                except wire.PeerError:
                    return  # the client closed the connection (or broke it)
                try:
                    op = req.get("op")
                    if op == "get":
                        self._get(conn, req)
                    elif op == "put":
                        # The receiving side of a copy: at the late copies' nice, never at idle priority
                        # (it only works as fast as the sender sends, and a receiver starved at idle
                        # would stall a sender that has been given its share; see replicator.py).
                        set_late()
                        self._put(conn, req)
                    else:
                        raise _Refused(f"unknown request {op!r}")
                except _Refused as e:
                    self.stats["refused"] += 1
                    wire.send_msg(conn, {"error": str(e)})
        except (OSError, ValueError):
            pass  # a failed handshake (told to the client) or a broken connection
        except Exception as e:  # a bug must not take the agent down: the client sees the connection close
            _log.warning(f"snapshot server: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            self._slots.release()

    # -- get -----------------------------------------------------------------------------------
    def _base(self, req: dict[str, Any]) -> tuple[Path, str]:
        where, name = req.get("where"), req.get("name")
        if not wire.valid_where(where) or not wire.valid_name(name):
            raise _Refused(f"no such snapshot file: {where!r}/{name!r}")
        return (self.dir / where if where else self.dir), f"{where + '/' if where else ''}{name}"

    def _get(self, conn: socket.socket, req: dict[str, Any]) -> None:
        base, what = self._base(req)
        name = req["name"]
        meta_path = base / f"{name}.meta"
        if req.get("part") == "meta":
            try:
                raw = meta_path.read_bytes()
            except FileNotFoundError:
                raise _Refused(f"{what} is not here") from None
            wire.send_msg(conn, {"ok": True, "nbytes": len(raw)})
            conn.sendall(raw)
            wire.send_msg(conn, {"ok": True})
            return
        crc, offset, nbytes = req.get("meta_crc"), req.get("offset"), req.get("nbytes")
        if not all(isinstance(v, int) and v >= 0 for v in (crc, offset, nbytes)):
            raise _Refused("a get needs meta_crc, offset and nbytes (integers >= 0)")
        if read_meta_crc(meta_path) != crc:
            raise _Refused(f"{what} is not here any more (removed, or rewritten with another step)")
        try:
            f = open(base / f"{name}.data", "rb")  # noqa: SIM115 - closed below, after sendfile
        except FileNotFoundError:
            raise _Refused(f"{what} has no data file") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if offset + nbytes > size:
                raise _Refused(f"{what} is truncated ({size} bytes, asked for {offset}..{offset + nbytes})")
            if base != self.dir:
                self._check_replica(f, size, base / f"{name}.sum", crc, offset, nbytes, what)
            wire.send_msg(conn, {"ok": True, "nbytes": nbytes})
            if nbytes:
                conn.sendfile(f, offset, nbytes)
        self.stats["sent"] += nbytes
        same = read_meta_crc(meta_path) == crc
        wire.send_msg(conn, {"ok": True} if same else {"error": f"{what} was rewritten while it was being sent"})

    def _check_replica(self, f: Any, size: int, sum_path: Path, crc: int, offset: int, nbytes: int, what: str) -> None:
        sums = Sums.read(sum_path)
        if sums is None or sums.meta_crc != crc or offset + nbytes > sums.nbytes:
            raise _Refused(f"{what}: a replica without valid CRCs is not served")
        if size < sums.nbytes:
            raise _Refused(f"{what} is truncated ({size} of {sums.nbytes} bytes)")
        if not nbytes:
            return
        with mmap.mmap(f.fileno(), sums.nbytes, prot=mmap.PROT_READ) as mm:
            view = memoryview(mm)
            try:
                verify(view, sums, offset, offset + nbytes, what)
            except CorruptReplica as e:
                raise _Refused(str(e)) from None
            finally:
                view.release()

    # -- put -----------------------------------------------------------------------------------
    def _put(self, conn: socket.socket, req: dict[str, Any]) -> None:
        src, kind = req.get("src"), req.get("kind")
        nums = [req.get(k) for k in ("rank", "step", "world_size", "nbytes", "block")]
        if not wire.valid_source(src) or kind not in ("shard", "dcp"):
            raise _Refused("a put needs src (a node name) and kind (shard or dcp)")
        if not all(isinstance(v, int) and v >= 0 for v in nums) or not 0 < nums[4] <= 1 << 30:
            raise _Refused("a put needs rank, step, world_size, nbytes and block (integers)")
        rank, step, world_size, nbytes, block = nums
        try:
            meta = base64.b64decode(req.get("meta", ""), validate=True)
        except ValueError:
            raise _Refused("a put's meta is not base64") from None
        crc = meta_crc(meta)
        if crc is None:
            raise _Refused("a put's meta file is not a whole snapshot meta")
        free = shutil.disk_usage(self.dir).free
        if nbytes + HEADROOM > free:
            raise _Refused(f"no room for a {nbytes}-byte replica in node memory ({free} bytes free)")
        directory = self.dir / REPLICAS / src
        with self._put_lock:  # _retire removes the directories it empties, under this lock
            directory.mkdir(parents=True, exist_ok=True)
            name = self._claim(directory, kind, rank)
            wire.send_msg(conn, {"ok": True})
            crcs = self._receive(conn, directory / f"{name}.data", nbytes, block)
            trailer = wire.recv_msg(conn)
            if trailer.get("ok") is not True:
                raise _Refused(f"the sender gave up: {trailer.get('error') or 'no reason'}")
            if trailer.get("crcs") != crcs:
                raise _Refused(f"replica of {kind} rank {rank} step {step} differs from what was sent: not kept")
            Sums(step, world_size, nbytes, crc, block, crcs).write(directory / f"{name}.sum")
            tmp = directory / f"{name}.meta.tmp"
            tmp.write_bytes(meta)
            os.replace(tmp, directory / f"{name}.meta")
            self.stats["received"] += nbytes
            self._retire(kind, rank)
        wire.send_msg(conn, {"ok": True, "where": f"{REPLICAS}/{src}", "name": name})

    def _claim(self, directory: Path, kind: str, rank: int) -> str:
        """The replica slot to write (the empty or older of two), unpublished first."""
        names = [f"{kind}.r{rank}.{slot}" for slot in range(KEEP_STEPS)]
        steps = []
        for n in names:
            sums = Sums.read(directory / f"{n}.sum")
            published = (directory / f"{n}.meta").exists()
            steps.append(sums.step if sums is not None and published else -1)
        name = names[steps.index(min(steps))]
        for suffix in (".meta", ".sum"):
            (directory / f"{name}{suffix}").unlink(missing_ok=True)
        return name

    @staticmethod
    def _receive(conn: socket.socket, path: Path, nbytes: int, block: int) -> list[int]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != nbytes:
                os.ftruncate(fd, nbytes)
            if not nbytes:
                return []
            with mmap.mmap(fd, nbytes) as mm:
                view = memoryview(mm)
                try:
                    crcs = []
                    for lo in range(0, nbytes, block):
                        part = view[lo : min(lo + block, nbytes)]
                        try:
                            wire.recv_into(conn, part)
                            crcs.append(zlib.crc32(part))
                        finally:
                            part.release()
                    return crcs
                finally:
                    view.release()
        finally:
            os.close(fd)

    def _retire(self, kind: str, rank: int) -> None:
        """Keep the :data:`KEEP_STEPS` newest replicas of ``(kind, rank)`` over every source, and remove
        the directories of sources left with none (emptied here, or by the workers' pruning of older
        world sizes): one per node that ever sent a copy would otherwise pile up over a long job."""
        found = []
        dirs = replica_dirs(self.dir)
        for d in dirs:
            for slot in range(KEEP_STEPS):
                n = f"{kind}.r{rank}.{slot}"
                sums = Sums.read(d / f"{n}.sum")
                if sums is not None and (d / f"{n}.meta").exists():
                    found.append((sums.step, d, n))
        for _, d, n in sorted(found, reverse=True)[KEEP_STEPS:]:
            for suffix in (".meta", ".sum", ".data"):
                (d / f"{n}{suffix}").unlink(missing_ok=True)
        for d in dirs:
            try:
                d.rmdir()  # only when empty; puts make theirs under the same lock
            except OSError:
                pass


class SnapshotService(NodeService):
    """The snapshot server and the replicator of one agent, as a node service.

    ``token``: the job token (None: none); ``addr``: the agent's own address (what other nodes
    reach it by).  A server that cannot start is a warning: the workers then move state over their
    process group, as without it.
    """

    def __init__(self, runtime: NodeRuntime, addr: str, token: bytes | None, run_id: str, source: str,
                 warn: Callable[[str], None]) -> None:  # fmt: skip
        self.key = snapshot_key(token, run_id) if token is not None else None
        self.server: SnapshotServer | None = None
        self.key_file: Path | None = None
        try:
            bind = ("", 0) if self.key is not None else (addr, 0)
            self.server = SnapshotServer(runtime.snapshot_dir, self.key, bind, addr)
        except OSError as e:
            warn(f"snapshot server not started on {addr} ({e}): state moves over the process group instead")
            return
        if self.key is not None:
            self.key_file = runtime.dir / "snapshot.key"
            fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.key.hex())
        self.server.start()
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in source)[:200] or "node"
        self.replicator = Replicator(runtime.snapshot_dir, self.key, safe, warn)
        self.replicator.start()

    @property
    def address(self) -> str | None:
        return self.server.address if self.server is not None else None

    def worker_env(self) -> dict[str, str]:
        if self.server is None:
            return {}
        env = {SNAPSHOT_SERVER_ENV: self.server.address}
        if self.key_file is not None:
            env[SNAPSHOT_KEY_ENV] = str(self.key_file)
        return env

    def close(self) -> None:
        if self.server is None:
            return
        self.replicator.close()
        self.server.close()
