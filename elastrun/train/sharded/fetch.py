"""Where a rank reads an old rank's shard snapshot from: its node's memory, else a peer's.

:class:`Resolver` answers, for this rank, "old rank ``r``'s snapshot file of step ``s``": a
:class:`LocalFile` when this node's snapshot directory holds it, else the peers that hold it.
Byte ranges of files held by peers are moved by a :class:`PeerTransport`.  The disk is not a
per-file source: when some shard of a step is in no node's memory, the whole restore reads the
step's DCP checkpoint instead (``plan.py``).

This wave's transport, :class:`GroupTransport`, moves the ranges over the job's own process group
(point-to-point sends between the rank whose node holds a file and the rank that needs part of
it).  The next one fetches them from the agents' snapshot servers; it implements the same
:meth:`PeerTransport.fetch`, with ``Want.holder`` naming the node that serves the file.
"""

from __future__ import annotations

import abc
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from elastrun.train import dist as edist


@dataclass(frozen=True, order=True)
class FileRef:
    """Old rank ``rank``'s shard snapshot of ``step``."""

    rank: int
    step: int


class LocalFile:
    """A snapshot data file in this node's memory, mapped copy-on-write (the file is never changed;
    only the pages read are touched)."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes
        self._bytes: torch.Tensor | None = None

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
        return self._bytes[offset : offset + nbytes]


@dataclass
class Want:
    """A byte range of a file held by a peer, and where it must land (a contiguous ``uint8`` tensor)."""

    holder: int  # the peer that serves it (GroupTransport: a rank of the new group)
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

    #: Files of this node that this rank failed to serve to a peer during the last fetch.
    failed: set[FileRef]

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
                    self.failed.add(FileRef(rank, step))
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


class Resolver:
    """For this rank: which old ranks' files of one step are in its node's memory, and which peers
    hold the others."""

    def __init__(self, local: dict[FileRef, LocalFile], holders: dict[FileRef, list[int]], me: int) -> None:
        self.local = local
        self.holders = holders
        self.me = me

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
