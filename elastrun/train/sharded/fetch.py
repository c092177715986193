"""Where a rank reads an old rank's shard snapshot from: its node's memory, else a peer's.

:class:`Resolver` answers, for this rank, "old rank ``r``'s snapshot file of step ``s``": a
:class:`LocalFile` when this node's snapshot directory holds it, else the peers that hold it.
Byte ranges of files held by peers are moved by a :class:`PeerTransport`.  The disk is not a
per-file source: when some shard of a step is in no node's memory, the whole restore reads the
step's DCP checkpoint instead (``shard_plan.py``).

Under elastrun the ranges come from the holder's node's snapshot server (:class:`ServerTransport`:
``elastrun/agent/snapserver.py``, straight from that node's memory into the destination tensor, at
wire speed).  Without servers (another launcher) :class:`GroupTransport` moves them over the job's
own process group (point-to-point sends between the rank whose node holds a file and the rank that
needs part of it).

A file may be a replica (a copy the agents made of another node's file, with block CRCs): every
read of one checks the CRCs of the blocks it touches, here (:class:`LocalFile`) or in the server.
"""

from __future__ import annotations

import abc
import mmap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from elastrun.shared.replicas import Sums, verify
from elastrun.train import dist as edist
from elastrun.train.gpu.load import Piece, load
from elastrun.train.snapclient import STREAMS, Get, fetch, writable


@dataclass(frozen=True, order=True)
class FileRef:
    """Old rank ``rank``'s shard snapshot of ``step``."""

    rank: int
    step: int


class LocalFile:
    """A snapshot data file in this node's memory, mapped copy-on-write (the file is never changed;
    only the pages read are touched).  With ``sums`` it is a replica: each block is checked against
    its CRC the first time a read touches it (:class:`~elastrun.shared.replicas.CorruptReplica`)."""

    def __init__(self, path: Path, nbytes: int, sums: Sums | None = None) -> None:
        self.path = path
        self.nbytes = nbytes
        self.sums = sums
        self._bytes: torch.Tensor | None = None
        self._checked: set[int] = set()

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes from ``offset`` as a ``uint8`` tensor (no copy)."""
        if self._bytes is None:
            if self.nbytes == 0:
                self._bytes = torch.empty(0, dtype=torch.uint8)
            else:
                with open(self.path, "rb") as f:
                    if f.seek(0, 2) < self.nbytes:
                        raise ValueError(f"{self.path} is shorter than its meta says (truncated)")
                    mm = mmap.mmap(f.fileno(), self.nbytes, access=mmap.ACCESS_COPY)
                self._bytes = torch.frombuffer(mm, dtype=torch.uint8)
        if offset + nbytes > self.nbytes:
            raise ValueError(f"{self.path}: bytes {offset}..{offset + nbytes} are past its end ({self.nbytes})")
        if self.sums is not None and nbytes:
            self._check(offset, offset + nbytes)
        return self._bytes[offset : offset + nbytes]

    def _check(self, start: int, end: int) -> None:
        block = self.sums.block  # type: ignore[union-attr]
        todo = [b for b in range(start // block, (end - 1) // block + 1) if b not in self._checked]
        if not todo:
            return
        assert self._bytes is not None
        data = writable(self._bytes)
        try:
            for b in todo:
                verify(data, self.sums, b * block, min((b + 1) * block, self.nbytes), str(self.path))  # type: ignore[arg-type]
                self._checked.add(b)
        finally:
            data.release()


@dataclass
class Want:
    """A byte range of a file held by a peer, and where it must land (a contiguous ``uint8`` tensor)."""

    holder: int  # a rank of the new group whose node holds the file
    ref: FileRef
    offset: int
    nbytes: int
    into: torch.Tensor


class PeerTransport(abc.ABC):
    """Moves byte ranges of snapshot files held in other nodes' memory.

    A restore calls :meth:`fetch` exactly once on every rank of the new group, with an empty list
    where a rank needs nothing, so a transport may be collective::

        transport.fetch([Want(holder=2, ref=FileRef(3, 120), offset=0, nbytes=n, into=buf)], serve)

    ``serve(ref)`` is this rank's own :class:`LocalFile` for a file it holds (or None), for
    transports where ranks answer each other.
    """

    #: ``(holder rank, file)`` pairs that could not be read during the last fetch: the holder's
    #: node's copy of that file is excluded from the next plan.
    failed: set[tuple[int, FileRef]]

    def __init__(self) -> None:
        self.failed = set()

    @abc.abstractmethod
    def fetch(self, wants: list[Want], serve: Callable[[FileRef], LocalFile | None]) -> None:
        """Fill every ``want.into``; raise if any range could not be had."""


class GroupTransport(PeerTransport):
    """Point-to-point over the default process group: each rank sends what others asked of it.

    One ``all_gather`` of the requests (small), then one batch of ``isend``/``irecv`` pairs, each
    range sent straight from the holder's memory mapping (gloo) or staged through the current GPU
    (NCCL).  Collective: every rank must call :meth:`fetch`.
    """

    def fetch(self, wants: list[Want], serve: Callable[[FileRef], LocalFile | None]) -> None:
        me = dist.get_rank() if edist.active() else 0
        asks = edist.all_gather([(w.holder, w.ref.rank, w.ref.step, w.offset, w.nbytes) for w in wants])
        dev = edist.comm_device()
        ops: list[dist.P2POp] = []
        landing: list[tuple[torch.Tensor, torch.Tensor]] = []
        keep: list[torch.Tensor] = []
        missing = []
        for requester, their in enumerate(asks):
            for i, (holder, rank, step, offset, nbytes) in enumerate(their):
                if holder != me or requester == me or not nbytes:
                    continue
                source = serve(FileRef(rank, step))
                try:
                    if source is None:
                        raise FileNotFoundError(f"rank {rank}'s snapshot of step {step} is not here")
                    data = source.view(offset, nbytes)
                except (OSError, ValueError):
                    missing.append((rank, step))
                    self.failed.add((me, FileRef(rank, step)))
                    data = torch.zeros(nbytes, dtype=torch.uint8)  # the receiver must not wait; flagged below
                data = data if dev.type == "cpu" else data.to(dev)
                keep.append(data)
                ops.append(dist.P2POp(dist.isend, data, requester, tag=i))
        for i, w in enumerate(wants):
            if not w.nbytes:
                continue
            if w.holder == me:
                raise AssertionError("a rank asked itself for a file it holds locally")
            buf = w.into if w.into.device == dev else torch.empty(w.nbytes, dtype=torch.uint8, device=dev)
            if buf is not w.into:
                landing.append((buf, w.into))
            ops.append(dist.P2POp(dist.irecv, buf, w.holder, tag=i))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for buf, into in landing:
            into.copy_(buf)
        failed = edist.all_gather(missing)
        bad = sorted({m for part in failed for m in part})
        if bad:
            raise FileNotFoundError(f"peer snapshot files unreadable during the restore (rank, step): {bad}")


class ServerTransport(PeerTransport):
    """From the snapshot servers of the holders' nodes (``elastrun/agent/snapserver.py``): one
    connection per server, requests pipelined, each range received straight into its destination
    (a CPU tensor; a GPU destination into one host buffer for all of them, which then goes onto the
    GPU through the page-locked lanes of ``elastrun/train/gpu/load.py``: no page-locking of a fresh
    buffer per range, copies at the card's speed).  Not collective: a rank that needs nothing sends
    nothing.

    ``servers``: rank -> its node's server address; ``files``: ``(holder rank, file)`` -> where the
    file is on that node (``""`` or ``replicas/<source>``), its slot name and its meta's CRC.
    """

    def __init__(self, servers: dict[int, str], files: dict[tuple[int, FileRef], tuple[str, str, int]],
                 key: bytes | None) -> None:  # fmt: skip
        super().__init__()
        self.servers = servers
        self.files = files
        self.key = key
        #: Bytes received and seconds spent in the last fetch (the peer transfer rate).
        self.received = 0
        self.seconds = 0.0

    def fetch(self, wants: list[Want], serve: Callable[[FileRef], LocalFile | None]) -> None:
        began = time.perf_counter()
        by_server: dict[str, list[Want]] = {}
        for w in wants:
            if w.nbytes:
                by_server.setdefault(self.servers[w.holder], []).append(w)
        # Ranges bound for a GPU land in one host buffer first; onto the GPU at the end, all at once.
        staged: dict[int, torch.Tensor] = {}
        pieces: list[Piece] = []
        on_gpu = [w for w in wants if w.nbytes and w.into.device.type != "cpu"]
        host = torch.empty(sum(w.nbytes for w in on_gpu), dtype=torch.uint8)
        at = 0
        for w in on_gpu:
            staged[id(w)] = host[at : at + w.nbytes]
            pieces.append(Piece(w.into, at, w.nbytes))
            at += w.nbytes
        errors: list[str] = []
        streams = max(1, STREAMS // max(1, len(by_server)))
        threads = [threading.Thread(target=self._from, args=(addr, ws, errors, streams, staged), daemon=True)
                   for addr, ws in by_server.items()]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise FileNotFoundError(f"peer snapshot ranges unreadable during the restore: {errors[0]}")
        load(pieces, host)  # one caller at a time: the lanes' buffers are the process's
        self.seconds = time.perf_counter() - began
        self.received = sum(w.nbytes for w in wants)

    def _from(self, address: str, wants: list[Want], errors: list[str], streams: int,
              staged: dict[int, torch.Tensor]) -> None:  # fmt: skip
        gets = []
        for w in wants:
            where, name, crc = self.files[(w.holder, w.ref)]
            gets.append(Get(where, name, crc, w.offset, w.nbytes, writable(staged.get(id(w), w.into))))
        results = fetch(address, self.key, gets, streams)
        for w, error in zip(wants, results, strict=True):
            if error is not None:
                self.failed.add((w.holder, w.ref))
                errors.append(error)


class Resolver:
    """For this rank: which old ranks' files of one step are in its node's memory, and which peers
    hold the others."""

    def __init__(self, local: dict[FileRef, LocalFile], holders: dict[FileRef, list[int]], me: int,
                 replicas: set[tuple[int, FileRef]] | None = None) -> None:  # fmt: skip
        self.local = local
        self.holders = holders
        self.me = me
        #: ``(holder rank, file)`` where the holder's node has the file as a replica.
        self.replicas = replicas or set()

    def source(self, ref: FileRef) -> LocalFile | int:
        """The local file, or the rank to ask (spread over the holders by this rank's number)."""
        if ref in self.local:
            return self.local[ref]
        holders = self.holders.get(ref)
        if not holders:
            raise FileNotFoundError(f"no node of the new group holds rank {ref.rank}'s snapshot of step {ref.step}")
        return holders[(self.me + ref.rank) % len(holders)]

    def serve(self, ref: FileRef) -> LocalFile | None:
        return self.local.get(ref)

    def describe(self, ref: FileRef) -> str:
        """Where this rank reads ``ref`` from: ``memory`` (its node's own file), ``replica`` (its
        node's copy of another node's file), ``peer`` / ``peer replica`` (another node's)."""
        source = self.source(ref)
        if isinstance(source, LocalFile):
            return "replica" if source.sums is not None else "memory"
        return "peer replica" if (source, ref) in self.replicas else "peer"
