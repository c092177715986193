"""Node memory as DCP storage, for scripts that call ``dcp.save`` / ``dcp.load`` themselves.

A script in torchtitan's shape keeps its checkpointing code and changes where it goes::

    dcp.save(state_dict, storage_writer=et.MemoryWriter(step))            # was: checkpoint_id=path
    dcp.load(state_dict, storage_reader=et.MemoryReader(fallback=path))   # newest step in memory, else disk

:class:`MemoryWriter` writes each rank's chunks into its node's snapshot directory (the files of
``slots.py``, kind ``dcp``: a data file and a meta file per rank and slot, the same format as
``State``'s snapshots).  :class:`MemoryReader` finds the newest step whose every rank's file is in
the memory of some node of the current group, and reads it at the current world size with DCP's
planner: own node first, then peers (``fetch.py``).  Without such a step it reads ``fallback`` (a
DCP checkpoint directory) with DCP's file system reader, or raises ``FileNotFoundError``.

Both are collective where DCP's calls are: every rank of the group must call ``dcp.save`` or
``dcp.load`` with them, as DCP requires anyway.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from elastrun.train import dist as edist
from elastrun.train.blob import Entry as BlobEntry
from elastrun.train.blob import Flattened, copy_into
from elastrun.train.sharded import slots
from elastrun.train.sharded.layout import ALIGN, Entry
from elastrun.train.sharded.reader import BYTES, SnapshotReader, open_step
from elastrun.train.sharded.shard_plan import ShardReport, memory_steps
from elastrun.train.snapdir import snapshot_dir as _snapshot_dir

KIND = "dcp"


def _where(snapshot_dir: str | os.PathLike | None) -> tuple[Path, str]:
    directory, _ = _snapshot_dir(snapshot_dir)
    return directory, os.environ.get("TORCHELASTIC_RUN_ID", "local")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _step_of(checkpoint_id: Any) -> int | None:
    if checkpoint_id is None:
        return None
    name = os.fspath(checkpoint_id) if not isinstance(checkpoint_id, int) else str(checkpoint_id)
    if not name.isdigit():
        raise ValueError(f"a memory checkpoint id is a step number, got {checkpoint_id!r}")
    return int(name)


class MemoryWriter(StorageWriter):
    """``dcp.save`` into node memory: each rank copies its own chunks into its slot (synchronously).

    ``step`` orders the checkpoints (``checkpoint_id=`` may give it instead); ``snapshot_dir``
    defaults to the agent's ``ELASTRUN_SNAPSHOT_DIR``.
    """

    def __init__(self, step: int | None = None, snapshot_dir: str | os.PathLike | None = None) -> None:
        super().__init__()
        self.step = step
        self.dir, self.run_id = _where(snapshot_dir)
        self._slots: slots.ShardSlots | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        step = _step_of(checkpoint_id)
        if step is not None:
            self.step = step

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.step is None:
            raise ValueError("MemoryWriter needs a step: MemoryWriter(step) or dcp.save(..., checkpoint_id=step)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank = _rank()
        entries, values, offset = [], [], 0
        for item in plan.items:
            value = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = value.getvalue()
                data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                e = Entry(item.index.fqn, BYTES, (), (), (), offset, len(raw), None, "cpu")
            else:
                td = item.tensor_data
                data = value.detach()
                e = Entry(item.index.fqn, str(data.dtype).removeprefix("torch."), tuple(td.size),
                          tuple(td.chunk.offsets), tuple(td.chunk.sizes), offset,
                          data.numel() * data.element_size(), None, data.device.type)  # fmt: skip
            entries.append(e)
            values.append(data)
            offset += (e.nbytes + ALIGN - 1) // ALIGN * ALIGN
        if self._slots is None or self._slots.rank != rank:
            self._slots = slots.ShardSlots(self.dir, self.run_id, rank, KIND)
        slot, buf, view = self._slots.begin(offset)
        copy_into(Flattened(None, values, [BlobEntry(e.dtype if e.dtype != BYTES else "uint8", e.chunk or (e.nbytes,),
                                                     e.offset, e.nbytes) for e in entries], offset), buf)  # fmt: skip
        del buf
        view.release()
        header = {"format": "elastrun-dcp/1", "step": self.step, "world_size": _world(), "rank": rank,
                  "nbytes": offset, "entries": [dataclasses.astuple(e) for e in entries]}  # fmt: skip
        self._slots.publish(slot, header)
        results = [WriteResult(i.index, e.nbytes, (rank, e.offset)) for i, e in zip(plan.items, entries, strict=True)]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass  # each rank's meta file is its own commit record

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


class MemoryReader(StorageReader):
    """``dcp.load`` from node memory at any world size: the newest step (or ``step``) whose every
    rank's file some node of the group holds, else the DCP checkpoint at ``fallback``."""

    def __init__(
        self,
        step: int | None = None,
        fallback: str | os.PathLike | None = None,
        snapshot_dir: str | os.PathLike | None = None,
    ) -> None:
        super().__init__()
        self.step = step
        self.fallback = fallback
        self.dir, self.run_id = _where(snapshot_dir)
        st = os.stat(self.dir) if self.dir.exists() else None
        self.node = f"{socket.gethostname()}:{st.st_dev}:{st.st_ino}" if st else socket.gethostname()
        self._inner: StorageReader | None = None
        self._metadata: Metadata | BaseException | None = None
        #: Where the last load came from: "memory", "peer" (some bytes from another node) or "disk".
        self.source: str | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        step = _step_of(checkpoint_id)
        if step is not None:
            self.step = step
        self._inner, self._metadata, self.source = None, None, None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:  # DCP may call this twice; the collective part runs once
            try:
                self._metadata = self._agree()
            except (OSError, ValueError) as e:
                self._metadata = e
        if isinstance(self._metadata, BaseException):
            raise self._metadata
        return self._metadata

    def _agree(self) -> Metadata:
        shards: dict[tuple[int, int], list[int]] = {}
        for f in slots.scan(self.dir, self.run_id, KIND):
            shards.setdefault((f.step, f.world_size), []).append(f.rank)
        report = ShardReport(_rank(), self.node, {k: sorted(set(v)) for k, v in shards.items()})
        reports = edist.all_gather(report)
        excluded: set[tuple] = set()
        for _ in range(4 * sum(len(r.shards) for r in reports) + 2):
            complete = memory_steps(reports, excluded)
            steps = [s for s in complete if self.step is None or s == self.step]
            if not steps:
                break
            step = max(steps)
            ws, holders = complete[step]
            reader, _, missing = open_step(self.dir, self.run_id, KIND, self.node, step, ws, holders)
            if reader is None:
                excluded |= missing
                continue
            self._inner = reader
            return reader.metadata
        if self.fallback is None:
            wanted = f"step {self.step}" if self.step is not None else "any step"
            raise FileNotFoundError(f"no node of this group holds a complete in-memory checkpoint of {wanted}")
        self._inner = FileSystemReader(self.fallback)
        self.source = "disk"
        return self._inner.read_metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        assert self._inner is not None
        self._inner.set_up_storage_reader(metadata, is_coordinator)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        assert self._inner is not None
        return self._inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        assert self._inner is not None
        return self._inner.prepare_global_plan(plans)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._inner is not None
        fut = self._inner.read_data(plan, planner)
        if isinstance(self._inner, SnapshotReader):
            self.source = "peer" if self._inner.fetched else "memory"
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False
