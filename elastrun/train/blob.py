"""The in-memory form of a training state: a small picklable header plus one flat byte buffer.

A state (model and optimizer ``state_dict``, sampler position, extras) is a tree of dicts, lists and
tuples whose leaves are tensors or plain values.  :func:`flatten` replaces every tensor by a
:class:`TensorRef` and lays the tensors out back to back (64-byte aligned) in one buffer.  The
header holds the pickled skeleton and the layout; the buffer holds raw tensor bytes.  The same
``(header, buffer)`` pair is what a memory snapshot slot stores, what a disk checkpoint file
stores, and what a peer broadcasts, so the three restore paths share one loader
(:func:`materialize`).
"""

from __future__ import annotations

import ctypes
import pickle
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TensorRef:
    """Placeholder for the ``index``-th tensor of a flattened state."""

    index: int


@dataclass(frozen=True)
class Entry:
    """Where one tensor lives in the flat buffer."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class Flattened:
    """A state split into its skeleton and its tensors (not yet copied anywhere)."""

    skeleton: Any
    tensors: list[torch.Tensor]
    entries: list[Entry]
    nbytes: int


def _rebuild(obj: Any, fn: Any) -> Any:
    """Apply ``fn`` to every leaf of a dict/list/tuple tree, keeping container types and metadata."""
    if isinstance(obj, dict):
        out = type(obj)()
        for k, v in obj.items():
            out[k] = fn(v)
        if hasattr(obj, "_metadata"):  # nn.Module.state_dict() keeps per-module versions here
            out._metadata = obj._metadata
        return out
    if isinstance(obj, list):
        return [fn(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(fn(v) for v in obj)
    return obj


def _walk(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.is_sparse or obj.is_quantized:
            raise TypeError("elastrun.train cannot snapshot sparse or quantized tensors; convert them first")
        tensors.append(obj.detach())
        return TensorRef(len(tensors) - 1)
    return _rebuild(obj, lambda v: _walk(v, tensors))


def flatten(state: Any) -> Flattened:
    """Split ``state`` into a skeleton and a tensor list, and compute the buffer layout."""
    tensors: list[torch.Tensor] = []
    skeleton = _walk(state, tensors)
    entries = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append(Entry(str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return Flattened(skeleton, tensors, entries, offset)


def make_header(flat: Flattened, **meta: Any) -> dict[str, Any]:
    """The picklable description of a flattened state (``meta``: step, world size, ...)."""
    return {
        "format": FORMAT_VERSION,
        "skeleton": pickle.dumps(flat.skeleton, protocol=pickle.HIGHEST_PROTOCOL),
        "entries": [(e.dtype, e.shape, e.offset, e.nbytes) for e in flat.entries],
        "nbytes": flat.nbytes,
        **meta,
    }


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a tensor's data (a copy only when it is not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def copy_into(flat: Flattened, buffer: torch.Tensor, indices: list[int] | None = None) -> None:
    """Copy the tensors of ``flat`` (all, or only ``indices``) into ``buffer`` at their offsets.

    One copy per tensor, with the GIL released, so a copy on a helper thread does not stall the
    training thread's Python code (many small copies would, by GIL hand-offs).  CPU to CPU it is a
    plain ``memmove`` rather than ATen's ``copy_``: ``copy_`` on a helper thread starts a second
    OpenMP thread team, and two teams spinning on the same cores slowed training steps several-fold.
    """
    for i in range(len(flat.tensors)) if indices is None else indices:
        e = flat.entries[i]
        if not e.nbytes:
            continue
        src = as_bytes(flat.tensors[i])
        dst = buffer[e.offset : e.offset + e.nbytes]
        if src.device.type == "cpu" and dst.device.type == "cpu":
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), e.nbytes)  # single-threaded; releases the GIL
        else:
            dst.copy_(src)


def _unwalk(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, TensorRef):
        return tensors[obj.index]
    return _rebuild(obj, lambda v: _unwalk(v, tensors))


def materialize(header: dict[str, Any], buffer: torch.Tensor) -> Any:
    """Rebuild the state tree from a header and its buffer; tensors are fresh copies (own memory)."""
    if header.get("format") != FORMAT_VERSION:
        raise ValueError(f"unknown state format {header.get('format')!r} (expected {FORMAT_VERSION})")
    if buffer.numel() < header["nbytes"]:
        raise ValueError(f"state buffer holds {buffer.numel()} bytes, header needs {header['nbytes']}")
    tensors = []
    for dtype_name, shape, offset, nbytes in header["entries"]:
        dtype = getattr(torch, dtype_name)
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
        else:
            tensors.append(buffer[offset : offset + nbytes].view(dtype).reshape(shape).clone())
    return _unwalk(pickle.loads(header["skeleton"]), tensors)
