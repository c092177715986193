"""State: commit a training step to memory every step, to disk every N steps, restore after a crash.

``commit()`` on the training thread advances the sampler, captures this rank's RNG states (a few
kB written to the node's snapshot directory) and, on local rank 0 (every ``snapshot_every``
commits: by default every one for a state in host memory, and spaced by what they cost for one on
a GPU, see ``spacing.py``), hands the replicated state (model parameters and buffers, optimizer
state, sampler position, extras) to the snapshot pipeline (``pipeline.py``), which copies it into a
memory snapshot slot while the next step's forward and backward run: parameters and optimizer
state only change inside ``optimizer.step()``, whose pre-hook waits for the copy first.

Every ``checkpoint_every`` commits the slot is also written to ``checkpoint_dir`` by rank 0 on a
second helper thread while every rank writes its RNG file there (see ``checkpoint.py``).

``restore()`` is collective: all ranks report what they can read, agree on one step and source
(``plan.py``), and end with identical replicated state and their own RNG states: that half is
``restore.py`` (:class:`~elastrun.train.restore.Restorer`).  A sharded model's snapshots, checkpoints
and restores are ``sharded/``'s.
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

from elastrun.inworker.heartbeat import heartbeat
from elastrun.observe import steplog
from elastrun.train import dist as edist
from elastrun.train import notes, reform, rng, sharded, snapdir
from elastrun.train.background import BackgroundJob
from elastrun.train.blob import flatten, make_header
from elastrun.train.checkpoint import CheckpointDir
from elastrun.train.pipeline import SnapshotPipeline
from elastrun.train.reformable import Reformable
from elastrun.train.restore import Live, Restorer
from elastrun.train.sampler import ElasticSampler
from elastrun.train.snapshot import RNG_KEEP, MemorySnapshots, slots_needed

_RESERVED = {"step", "commit", "restore", "checkpoint", "flush", "close", "extras", "preempted", "last_restore",
             "live_step", "rebind", "restored_from", "last_transfer", "attach", "load_dcp", "copied_step"}


def _world() -> tuple[int, int, int]:
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), local
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), local


class State(Restorer, Reformable):
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
        object.__setattr__(self, "_extras", dict(extras))
        self._model = model
        self._optimizer = optimizer
        self._sampler = sampler
        self.step = 0
        self._rank, self._world_size, self._local_rank = _world()
        if checkpoint_dir is not None and self._rank == 0 and self._local_rank != 0:
            raise RuntimeError("elastrun.train expects global rank 0 to be local rank 0 of its node")
        self._writes_shared = self._local_rank == 0
        self._every = checkpoint_every
        self._copies = copies
        self._ckpt = CheckpointDir(checkpoint_dir, keep) if checkpoint_dir is not None else None
        snap_dir, self._owns_snap_dir = snapdir.snapshot_dir(snapshot_dir)
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        self._mem = MemorySnapshots(snap_dir, run_id)
        self._mem.count = slots_needed(checkpoints=self._ckpt is not None)
        #: The snapshot pipeline of this rank (commit -> copy -> publish -> persist), both kinds of state.
        self._pipe = SnapshotPipeline(snapshot_every)
        self._pipe.use(self._device_tensors(model, optimizer))
        #: Issue 24: the sharded half (elastrun/train/sharded/) when the model has DTensor parameters.
        self._sharded = sharded.part_of(self, model, optimizer)
        self._async = async_snapshot and optimizer is not None
        self._async_snapshot = async_snapshot
        self._persister = BackgroundJob("elastrun-checkpoint")
        #: Set while a restore waits for the persister: a manifest still waiting for a rank's file
        #: gives up (that rank may be gone; its step stays incomplete) instead of stalling it 120 s.
        self._abandon = threading.Event()
        self._skipped_warned = False
        self._flag_scratch: list[torch.Tensor] = []
        #: What this process's live objects hold (under ``elastrun.train.run`` only): the step of the
        #: last commit or restore, the world size it was committed at, this rank's RNG states then,
        #: and copies of what changes outside ``optimizer.step()`` (sampler, extras, buffers).
        self._live: Live | None = None
        #: True once ``optimizer.step()`` began after that commit: parameters no longer match it.
        self._dirty = False
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
        return dict(self._sharded.sources) if self._sharded is not None else {}

    @property
    def copied_step(self) -> int | None:
        """Sharded states: the newest step of this rank whose copy into another node's memory
        finished (a step is committed against the loss of a node once every rank's is), or None."""
        return self._sharded.copies.done() if self._sharded is not None else None

    # -- what is saved ------------------------------------------------------------------------
    def _module(self) -> torch.nn.Module | None:
        m = self._model
        if isinstance(m, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            return m.module
        return m

    def _tree_extras(self) -> dict[str, Any]:
        return {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in self._extras.items()}

    def _tree(self) -> dict[str, Any]:
        module = self._module()
        return {
            "step": self.step,
            "model": module.state_dict() if module is not None else None,
            "optimizer": self._optimizer.state_dict() if self._optimizer is not None else None,
            "sampler": self._sampler.state_dict() if self._sampler is not None else None,
            "extras": self._tree_extras(),
        }

    def _stable_ptrs(self) -> set[int]:
        """Storage of tensors that only ``optimizer.step()`` changes (safe to copy asynchronously)."""
        ptrs = set()
        module = self._module()
        if module is not None:
            ptrs.update(p.data_ptr() for p in module.parameters())
        if self._optimizer is not None:
            for st in self._optimizer.state.values():
                ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
        return ptrs

    def _apply(self, tree: dict[str, Any]) -> None:
        module = self._module()
        if module is not None and tree["model"] is not None:
            module.load_state_dict(tree["model"])
        if self._optimizer is not None and tree["optimizer"] is not None:
            self._optimizer.load_state_dict(tree["optimizer"])
        if self._sampler is not None and tree["sampler"] is not None:
            self._sampler.load_state_dict(tree["sampler"])
        for k, v in tree["extras"].items():
            if k in self._extras and hasattr(self._extras[k], "load_state_dict"):
                self._extras[k].load_state_dict(v)
            else:
                self._extras[k] = v
        self.step = tree["step"]

    # -- commit --------------------------------------------------------------------------------
    def _before_optimizer_step(self, *_: Any) -> None:
        with reform.section():
            self._pipe.before_step()  # the parameters are about to change: the snapshot must hold the old ones
        self._dirty = True

    def rebind(self) -> None:
        """Take the rank and world size of the new process group (after a re-form)."""
        self._rank, self._world_size, self._local_rank = _world()
        self._pipe.reset()

    @staticmethod
    def _device_tensors(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
        """A few of the state's tensors: where they live decides how snapshots are copied."""
        out: list[torch.Tensor] = list(model.parameters())[:1] if model is not None else []
        if optimizer is not None:
            out += [p for g in optimizer.param_groups for p in g["params"]][:1]
        return out

    def _drain(self) -> None:
        """Wait until the last snapshot is copied and published."""
        self._pipe.drain()

    def commit(self) -> None:
        """Record that one training step is complete (call once per batch, after optimizer.step()).

        Cheap on the training thread; on pre-emption (SIGTERM) it makes a durable checkpoint of
        this step on every rank and then exits this process with status 0.
        """
        entered = time.time()
        with reform.section():
            self._commit()
            self._steplog.step(self.step, entered)  # inside: a re-form raised on leaving must not lose it

    def _commit(self) -> None:
        pipe = self._pipe
        pipe.settle()
        if self._sampler is not None:
            self._sampler.advance()
        self.step += 1
        heartbeat()  # progress for the agent's hang and crash-loop detection
        pipe.mark_step()
        copying = self._sharded is not None and self._sharded.copies.busy()
        unready, every = pipe.propose()
        stop, copying, unready, every = edist.maxima((self.preempted, copying, unready, every), self._flag_scratch)
        stop, copying, unready = bool(stop), bool(copying), bool(unready)
        rng_state = rng.capture()
        self._mem.write_rng(self._rank, self.step, rng_state, keep=pipe.kept)
        if self._writes_shared and self.step % 100 == 0:
            self._mem.prune_rng(min(self.step - 2 * RNG_KEEP, *pipe.kept))
        durable = self._ckpt is not None and (stop or (self._every > 0 and self.step % self._every == 0))
        snap = pipe.due(self.step, every, unready)
        if durable or stop:
            pipe.decided(self.step)
        if self._sharded is not None:  # issue 24: every rank snapshots and persists its own shard
            self._sharded.commit(durable, stop, snap, self._async, copy_step=not copying)
        elif self._writes_shared and (durable or stop or snap):
            self._snapshot(durable and self._rank == 0, stop, self._async)
        if durable and self._rank != 0 and self._sharded is None:
            assert self._ckpt is not None
            ckpt, step, payload = self._ckpt, self.step, self._mem.read_rng(self._rank, self.step)
            self._persister.submit(lambda: ckpt.write_rng(step, self._rank, payload or b""))
        if stop:
            self._drain()
            self._persister.wait()  # on rank 0: the job the writer queued after the snapshot
            if self.preempted:
                raise SystemExit(0)
        self._remember_live(rng_state)

    def _snapshot(self, persist: bool, stop: bool, background: bool) -> None:
        """Hand the replicated state of ``self.step`` to the pipeline (and queue its checkpoint).

        In the background, parameters and optimizer state are copied straight from where they
        live while the next step's forward and backward run (only ``optimizer.step()`` changes
        them, and its pre-hook completes the copy first); every other tensor is cloned now.
        """
        flat = flatten(self._tree())
        header = make_header(flat, step=self.step, world_size=self._world_size)

        def published(slot: int, crc: int) -> None:
            if persist:
                self._persist(slot, header, must=stop)

        self._pipe.write(self._mem, flat, header, self._stable_ptrs() if background else None, published,
                         force=persist or stop)  # fmt: skip

    def _persist_skipped(self, step: int, must: bool, stacklevel: int) -> bool:
        """Whether the checkpoint of ``step`` is skipped: the previous one is still being written and
        nothing (a pre-emption) forces this one.  Warns once per State."""
        if not self._persister.busy() or must:
            return False
        if not self._skipped_warned:
            self._skipped_warned = True
            notes.warn(
                f"checkpoint of step {step} skipped: the previous one is still being written "
                "(raise checkpoint_every); this warning is shown once",
                stacklevel=stacklevel + 1,
            )
        return True

    def _persist(self, slot: int, header: dict[str, Any], must: bool) -> None:
        """Queue the durable checkpoint of a just-published slot (skipped if one is still running)."""
        assert self._ckpt is not None
        if self._persist_skipped(header["step"], must, stacklevel=2):
            return
        ckpt, mem, step, ws, rank = self._ckpt, self._mem, header["step"], header["world_size"], self._rank
        payload = mem.read_rng(rank, step) or b""
        mem.pin(slot)

        def run() -> None:
            try:
                ckpt.write_rng(step, rank, payload)
                shared = ckpt.write_shared(step, header, mem.data_view(slot, header["nbytes"]))
                ckpt.write_manifest(step, ws, shared, abandon=self._abandon)
            finally:
                mem.unpin(slot)

        self._persister.submit(run)

    def checkpoint(self) -> None:
        """Write a durable checkpoint of the last committed step now and wait for it (all ranks
        must call it, e.g. at the end of training)."""
        if self._ckpt is None:
            raise RuntimeError("State.checkpoint() needs a checkpoint_dir")
        began = time.time()
        if self._sharded is not None:  # issue 24
            self._sharded.checkpoint()
            self._steplog.blocked(began)
            return
        self._drain()
        self._persister.wait()
        if self._writes_shared and not any(i.step == self.step for i in self._mem.scan()):
            self._snapshot(persist=False, stop=False, background=False)  # a step snapshot_every skipped
        if self._rank == 0:
            infos = [i for i in self._mem.scan() if i.step == self.step]
            if not infos:
                raise RuntimeError(f"no memory snapshot of step {self.step} to checkpoint; commit() first")
            self._persist(infos[0].slot, infos[0].header, must=True)
        else:
            payload = self._mem.read_rng(self._rank, self.step) or b""
            ckpt, step, rank = self._ckpt, self.step, self._rank
            self._persister.submit(lambda: ckpt.write_rng(step, rank, payload))
        self._persister.wait()
        self._steplog.blocked(began)

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str | None:
        """Issue 24: take a model (and optimizer) built after this State, and load this rank's part
        of the last commit into them; returns what :meth:`restore` returns.  Collective.  Under
        ``et.run`` a sharded model is built and sharded on the current group inside ``fn`` and
        handed over here on every call (docs/train.md, "Sharded states")."""
        # One section: a re-form's pause arriving in here is raised after it, never between the model
        # and its sharded half (a State left with the one and not the other would take the replicated
        # restore on this rank and the sharded one on the others: mismatched collectives).
        with reform.section():
            if self._hook is not None:
                self._hook.remove()
            self._model, self._optimizer = model, optimizer
            self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step) if optimizer else None
            self._async = self._async_snapshot and optimizer is not None
            self._pipe.use(self._device_tensors(model, optimizer))
            if self._sharded is not None:
                self._sharded.close()
            self._sharded = sharded.part_of(self, model, optimizer)
            if self._sharded is not None:
                self._sharded.attached = True
        return self.restore()

    def load_dcp(self, checkpoint_id: str | os.PathLike) -> None:
        """Load the model and optimizer from a DCP checkpoint (``dcp.save`` of ``{"model": ...,
        "optimizer": get_optimizer_state_dict(...)}``, e.g. torchtitan's), at this world size.
        Collective.  For a job's first start: ``if state.restore() is None: state.load_dcp(path)``."""
        from elastrun.train.sharded.core import load_dcp  # issue 24

        load_dcp(self, checkpoint_id)

    def flush(self) -> None:
        """Block until the last commit's memory snapshot (and any durable checkpoint) is written."""
        began = time.time()
        self._drain()
        self._persister.wait()
        self._steplog.blocked(began)

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
                job.wait(timeout=120)
            except RuntimeError as e:
                notes.warn(str(e), stacklevel=2)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._mem.close()
        if self._sharded is not None:  # issue 24
            self._sharded.close()
        if self._owns_snap_dir:
            shutil.rmtree(self._mem.dir, ignore_errors=True)
            self._owns_snap_dir = False
