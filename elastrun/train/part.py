"""What a ``State`` is made of, and the contract each kind of training state implements.

A ``State`` (``state.py``) owns three things and hands the first two to the third:

* :class:`Objects`: the user's objects it saves (model, optimizer, sampler, extras, the step), how
  they become a tree and back, and (under ``et.run``) the commit they can roll back to in place;
* :class:`Core`: what every kind of state shares: where this rank is, its node's snapshot
  directory, the checkpoint directory, the snapshot pipeline (commit -> copy -> publish -> persist);
* a :class:`Part`: one kind of state.  :class:`~elastrun.train.replicated.ReplicatedPart` (data
  parallel: one copy per node, written by local rank 0) or
  :class:`~elastrun.train.sharded.shards.ShardedPart` (FSDP2: every rank its own shard).  A part
  lays its state out, snapshots and persists it through the pipeline, and answers the questions of
  the one restore loop (``restore.py``).  It reads and writes only through ``Objects`` and ``Core``::

    part = ReplicatedPart(core, objects)
    part.commit(durable, stop, due, background, copy_step)   # in State.commit()
    source = restore.run(core, objects, part)                 # State.restore(): collective
"""

from __future__ import annotations

import abc
import copy
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from elastrun.train import reform
from elastrun.train.checkpoint import CheckpointDir, DiskCandidate
from elastrun.train.pipeline import SnapshotPipeline
from elastrun.train.snapshot import MemorySnapshots

#: What :meth:`Part.load` returns: ``(apply, failed, wrote)``.
Loaded = tuple[Callable[[], str] | None, set, bool]


def world() -> tuple[int, int, int]:
    """``(rank, world size, local rank)`` of the current process group (or the launcher's environment)."""
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), local
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), local


@dataclass
class Live:
    """What a process's own objects can be rolled back to in a re-form (``Objects.live``): the step
    of the last commit or restore, the world size then, this rank's RNG states then, and copies of
    what changes outside ``optimizer.step()`` (sampler, extras, buffers)."""

    step: int
    world_size: int
    rng: bytes
    aux: dict[str, Any]


@dataclass
class Objects:
    """The user's objects a ``State`` saves: model (plain or DDP-wrapped), optimizer, sampler, extras
    (objects with ``state_dict``/``load_state_dict`` or plain values) and the step."""

    model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    sampler: Any
    extras: dict[str, Any]
    step: int = 0
    #: Under ``et.run``: the commit the objects hold (None: none remembered).
    live: Live | None = None
    #: True once ``optimizer.step()`` began after that commit: the parameters no longer match it.
    dirty: bool = False

    def module(self) -> torch.nn.Module | None:
        m = self.model
        if isinstance(m, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            return m.module
        return m

    def tree_extras(self) -> dict[str, Any]:
        return {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in self.extras.items()}

    def apply(self, tree: dict[str, Any]) -> None:
        """Load a restored tree (``step``, ``model``, ``optimizer``, ``sampler``, ``extras``; a None part
        is left as it is) into the objects."""
        module = self.module()
        if module is not None and tree["model"] is not None:
            module.load_state_dict(tree["model"])
        if self.optimizer is not None and tree["optimizer"] is not None:
            self.optimizer.load_state_dict(tree["optimizer"])
        if self.sampler is not None and tree["sampler"] is not None:
            self.sampler.load_state_dict(tree["sampler"])
        self._apply_extras(tree["extras"])
        self.step = tree["step"]

    def _apply_extras(self, extras: dict[str, Any]) -> None:
        for k, v in extras.items():
            if k in self.extras and hasattr(self.extras[k], "load_state_dict"):
                self.extras[k].load_state_dict(v)
            else:
                self.extras[k] = v

    # -- what a re-form rolls back to (elastrun.train.run) ------------------------------------------
    def remember_live(self, rng: bytes, world_size: int) -> None:
        """The objects now hold commit ``step`` (with these RNG states): remembered under ``et.run``."""
        if reform.active():
            module = self.module()
            aux = {
                "sampler": self.sampler.state_dict() if self.sampler is not None else None,
                "extras": copy.deepcopy(self.tree_extras()),
                "buffers": [b.detach().clone() for b in module.buffers()] if module is not None else [],
            }
            self.live = Live(self.step, world_size, rng, aux)
            self.dirty = False

    def live_step(self) -> int | None:
        """The committed step the objects can roll back to without a copy, or None (torn, or none)."""
        if self.live is None or self.dirty:
            return None
        return self.live.step

    def rollback_live(self) -> None:
        """Put the objects back to the remembered commit (parameters and optimizer state are untouched
        since: only the copies of everything else are applied)."""
        live = self.live
        assert live is not None
        if self.sampler is not None and live.aux["sampler"] is not None:
            self.sampler.load_state_dict(live.aux["sampler"])
        self._apply_extras(copy.deepcopy(live.aux["extras"]))
        module = self.module()
        if module is not None:
            with torch.no_grad():
                for b, saved in zip(module.buffers(), live.aux["buffers"], strict=True):
                    b.copy_(saved)
        self.step = live.step


@dataclass
class Core:
    """What every kind of state shares (one per ``State``)."""

    mem: MemorySnapshots  # this node's snapshot directory
    ckpt: CheckpointDir | None  # the checkpoint directory, if any
    pipe: SnapshotPipeline  # this rank's snapshot pipeline (and its persister)
    copies: int  # nodes whose memory holds each committed shard (sharded states)
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    #: Set while a restore waits for the persister: a checkpoint still waiting for the parts of other
    #: ranks gives up (they may be gone; that step stays incomplete) instead of stalling the restore.
    abandon: threading.Event = field(default_factory=threading.Event)

    def rebind(self) -> None:
        """Take the current process group's rank and world size."""
        self.rank, self.world_size, self.local_rank = world()


class Part(abc.ABC):
    """One kind of training state, as ``State`` and the restore loop (``restore.py``) use it.

    A restore, on every rank at once::

        if part.prepare() is not GO: ...                 # the part's own answer (no collective)
        reports = all_gather(part.report())
        for attempt in range(part.attempts(reports)):
            plan = part.plan(reports, excluded)          # the same on every rank
            apply, failed, wrote = part.load(plan, reports)
            ...                                          # failures are gathered and left out
            source = apply()                             # only once every rank has its bytes
        restore_rng(plan, part.disk); part.restored(plan)
    """

    #: What :meth:`prepare` returns for "go on with the restore".
    GO: Any = object()
    #: What :meth:`prepare` returns for "nothing to restore now": under ``et.run`` the model comes
    #: with ``State.attach()``, whose restore loads (and records) the state.
    LATER: Any = object()

    #: Complete-looking checkpoints of this kind found by the last :meth:`report` (step -> candidate).
    disk: dict[int, DiskCandidate]
    #: After a restore: where this rank read each old rank's part from (sharded states).
    sources: dict[int, str]
    #: What the last restore moved from other nodes: ``{"via": "server" | "group", "bytes", "seconds"}``.
    transfer: dict[str, Any] | None

    def __init__(self, core: Core, objects: Objects) -> None:
        self.core = core
        self.objects = objects
        self.disk = {}
        self.sources = {}
        self.transfer = None

    # -- commit --------------------------------------------------------------------------------
    @abc.abstractmethod
    def commit(self, durable: bool, stop: bool, due: bool, background: bool, copy_step: bool) -> None:
        """``State.commit()``'s snapshot part for ``objects.step`` (``due``: the pipeline's agreed
        spacing snapshots it; ``durable``: a checkpoint too; ``stop``: pre-emption, the last one)."""

    @abc.abstractmethod
    def checkpoint(self) -> None:
        """A durable checkpoint of the last commit now, waited for (collective)."""

    def copying(self) -> bool:
        """Whether this rank's last copy to another node's memory is still going (sharded states)."""
        return False

    # -- restore -------------------------------------------------------------------------------
    @abc.abstractmethod
    def prepare(self) -> Any:
        """Before a restore: let the background writes finish; :attr:`GO`, :attr:`LATER`, or the
        restore's answer."""

    @abc.abstractmethod
    def report(self) -> Any:
        """What this rank can read (gathered from every rank, then planned on)."""

    def begin(self, reports: list[Any]) -> None:
        """Every rank's report is here (before the first plan)."""

    @abc.abstractmethod
    def attempts(self, reports: list[Any]) -> int:
        """At most how many plans are tried (each attempt leaves out what failed)."""

    @abc.abstractmethod
    def plan(self, reports: list[Any], excluded: set[tuple]) -> Any:
        """The agreed plan (with ``step`` and ``rng_holders``), or None: nothing to restore."""

    @abc.abstractmethod
    def load(self, plan: Any, reports: list[Any], excluded: set[tuple]) -> Loaded:
        """Fetch this rank's bytes of ``plan``: ``(apply, failed, wrote)``.  ``apply()`` loads them
        into the objects and returns the source; ``failed``: the copies that could not be read
        (left out of the next plan; ``apply`` is then None); ``wrote``: the objects' own tensors were
        written into already (a failed transfer then leaves them neither fresh nor restored)."""

    def nothing(self, reports: list[Any], excluded: set[tuple], wrote: bool) -> None:
        """No plan: the restore starts fresh (say why, or refuse when the objects were written into)."""
        if wrote:  # every rank knows it (gathered): none starts fresh beside a torn one
            raise RuntimeError(
                "State.restore(): a transfer that had begun writing into a rank's model failed part-way and "
                "no other copy of a committed step is left: that model is neither fresh nor restored, so "
                "the restore stops here (restart the job: it starts fresh)")

    def restored(self, plan: Any) -> None:
        """The restore of ``plan`` is complete on this rank (RNG states included)."""

    def close(self) -> None:
        """Release what the part holds (its slots' mappings)."""
