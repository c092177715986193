"""Durable checkpoints of sharded states: DCP checkpoints, written from the memory snapshots.

``<checkpoint_dir>/step-<step>/`` is a checkpoint that plain ``torch.distributed.checkpoint.load``
reads, at any world size, outside elastrun::

    sd = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id="ckpt/step-000000000100")

It holds DCP's files (``.metadata``, ``__<rank>_0.distcp``: each item ``torch.save``'d, as DCP's
own file system writer does) and elastrun's beside them: ``elastrun-state.pkl`` (the non-tensor
state: step, sampler, extras, optimizer hyper-parameters), ``rng.r<rank>.pkl`` and
``manifest.json`` (the size and CRC32 of every file).

No collective: a checkpoint is written in the background while training goes on.  Each rank
writes its own data file from its pinned memory slot and its part of the metadata
(``rank<r>.elastrun-part``); rank 0 waits (bounded) for every part and every RNG file, merges the
parts into ``.metadata``, then writes the manifest last.  A step directory without a manifest is
never used.  Plain tensors and non-tensor values, which every rank holds, are written by rank 0
only; a DTensor chunk held by several ranks (a replicated mesh dimension) is kept once.
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItemType

from elastrun.train import notes
from elastrun.train.checkpoint import MANIFEST, CheckpointCorrupt, CheckpointDir, DiskCandidate, rng_name
from elastrun.train.fileio import atomic_write, file_crc32, fsync_dir, tmp_path_for
from elastrun.train.sharded.layout import Entry, join

METADATA = ".metadata"
STATE = "elastrun-state.pkl"
KIND = "dcp"


def data_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def part_name(rank: int) -> str:
    return f"rank{rank}.elastrun-part"


def _storage_info(name: str, offset: int, length: int) -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # the record DCP's file reader expects

    return _StorageInfo(name, offset, length)


class _Sink:
    """A write-only file that counts its bytes and their CRC32 (what ``torch.save`` writes into)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.size = 0
        self.crc = 0

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.f.write(view)
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self.f.flush()


def _tensors(header: dict[str, Any], data: memoryview) -> dict[str, torch.Tensor]:
    """The snapshot's tensors over the slot's bytes, each its own storage (nothing is copied, and
    ``torch.save`` writes only that range)."""
    out: dict[str, torch.Tensor] = {}
    for e in (Entry(*t) for t in header["entries"]):
        dtype = getattr(torch, e.dtype)
        if e.nbytes:
            out[e.key] = torch.frombuffer(data[e.offset : e.offset + e.nbytes], dtype=dtype).reshape(e.chunk)
        else:
            out[e.key] = torch.empty(e.chunk, dtype=dtype)
    return out


def write_part(ckpt: CheckpointDir, header: dict[str, Any], data: memoryview) -> None:
    """This rank's DCP data file and its part of the metadata (background thread, no collective).

    DCP's save planner flattens the tree (its keys, its non-tensor values); the tensors' chunk
    metadata comes from the snapshot's entries (the global size and where this rank's chunk sits),
    so no DTensor is needed here.  Plain tensors and non-tensor values are written by rank 0 only.
    """
    step, rank = header["step"], header["rank"]
    d = ckpt.step_dir(step)
    d.mkdir(parents=True, exist_ok=True)
    entries = {e.key: e for e in (Entry(*t) for t in header["entries"])}
    planner = DefaultSavePlanner()
    tree = join(pickle.loads(header["skeleton"]), _tensors(header, data))
    if "storage_meta" in inspect.signature(planner.set_up_planner).parameters:
        planner.set_up_planner(tree, storage_meta=None, is_coordinator=rank == 0)
    else:  # torch < 2.4
        planner.set_up_planner(tree, rank == 0)  # type: ignore[call-arg]
    md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    name = data_name(rank)
    path = d / name
    tmp = tmp_path_for(path)
    try:
        with open(tmp, "wb") as f:
            sink = _Sink(f)
            for item in planner.create_local_plan().items:
                e = entries.get(item.index.fqn)
                if item.type == WriteItemType.BYTE_IO or e is None:  # a value, or tensors inside one
                    if rank != 0:
                        continue
                    start = sink.size
                    value = planner.resolve_data(item)
                    if isinstance(value, torch.Tensor):
                        torch.save(value, sink)
                        td = item.tensor_data
                        md.setdefault(item.index.fqn, TensorStorageMetadata(td.properties, td.size, [td.chunk]))
                    else:
                        sink.write(value.getbuffer())
                        md[item.index.fqn] = BytesStorageMetadata()
                    storage[item.index] = _storage_info(name, start, sink.size - start)
                    continue
                if e.placements is None and rank != 0:
                    continue  # a plain tensor every rank holds
                start = sink.size
                torch.save(planner.resolve_data(item), sink)
                props = TensorProperties(dtype=getattr(torch, e.dtype))
                meta = md.setdefault(e.key, TensorStorageMetadata(props, torch.Size(e.size), []))
                meta.chunks.append(ChunkStorageMetadata(torch.Size(e.offsets), torch.Size(e.chunk)))
                storage[MetadataIndex(e.key, e.offsets)] = _storage_info(name, start, sink.size - start)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    part = {"metadata": md, "storage": storage, "mappings": getattr(planner, "mappings", None),
            "file": (name, sink.size, sink.crc)}  # fmt: skip
    atomic_write(d / part_name(rank), [pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL)], True)


def _merge(parts: list[dict[str, Any]]) -> Metadata:
    md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    mappings: dict[str, Any] = {}
    for part in parts:
        for key, meta in part["metadata"].items():
            have = md.get(key)
            if have is None:
                md[key] = meta
            elif isinstance(have, TensorStorageMetadata):
                seen = {tuple(c.offsets) for c in have.chunks}
                have.chunks.extend(c for c in meta.chunks if tuple(c.offsets) not in seen)
        for index, info in part["storage"].items():
            storage.setdefault(index, info)
        mappings.update(part["mappings"] or {})
    for key, meta in md.items():  # every element of every tensor is in exactly one chunk
        if isinstance(meta, TensorStorageMetadata) and len(meta.size):
            volume = sum(int(torch.Size(c.sizes).numel()) for c in meta.chunks)
            if volume != int(meta.size.numel()):
                raise ValueError(f"the ranks' chunks of {key} cover {volume} of its {meta.size.numel()} elements")
    from torch.distributed.checkpoint import filesystem

    return Metadata(state_dict_metadata=md, planner_data=mappings, storage_data=storage,
                    storage_meta=StorageMeta(save_id=uuid.uuid4().hex),
                    version=getattr(filesystem, "CURRENT_DCP_VERSION", None))  # fmt: skip


def finish(
    ckpt: CheckpointDir, step: int, world_size: int, state: bytes, wait_s: float = 120.0,
    abandoned: Callable[[], bool] = lambda: False,
) -> bool:
    """On rank 0: wait for every rank's part and RNG file, write ``.metadata``, the state and the
    manifest.  False (the step stays incomplete, with a warning) when a part never arrived, or at
    once when ``abandoned()`` (the job is re-forming: a lost rank's part will never come)."""  # fmt: skip
    d = ckpt.step_dir(step)
    wanted = [part_name(r) for r in range(world_size)] + [rng_name(r) for r in range(world_size)]
    deadline = time.monotonic() + wait_s
    while not all((d / n).exists() for n in wanted):
        if abandoned():
            notes.warn(f"checkpoint step {step} left incomplete: the job re-formed while it was written", stacklevel=2)
            return False
        if time.monotonic() > deadline:
            missing = [n for n in wanted if not (d / n).exists()]
            notes.warn(f"checkpoint step {step} left incomplete: {missing} never arrived", stacklevel=2)
            return False
        time.sleep(0.02)
    parts = [pickle.loads((d / part_name(r)).read_bytes()) for r in range(world_size)]
    files: dict[str, dict[str, int]] = {}
    for p in parts:
        name, size, crc = p["file"]
        files[name] = {"size": size, "crc32": crc}
    metadata = _merge(parts)
    for name, chunks in ((METADATA, [pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)]), (STATE, [state])):
        size, crc = atomic_write(d / name, chunks, True)
        files[name] = {"size": size, "crc32": crc}
    for r in range(world_size):
        size, crc = file_crc32(d / rng_name(r))
        files[rng_name(r)] = {"size": size, "crc32": crc}
    body = json.dumps({"format": 1, "kind": KIND, "step": step, "world_size": world_size, "files": files}, indent=1)
    atomic_write(d / MANIFEST, [body.encode()], True)
    for r in range(world_size):
        (d / part_name(r)).unlink(missing_ok=True)
    fsync_dir(d)
    ckpt.prune()
    return True


def verify(cand: DiskCandidate, rank: int, world_size: int) -> list[str]:
    """This rank's share of a checkpoint's files (every ``world_size``-th, by name) checked against
    the manifest: the ones whose size or CRC32 differ, as warnings naming them."""
    bad = []
    for i, (name, info) in enumerate(sorted(cand.files.items())):
        if i % world_size != rank:
            continue
        path = cand.dir / name
        try:
            size, crc = file_crc32(path)
        except OSError as e:
            bad.append(f"checkpoint file {path} is unreadable ({e})")
            continue
        if size != info["size"] or crc != info["crc32"]:
            bad.append(str(CheckpointCorrupt(path, f"size {size}, CRC32 {crc:#010x}; the manifest says "
                                                   f"{info['size']}, {info['crc32']:#010x}")))  # fmt: skip
    return bad


def read_state(cand: DiskCandidate) -> dict[str, Any]:
    """elastrun's non-tensor state of a checkpoint (skeleton, step, world size)."""
    return pickle.loads((Path(cand.dir) / STATE).read_bytes())


def read_metadata(path: str | os.PathLike) -> Metadata:
    """A DCP checkpoint's metadata (any DCP checkpoint directory)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path).read_metadata()
