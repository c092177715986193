"""What one rank holds of a sharded training state, as named chunks of global tensors.

A state is a tree (dicts, lists, tuples) whose leaves are DTensors, plain tensors and plain values.
:func:`split` names every tensor by its path in the tree (``model.layers.0.weight``,
``optimizer.state.layers.0.weight.exp_avg``: the keys DCP gives the same tree) and keeps the rest
as a small *skeleton* with :class:`Ref` placeholders.  A DTensor contributes the chunk this rank
holds (its local tensor, and where that chunk sits in the global tensor); a plain tensor is one
chunk covering itself, held by every rank that has it (buffers, optimizer step counters).

:func:`check_model` and :func:`check_optimizer` refuse what this module cannot describe, in one
line: ``Partial`` placements, a DTensor whose local tensor is not exactly one chunk, FSDP1's flat
parameters, ``ZeroRedundancyOptimizer``, sharded tensors of the old ``ShardedTensor`` API.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

import torch


class Unsupported(TypeError):
    """A state elastrun.train cannot snapshot; the message is one line saying what to change."""


@dataclass(frozen=True)
class Ref:
    """Placeholder in a skeleton for the tensor named ``key``."""

    key: str


@dataclass(frozen=True)
class Entry:
    """One tensor chunk of a rank's snapshot file."""

    key: str
    dtype: str  # "float32", ...
    size: tuple[int, ...]  # of the global tensor
    offsets: tuple[int, ...]  # of this chunk in the global tensor
    chunk: tuple[int, ...]  # shape of this chunk
    offset: int  # bytes into the rank's data file
    nbytes: int
    placements: tuple | None  # a DTensor's placements (None: a plain tensor, held whole)
    device: str  # "cpu", "cuda": where the tensor lived


def dtensor_class() -> type | None:
    """``DTensor`` if the program imported it (a state without DTensors never pays the import)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(t: Any) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def unwrap(model: torch.nn.Module | None) -> torch.nn.Module | None:
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return model.module
    return model


def _named(name: str, module: str) -> type | None:
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def check_model(model: torch.nn.Module | None) -> bool:
    """Whether ``model`` is sharded (has DTensor parameters); raises :class:`Unsupported`."""
    if model is None:
        return False
    fsdp1 = _named("FullyShardedDataParallel", "torch.distributed.fsdp.fully_sharded_data_parallel")
    if fsdp1 is not None and any(isinstance(m, fsdp1) for m in model.modules()):
        raise Unsupported(
            "elastrun.train cannot snapshot FullyShardedDataParallel (FSDP1) models: shard them with "
            "torch.distributed.fsdp.fully_shard (FSDP2) instead"
        )
    sharded = False
    for name, p in model.named_parameters():
        if is_dtensor(p):
            _check_dtensor(f"parameter {name}", p)
            sharded = True
        elif p.device.type == "meta":
            raise Unsupported(f"parameter {name} is on the meta device: materialize the model before State")
    return sharded


def check_optimizer(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``optimizer`` holds DTensor parameters; raises :class:`Unsupported`."""
    if optimizer is None:
        return False
    zero = _named("ZeroRedundancyOptimizer", "torch.distributed.optim.zero_redundancy_optimizer")
    if zero is not None and isinstance(optimizer, zero):
        raise Unsupported(
            "elastrun.train cannot snapshot ZeroRedundancyOptimizer (its state is sharded without DTensors): "
            "use FSDP2 (fully_shard) or a plain optimizer under DDP"
        )
    return any(is_dtensor(p) for g in optimizer.param_groups for p in g["params"])


def _check_dtensor(what: str, t: Any) -> None:
    for p in t.placements:
        if p.is_partial():
            raise Unsupported(f"{what} is a DTensor with a Partial placement ({p}): reduce it before commit()")
    local = t.to_local()
    chunks = t.__create_chunk_list__()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise Unsupported(
            f"{what} is a DTensor whose local tensor is not one chunk of the global tensor "
            f"(placements {tuple(t.placements)}): elastrun.train handles Shard and Replicate placements"
        )
    if local.is_sparse or local.is_quantized:
        raise Unsupported(f"{what} is a sparse or quantized DTensor: elastrun.train snapshots dense tensors only")


# -- the optimizer's state keyed by parameter names (the form DCP saves) ----------------------------
def param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The name of every optimizer parameter, group by group (refused when one has none)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for i, group in enumerate(optimizer.param_groups):
        row = []
        for p in group["params"]:
            if id(p) not in names:
                raise Unsupported(f"optimizer param group {i} holds a parameter that is not one of the model's")
            row.append(names[id(p)])
        out.append(row)
    return out


def optimizer_tree(optimizer: torch.optim.Optimizer, names: list[list[str]]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names instead of positions (what
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` returns)."""
    sd = optimizer.state_dict()
    flat = [n for row in names for n in row]
    groups = []
    for g, row in zip(sd["param_groups"], names, strict=True):
        groups.append({**g, "params": list(row)})
    return {"state": {flat[i]: v for i, v in sd["state"].items()}, "param_groups": groups}


def optimizer_positional(tree: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_tree` for the current optimizer (its groups, its order)."""
    saved = tree["param_groups"]
    if len(saved) != len(names) or any(set(g["params"]) != set(row) for g, row in zip(saved, names, strict=True)):
        raise Unsupported("the optimizer's parameter groups differ from the saved state's: build it as before")
    position = {n: i for i, n in enumerate(n for row in names for n in row)}
    groups = []
    for g, row in zip(saved, names, strict=True):
        groups.append({**g, "params": [position[n] for n in row]})
    return {"state": {position[n]: v for n, v in tree["state"].items()}, "param_groups": groups}


# -- a tree split into named tensors and a skeleton -----------------------------------------------
def split(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """The skeleton of ``tree`` and its tensors by key (the tree's own objects: a DTensor stays one)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: tuple[str, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            key = ".".join(path)
            if key in tensors:
                raise Unsupported(f"two tensors of the state are both named {key!r}")
            tensors[key] = obj
            return Ref(key)
        if isinstance(obj, dict):
            out = type(obj)()
            for k, v in obj.items():
                out[k] = walk(v, (*path, str(k)))
            if hasattr(obj, "_metadata"):
                out._metadata = obj._metadata
            return out
        if isinstance(obj, list):
            return [walk(v, (*path, str(i))) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(walk(v, (*path, str(i))) for i, v in enumerate(obj))
        return obj

    return walk(tree, ()), tensors


def join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The tree of ``skeleton`` with each :class:`Ref` replaced by its tensor."""
    if isinstance(skeleton, Ref):
        return tensors[skeleton.key]
    if isinstance(skeleton, dict):
        out = type(skeleton)()
        for k, v in skeleton.items():
            out[k] = join(v, tensors)
        if hasattr(skeleton, "_metadata"):
            out._metadata = skeleton._metadata
        return out
    if isinstance(skeleton, list):
        return [join(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple) and not hasattr(skeleton, "_fields"):
        return tuple(join(v, tensors) for v in skeleton)
    return skeleton


def refs_of(skeleton: Any) -> set[str]:
    """The keys of every :class:`Ref` in ``skeleton``."""
    if isinstance(skeleton, Ref):
        return {skeleton.key}
    if isinstance(skeleton, dict):
        values: Any = skeleton.values()
    elif isinstance(skeleton, (list, tuple)):
        values = skeleton
    else:
        return set()
    return set().union(*(refs_of(v) for v in values))


def local_part(key: str, t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], tuple | None]:
    """``(local tensor, global size, chunk offsets, placements)`` of one tensor of the state."""
    if is_dtensor(t):
        _check_dtensor(key, t)
        chunk = t.__create_chunk_list__()[0]
        return t.to_local().detach(), tuple(t.shape), tuple(chunk.offsets), tuple(t.placements)
    if t.is_sparse or t.is_quantized:
        raise Unsupported(f"{key} is a sparse or quantized tensor: elastrun.train snapshots dense tensors only")
    return t.detach(), tuple(t.shape), (0,) * t.dim(), None


ALIGN = 64


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s local data (a DTensor's local tensor, read without
    the cost of ``to_local()``; the tensor itself where that attribute does not exist)."""
    return getattr(t, "_local_tensor", t)


class Layout:
    """Lays out a rank's data file (64-byte aligned entries in key order), remembering the last
    commit's: a tensor that is the same object over the same local storage keeps its entry, so a
    commit does not recompute every DTensor's chunk (the costly part, ~0.1 ms each)."""

    def __init__(self) -> None:
        self._memo: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, Entry]] = {}

    def __call__(self, tensors: dict[str, torch.Tensor]) -> tuple[list[Entry], list[torch.Tensor], int, bool]:
        """``(entries, local tensors to copy, file size, whether anything differs from last time)``."""
        entries, locals_, offset = [], [], 0
        changed = tensors.keys() != self._memo.keys()
        memo = {}
        for key, t in tensors.items():
            hit = self._memo.get(key)
            raw = _raw(t)
            if hit is not None and hit[0] is t and hit[1] is raw and hit[2].data_ptr() == raw.data_ptr() and (
                    hit[2].shape == raw.shape):  # fmt: skip
                local, template = hit[2], hit[3]
            else:
                changed = True
                local, size, offsets, placements = local_part(key, t)
                template = Entry(key, str(local.dtype).removeprefix("torch."), size, offsets, tuple(local.shape), 0,
                                 local.numel() * local.element_size(), placements, local.device.type)  # fmt: skip
            entry = template if template.offset == offset else dataclasses.replace(template, offset=offset)
            memo[key] = (t, raw, local, entry)
            entries.append(entry)
            locals_.append(local)
            offset += (template.nbytes + ALIGN - 1) // ALIGN * ALIGN
        self._memo = memo
        return entries, locals_, offset, changed


def lay_out(tensors: dict[str, torch.Tensor]) -> tuple[list[Entry], list[torch.Tensor], int]:
    """Entries of a rank's data file (64-byte aligned, in key order of ``tensors``), the local
    tensors to copy, and the file's size."""
    entries, locals_, offset, _ = Layout()(tensors)
    return entries, locals_, offset


def twins(tensors: Any, rank: int) -> tuple[int, ...]:
    """The global ranks that hold exactly the chunks ``rank`` holds of every DTensor in ``tensors``
    (itself included): under HSDP, the ranks at the same place of the other replica groups.  A
    DTensor's chunk is the same on two ranks of its mesh when their coordinates differ only along
    mesh dimensions where it is ``Replicate``; plain tensors are held whole by everyone."""
    group: set[int] | None = None
    for t in tensors:
        if not is_dtensor(t):
            continue
        mesh = t.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            continue
        index = tuple(slice(None) if p.is_replicate() else c for p, c in zip(t.placements, coordinate, strict=True))
        same = {int(r) for r in mesh.mesh[index].flatten().tolist()}
        group = same if group is None else group & same
    return tuple(sorted(group)) if group else (rank,)
