"""State: commit a training step to memory every step, to disk every N steps, restore after a crash.

``commit()`` on the training thread advances the sampler, captures this rank's RNG states (a few
kB written to the node's snapshot directory) and hands the step to the state's *part*
(``part.py``): the replicated one (``replicated.py``: local rank 0 snapshots the whole state) or the
sharded one (``sharded/shards.py``: every rank its shard).  Snapshots go through the one snapshot
pipeline (``pipeline.py``), every ``snapshot_every`` commits: by default every one for a state in
host memory, and spaced by what they cost for one on a GPU (``spacing.py``).  The copy overlaps the
next step's forward and backward: parameters and optimizer state only change inside
``optimizer.step()``, whose pre-hook waits for the copy first.  Every ``checkpoint_every`` commits
the published slot is also written to ``checkpoint_dir`` on a helper thread.

``restore()`` is collective: the one restore loop (``restore.py``) asks the part what each rank can
read, agrees on one step and source, loads it, and gives every rank its own RNG states.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from elastrun.shared import steplog
from elastrun.train import dist as edist
from elastrun.train import notes, reform, restore, rng, sharded, snapdir
from elastrun.train.checkpoint import CheckpointDir
from elastrun.train.part import Core, Objects, Part
from elastrun.train.pipeline import SnapshotPipeline
from elastrun.train.reformable import Reformable
from elastrun.train.replicated import ReplicatedPart
from elastrun.train.sampler import ElasticSampler
from elastrun.train.snapshot import RNG_KEEP, MemorySnapshots, slots_needed
from elastrun.worker.heartbeat import heartbeat

_RESERVED = {"step", "commit", "restore", "checkpoint", "flush", "close", "extras", "preempted", "last_restore",
             "live_step", "rebind", "restored_from", "last_transfer", "attach", "load_dcp", "copied_step"}


class State(Reformable):
    """Everything a training job must get back after a crash, a restart or a resize.

    ``model`` (plain or DDP-wrapped), ``optimizer`` and ``sampler`` are saved with their
    ``state_dict``; ``extras`` are other objects with ``state_dict``/``load_state_dict`` or plain
    picklable values, readable and writable as attributes (``state.best_loss = 0.1``).  Model,
    optimizer, sampler and extras must be the same on every rank (data parallelism); RNG states
    are saved per rank.  ``checkpoint_every`` commits (0: never) a durable checkpoint goes to
    ``checkpoint_dir``, keeping the newest ``keep``.  ``snapshot_every=k`` copies the state to node
    memory every k commits only: 1/k of the copy's cost, but a crash may then redo up to k-1 steps
    (checkpoint steps and pre-emption are always snapshotted).  By default (None) k is 1 for a state
    in host memory, and for a state on a GPU the smallest k that keeps snapshots within 5 % of the
    training time, from their measured cost (``spacing.py``; said once on the console).
    ``snapshot_dir`` overrides the node-local memory directory (default: ``ELASTRUN_SNAPSHOT_DIR``
    from the elastrun agent).
    ``async_snapshot=False`` copies on the training thread (for code that changes parameters
    outside ``optimizer.step()``).  ``handle_signals`` installs the SIGTERM pre-emption handler.
    ``copies`` (sharded states): how many nodes' memory holds each committed shard while the job
    has that many nodes (2: the rank's own node and the next one; 1: no copies elsewhere).
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: ElasticSampler | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 0,
        keep: int = 3,
        snapshot_every: int | None = None,
        snapshot_dir: str | Path | None = None,
        async_snapshot: bool = True,
        handle_signals: bool = True,
        copies: int = 2,
        **extras: Any,
    ) -> None:
        bad = _RESERVED & extras.keys()
        if bad:
            raise ValueError(f"State extras cannot be named {sorted(bad)}: those are State's own attributes")
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        if copies < 1:
            raise ValueError(f"copies must be >= 1 (1: no copies in other nodes' memory), got {copies}")
        if snapshot_every is not None and snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1 (1: every commit; None: chosen), got {snapshot_every}")
        if checkpoint_every and checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir")
        if sampler is not None and not hasattr(sampler, "advance"):
            raise TypeError("sampler must be an elastrun.train.ElasticSampler (it needs advance())")
        objects = Objects(model, optimizer, sampler, dict(extras))
        object.__setattr__(self, "_objects", objects)
        object.__setattr__(self, "_extras", objects.extras)
        ckpt = CheckpointDir(checkpoint_dir, keep) if checkpoint_dir is not None else None
        snap_dir, self._owns_snap_dir = snapdir.snapshot_dir(snapshot_dir)
        mem = MemorySnapshots(snap_dir, os.environ.get("TORCHELASTIC_RUN_ID", "local"))
        mem.count = slots_needed(checkpoints=ckpt is not None)
        self._core = Core(mem, ckpt, SnapshotPipeline(snapshot_every), copies)
        self._core.rebind()
        if checkpoint_dir is not None and self._core.rank == 0 and self._core.local_rank != 0:
            raise RuntimeError("elastrun.train expects global rank 0 to be local rank 0 of its node")
        self._every = checkpoint_every
        self._async_snapshot = async_snapshot
        self._part: Part = self._part_for()
        self._flag_scratch: list[torch.Tensor] = []
        #: True once this process got SIGTERM; commit() then checkpoints and exits.
        self.preempted = False
        #: What the last ``restore()`` returned on this rank (None: nothing restored yet, or a fresh start).
        self.last_restore: str | None = None
        #: What the last restore moved from other nodes: ``{"via": "server" | "group", "bytes", "seconds"}``.
        self.last_transfer: dict[str, Any] | None = None
        self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step) if optimizer else None
        self._steplog = steplog.writer()  # when each step ran and was committed, for goodput
        self._pipe.on_spacing = lambda every, line: self._steplog.spacing(every, self._pipe.meter)
        if handle_signals:
            self._install_signal_handler()
        atexit.register(self.close)

    def _part_for(self) -> Part:
        """The part that fits the objects (sharded for DTensor parameters), on their device."""
        o = self._objects
        sample = list(o.model.parameters())[:1] if o.model is not None else []
        if o.optimizer is not None:
            sample += [p for g in o.optimizer.param_groups for p in g["params"]][:1]
        self._pipe.use(sample)  # where the tensors live decides how snapshots are copied
        self._async = self._async_snapshot and o.optimizer is not None
        return sharded.part_of(self._core, o) or ReplicatedPart(self._core, o)

    # -- the objects and where this rank is ----------------------------------------------------
    @property
    def step(self) -> int:  # type: ignore[override]
        """The last committed (or restored) step."""
        return self._objects.step

    @step.setter
    def step(self, value: int) -> None:
        self._objects.step = value

    @property
    def _model(self) -> torch.nn.Module | None:
        return self._objects.model

    @property
    def _optimizer(self) -> torch.optim.Optimizer | None:
        return self._objects.optimizer

    @property
    def _pipe(self) -> SnapshotPipeline:
        return self._core.pipe

    @property
    def _mem(self) -> MemorySnapshots:
        return self._core.mem

    @property
    def _persister(self) -> Any:
        return self._core.pipe.persister

    @property
    def _rank(self) -> int:
        return self._core.rank

    @property
    def _world_size(self) -> int:
        return self._core.world_size

    @property
    def _sharded(self) -> Any:
        """The sharded part, or None (a replicated state)."""
        return None if isinstance(self._part, ReplicatedPart) else self._part

    # -- extras as attributes -------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        extras = self.__dict__.get("_extras", {})
        if name in extras:
            return extras[name]
        raise AttributeError(f"State has no attribute or extra named {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__.get("_extras", {}):
            self._extras[name] = value
        else:
            object.__setattr__(self, name, value)

    @property
    def extras(self) -> dict[str, Any]:
        return self._extras

    @property
    def restored_from(self) -> dict[int, str]:
        """Sharded states, after a restore: old rank -> where this rank read that rank's shard from
        (``memory``: its node's own file, ``replica``: its node's copy of another node's file,
        ``peer`` / ``peer replica``: another node's, ``disk``)."""
        return dict(self._part.sources)

    @property
    def copied_step(self) -> int | None:
        """Sharded states: the newest step of this rank whose copy into another node's memory
        finished (a step is committed against the loss of a node once every rank's is), or None."""
        part = self._sharded
        return part.copies.done() if part is not None else None

    # -- commit --------------------------------------------------------------------------------
    def _before_optimizer_step(self, *_: Any) -> None:
        with reform.section():
            self._pipe.before_step()  # the parameters are about to change: the snapshot must hold the old ones
        self._objects.dirty = True

    def rebind(self) -> None:
        """Take the rank and world size of the new process group (after a re-form)."""
        self._core.rebind()
        self._pipe.reset()

    def live_step(self) -> int | None:
        """The committed step this process's objects can roll back to without a copy, or None (torn)."""
        return self._objects.live_step()

    def commit(self) -> None:
        """Record that one training step is complete (call once per batch, after optimizer.step()).

        Cheap on the training thread; on pre-emption (SIGTERM) it makes a durable checkpoint of
        this step on every rank and then exits this process with status 0.  Under ``et.run`` a
        re-form for a join (or for a pre-empted peer) leaves the training function at the end of a
        commit, so make it the step's last statement.
        """
        entered = time.time()
        with reform.section():
            self._commit(entered)
            self._steplog.step(self.step, entered)  # inside: a re-form raised on leaving must not lose it

    def _commit(self, entered: float) -> None:
        core, pipe = self._core, self._pipe
        pipe.settle()
        if self._objects.sampler is not None:
            self._objects.sampler.advance()
        self.step += 1
        heartbeat()  # progress for the agent's hang and crash-loop detection
        pipe.mark_step()
        unready, every = pipe.propose()
        flags = (self.preempted, self._part.copying(), unready, every, reform.vote())
        stop, copying, unready, every, leave = edist.maxima(flags, self._flag_scratch)  # one tiny all-reduce
        rng_state = rng.capture()
        core.mem.write_rng(core.rank, self.step, rng_state, keep=pipe.kept)
        if core.local_rank == 0 and self.step % 100 == 0:
            core.mem.prune_rng(min([self.step - 2 * RNG_KEEP, *pipe.kept]))
        durable = core.ckpt is not None and bool(stop or (self._every > 0 and self.step % self._every == 0))
        due = pipe.due(self.step, every, bool(unready))
        if durable or stop:
            pipe.decided(self.step)
        self._part.commit(durable, bool(stop), due, self._async, copy_step=not copying)
        if stop:
            pipe.drain()
            pipe.persister.wait()  # the checkpoint the published snapshot queued
            if self.preempted:
                self._steplog.step(self.step, entered)  # committed and checkpointed: goodput counts it
                raise SystemExit(0)
        self._objects.remember_live(rng_state, core.world_size)
        # Some rank is asked to pause (a join), or was pre-empted and exits: the others leave here, in step.
        reform.committed(self.step, "a node joins" if leave else "a rank was pre-empted" if stop else None)

    def checkpoint(self) -> None:
        """Write a durable checkpoint of the last committed step now and wait for it (all ranks
        must call it, e.g. at the end of training)."""
        if self._core.ckpt is None:
            raise RuntimeError("State.checkpoint() needs a checkpoint_dir")
        began = time.time()
        self._part.checkpoint()
        self._steplog.blocked(began)

    def flush(self) -> None:
        """Block until the last commit's memory snapshot (and any durable checkpoint) is written."""
        began = time.time()
        self._pipe.drain()
        self._persister.wait()
        self._steplog.blocked(began)

    # -- restore -------------------------------------------------------------------------------
    def restore(self) -> str | None:
        """Load the newest saved state all ranks agree on; returns its source or None (fresh start).

        ``"memory"``: each node's own snapshot; ``"peer"``: sent by (or read from) a node that has
        it; ``"disk"``: the checkpoint directory; ``"live"`` (after an in-process re-form under
        ``elastrun.train.run`` only): this process's own objects, rolled back without a copy.
        Collective: every rank must call it.
        """
        began = time.time()
        with reform.section():
            source = restore.run(self._core, self._objects, self._part)
            later = source is Part.LATER
            self.last_restore = None if later else source
            self.last_transfer = self._part.transfer
            if not later:  # else attach() restores, and records it: a record here would read as a fresh start
                self._steplog.restored(began, self.step, self.last_restore)
        return self.last_restore

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str | None:
        """Take a model (and optimizer) built after this State, and load this rank's part of the last
        commit into them; returns what :meth:`restore` returns.  Collective.  Under ``et.run`` a
        sharded model is built and sharded on the current group inside ``fn`` and handed over here
        on every call (docs/train.md, "Sharded states")."""
        # One section: a re-form's pause arriving in here is raised after it, never between the model
        # and its part (a State left with the one and not the other would take the replicated restore
        # on this rank and the sharded one on the others: mismatched collectives).
        with reform.section():
            if self._hook is not None:
                self._hook.remove()
            self._objects.model, self._objects.optimizer = model, optimizer
            self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step) if optimizer else None
            self._part.close()
            self._part = self._part_for()
            if self._sharded is not None:
                self._sharded.attached = True
        return self.restore()

    def load_dcp(self, checkpoint_id: str | os.PathLike) -> None:
        """Load the model and optimizer from a DCP checkpoint (``dcp.save`` of ``{"model": ...,
        "optimizer": get_optimizer_state_dict(...)}``, e.g. torchtitan's), at this world size.
        Collective.  For a job's first start: ``if state.restore() is None: state.load_dcp(path)``."""
        from elastrun.train.sharded.destination import load_dcp
        from elastrun.train.sharded.shards import ShardedPart

        part = self._sharded or ShardedPart(self._core, self._objects)
        load_dcp(part, checkpoint_id)

    # -- pre-emption ------------------------------------------------------------------------------
    def _install_signal_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            notes.warn("State created off the main thread: SIGTERM pre-emption handling disabled", stacklevel=3)
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            self.preempted = True
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)

    # -- shutdown ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Let background writes finish (bounded) and release resources; called at exit too."""
        try:
            self._pipe.before_step()
        except RuntimeError as e:
            notes.warn(str(e), stacklevel=2)
        for job in (self._pipe, self._persister):
            try:
                job.close(timeout=120)
            except RuntimeError as e:
                notes.warn(str(e), stacklevel=2)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._mem.close()
        self._part.close()
        if self._owns_snap_dir:
            shutil.rmtree(self._mem.dir, ignore_errors=True)
            self._owns_snap_dir = False
