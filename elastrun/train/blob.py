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
    """The picklable description of a flattened state (``meta``: step, world size, ...).  A state with
    tensors on a GPU also says where each tensor was (``devices``): a restore puts them back there."""
    header = {
        "format": FORMAT_VERSION,
        "skeleton": pickle.dumps(flat.skeleton, protocol=pickle.HIGHEST_PROTOCOL),
        "entries": [(e.dtype, e.shape, e.offset, e.nbytes) for e in flat.entries],
        "nbytes": flat.nbytes,
        **meta,
    }
    devices = [t.device.type for t in flat.tensors]
    if any(d != "cpu" for d in devices):
        header["devices"] = devices
    return header


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


def entry_layout(entry: Any) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """``(dtype, shape, offset, nbytes)`` of one of a header's entries."""
    dtype_name, shape, offset, nbytes = entry
    return getattr(torch, dtype_name), tuple(shape), offset, nbytes


def tree_of(header: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    """The state tree of ``header`` with its entries' tensors in place."""
    return _unwalk(pickle.loads(header["skeleton"]), tensors)


def check(header: dict[str, Any], buffer: torch.Tensor | None = None) -> None:
    """ValueError unless :func:`materialize` can read ``header`` (and ``buffer``, when given)."""
    if header.get("format") != FORMAT_VERSION:
        raise ValueError(f"unknown state format {header.get('format')!r} (expected {FORMAT_VERSION})")
    if buffer is not None and buffer.numel() < header["nbytes"]:
        raise ValueError(f"state buffer holds {buffer.numel()} bytes, header needs {header['nbytes']}")


def materialize(header: dict[str, Any], buffer: torch.Tensor, into: dict[int, torch.Tensor] | None = None) -> Any:
    """Rebuild the state tree from a header and its buffer; tensors are fresh copies (own memory).

    ``into``: tensors the caller already holds (a model's own parameters, see :func:`landing`) by
    entry index: those entries are copied into them rather than into fresh memory, and the tree
    holds them (so ``load_state_dict`` then has nothing left to copy)."""
    check(header, buffer)
    into = into or {}
    tensors = []
    for i, entry in enumerate(header["entries"]):
        dtype, shape, offset, nbytes = entry_layout(entry)
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
        elif i in into:
            _land(into[i], buffer[offset : offset + nbytes])
            tensors.append(into[i])
        else:
            tensors.append(buffer[offset : offset + nbytes].view(dtype).reshape(shape).clone())
    return tree_of(header, tensors)


def _land(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the bytes ``src`` into the contiguous CPU tensor ``dst`` (one ``memmove``, GIL released)."""
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())


def landing(header: dict[str, Any], part: str, live: dict[str, Any], device: bool = False) -> dict[int, torch.Tensor]:
    """Which entries of a state can land straight in tensors the reader already holds: ``live`` is
    ``part``'s current value (a ``module.state_dict()``, whose tensors share the parameters'
    memory).  All or nothing: only when the saved ``part`` has the same keys, dtypes and shapes
    (what a strict ``load_state_dict`` accepts); only contiguous tensors, each memory once, in host
    memory (``device``: on a GPU too, for ``gpu/load.py``)."""
    tree = pickle.loads(header["skeleton"])
    refs = tree.get(part) if isinstance(tree, dict) else None
    if not isinstance(refs, dict) or list(refs) != list(live):
        return {}
    into: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    for k, ref in refs.items():
        t = live[k]
        if not isinstance(ref, TensorRef) or not isinstance(t, torch.Tensor):
            return {}
        dtype, shape, _, nbytes = entry_layout(header["entries"][ref.index])
        if t.dtype != dtype or tuple(t.shape) != shape:
            return {}
        if nbytes and (device or t.device.type == "cpu") and t.is_contiguous() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            into[ref.index] = t
    return into


#: Entries smaller than this are received together into one staging buffer (one request per run of
#: them, not per tensor) and copied out; larger ones are received straight into their tensor.
SMALL = 1 << 20


class Receipt:
    """Where a state's bytes land when a reader receives them by ranges (a snapshot server)::

        receipt = Receipt(header, into)          # into: see landing()
        for offset, view in receipt.ranges:      # fill every range (offset in the saved buffer)
            ...
        tree = receipt.tree()                    # only once every range was filled

    Large entries land straight in ``into``'s tensors or in fresh tensors of their own (no second
    copy, no buffer kept alive by views); runs of small entries land in staging buffers."""

    def __init__(self, header: dict[str, Any], into: dict[int, torch.Tensor] | None = None) -> None:
        check(header)
        self._header = header
        self._into = into or {}
        #: Entries received straight into ``into``'s tensors (written while the ranges arrive).
        self.landed = [i for i in self._into if header["entries"][i][3] >= SMALL]
        self.ranges: list[tuple[int, torch.Tensor]] = []
        self._tensors: list[torch.Tensor | None] = []
        self._staged: list[tuple[int, torch.Tensor, int]] = []  # (entry, staging buffer, its start offset)
        run: list[int] = []  # indices of the current run of small entries
        for i, entry in enumerate(header["entries"]):
            dtype, shape, offset, nbytes = entry_layout(entry)
            if 0 < nbytes < SMALL:
                run.append(i)
                self._tensors.append(None)
                continue
            self._close_run(run)
            if nbytes == 0:
                self._tensors.append(torch.empty(shape, dtype=dtype))
                continue
            t = self._into.get(i)
            if t is None:
                t = torch.empty(shape, dtype=dtype)
            self.ranges.append((offset, as_bytes(t)))
            self._tensors.append(t)
        self._close_run(run)

    def _close_run(self, run: list[int]) -> None:
        if not run:
            return
        entries = self._header["entries"]
        start = entries[run[0]][2]
        end = entries[run[-1]][2] + entries[run[-1]][3]
        buf = torch.empty(end - start, dtype=torch.uint8)
        self.ranges.append((start, buf))
        self._staged += [(i, buf, start) for i in run]
        run.clear()

    def tree(self) -> Any:
        """The state tree, once every range was filled."""
        tensors = self._tensors
        for i, buf, start in self._staged:
            dtype, shape, offset, nbytes = entry_layout(self._header["entries"][i])
            src = buf[offset - start : offset - start + nbytes]
            if i in self._into:
                _land(self._into[i], src)
                tensors[i] = self._into[i]
            else:
                tensors[i] = src.view(dtype).reshape(shape).clone()
        return _unwalk(pickle.loads(self._header["skeleton"]), tensors)
