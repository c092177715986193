"""Reading a sharded state back from shard snapshots at any world size, with DCP's planner.

The meta files of old ranks ``0..W-1`` at one step together describe a DCP checkpoint: every
tensor's global size and the chunks each old rank holds (:func:`dcp_metadata`).  DCP's
``DefaultLoadPlanner`` then computes, for the destination state of *this* rank (its new shards,
on the new mesh), which byte ranges of which old chunks overlap it: the resharding is DCP's.
:class:`SnapshotReader` is the ``StorageReader`` that executes those reads: ranges in this node's
memory are copied straight from the mapped files, the others are fetched from peers by a
:class:`~elastrun.train.sharded.fetch.PeerTransport` (once per restore, collective).  No rank ever
holds more than the bytes overlapping its own new shards (plus, for a chunk split along another
dimension than the first, the rows around them).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from elastrun.train import dist as edist
from elastrun.train import snapclient
from elastrun.train.blob import as_bytes
from elastrun.train.sharded import slots
from elastrun.train.sharded.fetch import (
    FileRef,
    GroupTransport,
    LocalFile,
    PeerTransport,
    Resolver,
    ServerTransport,
    Want,
)
from elastrun.train.sharded.layout import Entry

BYTES = "bytes"  # the dtype of an entry that holds a pickled (torch.save'd) non-tensor value


@dataclass(frozen=True)
class Location:
    """Where a stored chunk lives: old rank ``ref.rank``'s file of ``ref.step``, at ``offset``."""

    ref: FileRef
    offset: int
    nbytes: int
    dtype: str
    chunk: tuple[int, ...]


def entries_of(header: dict[str, Any]) -> list[Entry]:
    return [Entry(*e) for e in header["entries"]]


def dcp_metadata(
    headers: dict[int, dict[str, Any]], choose: Callable[[str, list[int]], int]
) -> tuple[Metadata, dict[MetadataIndex, Location]]:
    """DCP metadata of one step from its old ranks' meta headers, and where each chunk is.

    A chunk held by several old ranks (a plain tensor every rank holds, a replicated DTensor
    dimension) is read from the one ``choose(key, ranks)`` picks.
    """
    holders: dict[tuple[str, tuple[int, ...]], list[tuple[int, Entry]]] = {}
    for rank in sorted(headers):
        step = headers[rank]["step"]
        for e in entries_of(headers[rank]):
            holders.setdefault((e.key, e.offsets), []).append((rank, e))
    md: dict[str, Any] = {}
    where: dict[MetadataIndex, Location] = {}
    for (key, offsets), found in holders.items():
        ranks = [r for r, _ in found]
        rank = choose(key, ranks)
        e = next(e for r, e in found if r == rank)
        loc = Location(FileRef(rank, step), e.offset, e.nbytes, e.dtype, e.chunk)
        if e.dtype == BYTES:
            md[key] = BytesStorageMetadata()
            where[MetadataIndex(key)] = loc
            continue
        meta = md.get(key)
        if meta is None:
            props = TensorProperties(dtype=getattr(torch, e.dtype))
            meta = md[key] = TensorStorageMetadata(props, torch.Size(e.size), [])
        meta.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(e.chunk)))
        where[MetadataIndex(key, offsets)] = loc
    for key, meta in md.items():  # every element in exactly one chunk, or the metas disagree
        if isinstance(meta, TensorStorageMetadata):
            volume = sum(int(torch.Size(c.sizes).numel()) for c in meta.chunks)
            if volume != int(meta.size.numel()):
                raise ValueError(f"the snapshots' chunks of {key} cover {volume} of its {meta.size.numel()} elements")
    return Metadata(state_dict_metadata=md), where


def _region(loc: Location, item: ReadItem) -> tuple[int, int, bool]:
    """``(byte offset, nbytes, exact)`` of the part of a stored chunk that ``item`` reads: exact
    when it is one contiguous run (a range of the first dimension), else the whole chunk."""
    chunk = loc.chunk
    if not chunk:
        return loc.offset, loc.nbytes, True
    lead = list(item.storage_offsets)
    lengths = list(item.lengths)
    if all(lead[d] == 0 and lengths[d] == chunk[d] for d in range(1, len(chunk))):
        row = loc.nbytes // chunk[0] if chunk[0] else 0
        return loc.offset + lead[0] * row, lengths[0] * row, True
    return loc.offset, loc.nbytes, False


def _typed(raw: torch.Tensor, loc: Location, item: ReadItem, exact: bool) -> torch.Tensor:
    dtype = getattr(torch, loc.dtype)
    if exact:
        return raw.view(dtype).reshape(tuple(item.lengths))
    t = raw.view(dtype).reshape(loc.chunk)
    for d, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        t = t.narrow(d, start, length)
    return t


def read_items(
    plan: LoadPlan,
    planner: LoadPlanner,
    where: dict[MetadataIndex, Location],
    resolver: Resolver,
    transport: PeerTransport,
    failed: set[tuple[int, FileRef]],
) -> set[FileRef]:
    """Copy every item of ``plan`` into the planner's tensors; returns the files fetched from peers.

    Collective through ``transport`` (called once, also when nothing is fetched).  A local read
    that fails still lets the exchange complete before its error is raised; the files that failed
    here are added to ``failed`` as ``(this rank, file)``.
    """
    wants: list[Want] = []
    pending: list[tuple[ReadItem, Location, torch.Tensor, bool, torch.Tensor | None]] = []
    onto_device: dict[Path, list[tuple[ReadItem, torch.Tensor, int, int]]] = {}  # own files -> GPU targets
    error: BaseException | None = None
    for item in plan.items:
        loc = where[item.storage_index]
        try:
            source = resolver.source(loc.ref)
            if item.type == LoadItemType.BYTE_IO:
                start, nbytes, exact = loc.offset, loc.nbytes, True
            else:
                start, nbytes, exact = _region(loc, item)
            target = None if item.type == LoadItemType.BYTE_IO else planner.resolve_tensor(item).detach()
            direct = (
                target is not None and exact and target.is_contiguous() and target.dtype == getattr(torch, loc.dtype)
                and target.numel() * target.element_size() == nbytes
            )  # fmt: skip
            if isinstance(source, LocalFile):
                if direct and target is not None and target.device.type == "cuda" and source.sums is None:
                    onto_device.setdefault(source.path, []).append((item, target, start, nbytes))
                else:
                    _land(planner, item, loc, source.view(start, nbytes), exact)
                continue
            into = target.reshape(-1).view(torch.uint8) if direct else torch.empty(nbytes, dtype=torch.uint8)
            wants.append(Want(source, loc.ref, start, nbytes, into))
            pending.append((item, loc, into, exact, target if direct else None))
        except (OSError, ValueError, KeyError) as e:
            failed.add((resolver.me, loc.ref))
            error = error or e
    if onto_device:  # this node's own files onto the GPU through page-locked buffers (``gpu/load.py``)
        from elastrun.train.gpu import load

        for path, items in onto_device.items():
            try:
                load.load([load.Piece(as_bytes(t), start, n) for _, t, start, n in items], path)
            except OSError as e:  # raised after the exchange below, which the other ranks wait in
                failed.add((resolver.me, where[items[0][0].storage_index].ref))
                error = error or e
                continue
            for item, t, _, _ in items:
                planner.commit_tensor(item, t)
    transport.fetch(wants, resolver.serve)
    if error is not None:
        raise error
    for item, loc, into, exact, landed in pending:
        if landed is not None:
            planner.commit_tensor(item, landed)
        else:
            _land(planner, item, loc, into, exact)
    return {w.ref for w in wants}


def _land(planner: LoadPlanner, item: ReadItem, loc: Location, raw: torch.Tensor, exact: bool) -> None:
    if item.type == LoadItemType.BYTE_IO:
        data = bytearray(raw.numel())
        if data:
            torch.frombuffer(data, dtype=torch.uint8).copy_(raw)
        planner.load_bytes(item, io.BytesIO(data))
        return
    target = planner.resolve_tensor(item).detach()
    target.copy_(_typed(raw, loc, item, exact))
    planner.commit_tensor(item, target)


class SnapshotReader(StorageReader):
    """A DCP ``StorageReader`` over the shard snapshots of one step (local memory, then peers).

    Built by the restore (``State``) or by :class:`~elastrun.train.sharded.storage.MemoryReader`
    with the metadata, the chunk locations and the resolver already agreed by all ranks::

        reader = SnapshotReader(metadata, where, resolver, GroupTransport())
        dcp.load(state_dict, storage_reader=reader)
    """

    def __init__(
        self, metadata: Metadata, where: dict[MetadataIndex, Location], resolver: Resolver, transport: PeerTransport
    ) -> None:
        super().__init__()
        self.metadata = metadata
        self.where = where
        self.resolver = resolver
        self.transport = transport
        #: Files this rank fetched from peers in the last read (empty: all from its node's memory).
        self.fetched: set[FileRef] = set()
        #: ``(holder rank, file)``: copies that could not be read (here, by a peer from this node, or
        #: from a peer's node).
        self.failed: set[tuple[int, FileRef]] = set()
        #: Old rank -> where this rank read that rank's file from (``Resolver.describe``).
        self.sources: dict[int, str] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.fetched = set()
        self.failed = set()
        self.sources = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        refs = {self.where[item.storage_index].ref for item in plan.items}
        try:
            self.fetched = read_items(plan, planner, self.where, self.resolver, self.transport, self.failed)
            self.sources = {ref.rank: self.resolver.describe(ref) for ref in sorted(refs)}
        finally:
            self.failed |= self.transport.failed
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


def open_step(
    directory: os.PathLike, run_id: str, kind: str, node: str, step: int, world_size: int,
    holders: dict[int, list[int]],
) -> tuple[SnapshotReader | None, dict[int, dict[str, Any]], set[tuple]]:
    """The reader of one step's shard snapshots, agreed by every rank (collective).

    ``holders`` (the same on every rank) names, for each old rank whose file is read, the new ranks
    whose node holds it (its own file or a replica); the lowest of them tells the others the file's
    header.  Old ranks absent from ``holders`` have twins among the others (HSDP: the same chunks).
    Returns the reader and the headers, or ``(None, {}, failed)`` with ``("mem", node, step, old
    rank)`` for every file a holder could not read after all (every rank gets the same answer).
    The ranges held by other nodes come from their snapshot servers when every rank has one,
    else over the process group.
    """  # fmt: skip
    me = dist.get_rank() if edist.active() else 0
    mine = {f.rank: f for f in slots.scan_node(Path(directory), run_id, kind)
            if f.step == step and f.world_size == world_size}  # fmt: skip
    provided, missing = {}, set()
    for old, hs in holders.items():
        if hs[0] == me:
            if old in mine:
                provided[old] = mine[old].header
            else:
                missing.add(("mem", node, step, old))
    ids = {old: (f.where, f.name, f.meta_crc) for old, f in mine.items()}
    headers: dict[int, dict[str, Any]] = {}
    servers: dict[int, str | None] = {}
    files: dict[tuple[int, FileRef], tuple[str, str, int]] = {}
    for rank, (part, gone, their_ids, server) in enumerate(edist.all_gather((provided, missing, ids,
                                                                             snapclient.my_server()))):
        headers.update(part)
        missing |= gone
        servers[rank] = server
        files.update({(rank, FileRef(old, step)): i for old, i in their_ids.items()})
    if missing:
        return None, {}, missing
    local = {FileRef(old, step): LocalFile(f.data, f.header["nbytes"], f.sums) for old, f in mine.items()}
    replicas = {key for key, (where, _, _) in files.items() if where}
    resolver = Resolver(local, {FileRef(old, step): hs for old, hs in holders.items()}, me, replicas)

    def choose(key: str, ranks: list[int]) -> int:  # its own old rank, else a local copy, else the lowest
        if me in ranks:
            return me
        here = [r for r in ranks if FileRef(r, step) in local]
        return min(here or ranks)

    metadata, where = dcp_metadata(headers, choose)
    transport: PeerTransport
    if all(servers.values()):
        transport = ServerTransport({r: s for r, s in servers.items() if s}, files, snapclient.job_key())
    else:
        transport = GroupTransport()
    return SnapshotReader(metadata, where, resolver, transport), headers, set()
