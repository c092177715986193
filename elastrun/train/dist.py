"""Process-group set-up from the launcher's environment, and the few collectives State needs."""

from __future__ import annotations

import ipaddress
import os
import pickle
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastrun.train import notes


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, local rank, and its compute device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> DistInfo:
    """Create the default process group from the launcher's environment (idempotent).

    ``backend`` defaults to ``nccl`` when CUDA is available and ``LOCAL_RANK`` names one of the
    GPUs (that GPU becomes the current device), else ``gloo``.  Without a launcher (no
    ``WORLD_SIZE`` in the environment) a one-process group is created on an in-memory store, so
    the same script also runs as plain ``python train.py``.
    """
    local_rank = _env_int("LOCAL_RANK", 0)
    use_cuda = torch.cuda.is_available() and local_rank < torch.cuda.device_count()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)
    if use_cuda:
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if use_cuda else "gloo")
    timeout = timedelta(seconds=timeout_s)
    _one_rank_prefix()
    if "WORLD_SIZE" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise RuntimeError(
                    f"WORLD_SIZE is set but {name} is not: start this script with elastrun (or another "
                    "launcher that sets RANK, MASTER_ADDR and MASTER_PORT)"
                )
        try:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
            if dist.get_world_size() > 1:
                flag_group()  # made here, with the group: a re-form's shutdown finds its connections
        except BaseException:
            _forget_failed_init()
            raise
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


#: ``sys.excepthook`` as it was before this process's first process group (see :func:`_one_rank_prefix`).
_hook_before_groups: list = []


def _one_rank_prefix() -> None:
    """Keep one ``[rankN]:`` prefix on an uncaught traceback's lines, however many groups were set up.

    torch's ``init_process_group`` wraps ``sys.excepthook`` in one that prefixes each line with the
    group's rank, and never unwraps it.  A worker kept through re-forms (``elastrun.train.run``) sets
    up one group per re-form, so its last traceback had one prefix per re-form (dozens were seen under
    churn), and the agent, which reads a worker's error with one prefix stripped, could no longer find
    the exception in it.  Before each set-up, torch's earlier wrapper is put back to the hook it wrapped.
    """
    if not _hook_before_groups:
        _hook_before_groups.append(sys.excepthook)
    elif getattr(sys.excepthook, "__name__", "") == "_distributed_excepthook":
        sys.excepthook = _hook_before_groups[0]


def _forget_failed_init() -> None:
    """Undo the name a failed ``init_process_group`` gave the default group (issue 35).

    torch names an unnamed group from a counter (``"0"``, ``"1"``, ...) before building it, and the
    name is the prefix of the group's keys in the store.  A set-up that fails (a peer that never
    came, or a re-form's pause shutting its connections) keeps the counter, so this process's next
    group would use ``1/`` while a fresh process uses ``0/``: they would never meet.  Reset it, as
    ``destroy_process_group`` does for a destroyed default group.
    """
    if dist.is_initialized():
        return
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def active() -> bool:
    """True when a process group with more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def comm_device() -> torch.device:
    """Where tensors for collectives must live (the current GPU under NCCL)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: The gloo group :func:`maxima` uses beside an NCCL default group (None: refused), and that default group.
_flag_group: list[Any] = []


#: Why no flag group is made (said once), if one is not.
_flag_group_refused: list[str] = []


#: The largest job given a gloo flag group: gloo connects every rank to every other at the group's
#: set-up (a socket per peer in each process), which a job of thousands of ranks should not pay for a
#: few integers per commit.
FLAG_GROUP_MAX_WORLD = 1024


def _gloo_unreachable(world_size: int) -> str:
    """Why a gloo group would fail to connect this job's ranks, or should not, or "".

    * Gloo opens a socket to every other rank: more ranks than :data:`FLAG_GROUP_MAX_WORLD`, or than
      a quarter of this process's descriptor limit, are not given one.
    * Gloo binds to the address this host's name resolves to (``GLOO_SOCKET_IFNAME`` unset); on a
      host whose name resolves to a loopback address (Debian's ``127.0.1.1``) the other nodes cannot
      reach it, and the group's set-up would wait out its whole timeout.  A job on one host is not
      concerned."""
    try:
        import resource

        descriptors = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        descriptors = -1
    limit = FLAG_GROUP_MAX_WORLD if descriptors < 0 else min(FLAG_GROUP_MAX_WORLD, descriptors // 4)
    if world_size > limit:
        return (f"{world_size} ranks: a gloo group would open a socket to each of them in every process "
                f"(given up to {limit} ranks here)")  # fmt: skip
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return ""
    local = _env_int("LOCAL_WORLD_SIZE", 0)
    if world_size <= max(local, 1):
        return ""
    try:
        address = socket.gethostbyname(socket.gethostname())
        loopback = ipaddress.ip_address(address).is_loopback
    except (OSError, ValueError):
        address, loopback = "nothing", True
    if not loopback:
        return ""
    return (f"this host's name resolves to {address}, where gloo cannot reach the other nodes; set "
            "GLOO_SOCKET_IFNAME to the network interface that reaches MASTER_ADDR")  # fmt: skip


def _needs_flag_group() -> bool:
    """Whether the default group takes GPU tensors only (NCCL): flags then need a group of their own."""
    return dist.get_backend() == "nccl"


def flag_group() -> Any:
    """The group :func:`maxima` all-reduces its flags in: None (the default group) where that group
    takes CPU tensors; beside an NCCL default group, a gloo group over the same ranks.

    A flag all-reduced on the GPU must be read back on the host, and that read waits for every kernel
    the training stream has queued: at each commit the host loses its lead over the device, and
    whatever the host does next (the next batch, its copy to the GPU) runs while the GPU idles.  In
    the H100 benchmark (2026-11-27: batches already on the GPU, so nothing for the host to do between
    steps) a host wait after each step cost 0-1.5 %; a loop that loads its batches pays more.  A few
    integers over gloo cost a network round trip and no GPU wait.

    Made once per default group, by every rank at the same point (collective): by
    :func:`init_distributed` after its group (so that a re-form's shutdown finds its connections),
    else at the first commit.  A group destroyed with its default group is made again.  Without
    gloo in this torch build, or where gloo could not reach the other nodes (:func:`_gloo_unreachable`,
    said once), None: flags then go over NCCL, as before."""
    if not dist.is_initialized() or not _needs_flag_group() or not dist.is_gloo_available():
        return None
    c10d = dist.distributed_c10d
    default = c10d._get_default_group()
    live = getattr(getattr(c10d, "_world", None), "pg_map", None)  # the groups not destroyed
    if _flag_group and _flag_group[1] is default and (_flag_group[0] is None or live is None or _flag_group[0] in live):
        return _flag_group[0]  # decided for this default group (every commit asks: no host name lookup here)
    why = _gloo_unreachable(dist.get_world_size())
    if why and not _flag_group_refused:
        _flag_group_refused.append(why)
        notes.warn(f"commit()'s flags go over NCCL, and each commit waits for the GPU to finish the step: {why}",
                   stacklevel=3)  # fmt: skip
    _flag_group[:] = [None if why else dist.new_group(backend="gloo"), default]
    return _flag_group[0]


def _pickled(obj: Any, dev: torch.device) -> torch.Tensor:
    """``obj`` pickled into a ``uint8`` tensor on ``dev``."""
    data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    return torch.frombuffer(data, dtype=torch.uint8).to(dev)


def _unpickled(payload: torch.Tensor) -> Any:
    """The object pickled in the ``uint8`` tensor ``payload`` (on any device)."""
    data = bytearray(payload.numel())
    torch.frombuffer(data, dtype=torch.uint8).copy_(payload)
    return pickle.loads(data)


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (just ``[obj]`` without a multi-rank group).

    Pickled into byte tensors and sent with two tensor all-gathers (lengths, then padded bytes),
    not with ``all_gather_object``: torch's object collectives need numpy, which a plain
    ``pip install elastrun`` does not bring.  Works on gloo and NCCL (tensors on the current GPU).
    """
    if not active():
        return [obj]
    dev = comm_device()
    world = dist.get_world_size()
    payload = _pickled(obj, dev)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=dev)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    sizes = [int(n.item()) for n in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=dev)
    padded[: payload.numel()] = payload
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return [_unpickled(part[:size]) for part, size in zip(parts, sizes, strict=True)]


def broadcast_obj(obj: Any, src: int) -> Any:
    """``obj`` of rank ``src`` on every rank (tensor broadcasts of its pickle; no numpy needed)."""
    if not active():
        return obj
    dev = comm_device()
    payload = _pickled(obj, dev) if dist.get_rank() == src else None
    length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=dev)
    dist.broadcast(length, src=src)
    if payload is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(payload, src=src)
    return _unpickled(payload)


def broadcast_bytes(buffer: torch.Tensor, src: int, chunk: int = 64 << 20) -> None:
    """Broadcast a ``uint8`` CPU tensor in place, in chunks (bounded extra memory under NCCL)."""
    if not active():
        return
    dev = comm_device()
    for i in range(0, buffer.numel(), chunk):
        part = buffer[i : i + chunk]
        if dev.type == "cpu":
            dist.broadcast(part, src=src)
        else:
            staged = part.to(dev)
            dist.broadcast(staged, src=src)
            part.copy_(staged.cpu())


def any_flag(flag: bool, scratch: list[torch.Tensor]) -> bool:
    """True on every rank when ``flag`` is true on any rank (one tiny all-reduce)."""
    return bool(maxima((flag,), scratch)[0])


def maxima(values: tuple[int, ...], scratch: list[torch.Tensor]) -> tuple[int, ...]:
    """Each value's maximum over every rank (flags: OR), in one tiny all-reduce (every rank passes
    as many), on the host: in :func:`flag_group` beside an NCCL group, where nothing waits for the GPU."""
    if not active():
        return tuple(int(v) for v in values)
    group = flag_group()
    if group is not None:
        flags = torch.tensor([int(v) for v in values], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return tuple(int(v) for v in flags.tolist())
    if not scratch or scratch[0].numel() != len(values):
        scratch[:] = [torch.zeros(len(values), dtype=torch.int64, device=comm_device())]
    t = scratch[0]
    t.copy_(torch.tensor([int(v) for v in values], dtype=torch.int64))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(int(v) for v in t.tolist())


def forget_mesh_caches() -> None:
    """Clear DTensor's caches of sharding decisions (issue 24): they are keyed by device mesh
    *equality*, which does not look at which rank this process is.  After an in-process re-form to
    a mesh of the same shape with this process at another rank (3 -> 2 -> 3 ranks, or two ranks
    swapped), a cached decision would hand back the earlier group's mesh, with this process's earlier
    coordinate: a new model's DTensors would describe another rank's chunks.  Both the Python and
    the C++ fast-path caches are cleared (``torch.distributed.tensor.debug``), and the redistribute
    planners.  Called at every re-form; does nothing when DTensor was never imported."""
    if sys.modules.get("torch.distributed.tensor._api") is None:
        return
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # older torch: the Python cache only (it had no C++ fast path)
        from torch.distributed.tensor._api import DTensor

        prop = DTensor._op_dispatcher.sharding_propagator
        _clear_sharding_prop_cache = getattr(getattr(prop, "propagate_op_sharding", None), "cache_clear", None)
        if _clear_sharding_prop_cache is None:
            return
    _clear_sharding_prop_cache()
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    for name in ("clear_redistribute_planner_cache", "_gen_transform_infos"):
        fn = getattr(redistribute, name, None)
        clear = getattr(fn, "cache_clear", fn if name.startswith("clear") else None)
        if callable(clear):
            clear()
