"""Getting a ``State`` back: the restore every rank agrees on, and what a re-form rolls back to.

``restore()`` is collective: each rank reports what it can read (memory snapshots and RNG files on
its node, complete-looking checkpoints, the commit its own objects hold under ``et.run``), one
``all_gather`` shares the reports, every rank runs the same pure function on them (``plan.py``) and
loads the agreed step from where it is: its own objects (``live``), its node's memory, a peer (the
agent's snapshot server when every rank has one, else a broadcast over the process group) or disk.
A sharded state (FSDP2) has its own restore (``sharded/core.py``).

Under ``elastrun.train.run`` each commit also remembers, without copying parameters, what the
process's own objects can be rolled back to (:class:`Live`): the step, this rank's RNG states and
copies of what changes outside ``optimizer.step()``.

:class:`Restorer` is the half of :class:`~elastrun.train.state.State` that does this; ``State``
holds the objects and the commit path.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from elastrun.train import dist as edist
from elastrun.train import notes, reform, rng, snapclient
from elastrun.train.blob import Receipt, check, copy_into, flatten, landing, make_header, materialize
from elastrun.train.checkpoint import CheckpointCorrupt, CheckpointDir, DiskCandidate
from elastrun.train.plan import Plan, Report, make_plan
from elastrun.train.snapshot import MemorySnapshots, SlotInfo, parse_meta

if TYPE_CHECKING:
    from elastrun.observe.steplog import StepLog
    from elastrun.train.background import BackgroundJob
    from elastrun.train.pipeline import SnapshotPipeline
    from elastrun.train.sampler import ElasticSampler

@dataclass
class Live:
    """What a process's own objects can be rolled back to in a re-form (see ``Restorer._live``)."""

    step: int
    world_size: int
    rng: bytes
    aux: dict[str, Any]


#: ``State._fetch``'s answer for a rank whose own objects already hold the planned step.
USE_LIVE = object()


class Restorer:
    """``State``'s restore and live-rollback half (a mixin: ``State`` provides the attributes below)."""

    step: int
    last_restore: str | None
    _model: torch.nn.Module | None
    _optimizer: torch.optim.Optimizer | None
    _sampler: ElasticSampler | None
    _extras: dict[str, Any]
    _mem: MemorySnapshots
    _ckpt: CheckpointDir | None
    _rank: int
    _world_size: int
    _live: Live | None
    _dirty: bool
    _sharded: Any
    _persister: BackgroundJob
    _pipe: SnapshotPipeline
    _steplog: StepLog
    _abandon: threading.Event
    _landed: bool  # a transfer of this restore has written into the model's own tensors
    last_transfer: dict[str, Any] | None
    # and the methods _module(), _tree(), _tree_extras(), _apply(tree), _drain()

    # -- what a re-form rolls back to (elastrun.train.run) ------------------------------------------
    def _aux(self) -> dict[str, Any]:
        """Copies of the committed state that changes outside ``optimizer.step()``."""
        module = self._module()
        return {
            "sampler": self._sampler.state_dict() if self._sampler is not None else None,
            "extras": copy.deepcopy(self._tree_extras()),
            "buffers": [b.detach().clone() for b in module.buffers()] if module is not None else [],
        }

    def _remember_live(self, payload: bytes) -> None:
        if reform.active():
            self._live = Live(self.step, self._world_size, payload, self._aux())
            self._dirty = False

    def live_step(self) -> int | None:
        """The committed step this process's objects can roll back to without a copy, or None (torn)."""
        if self._live is None or self._dirty:
            return None
        return self._live.step

    def _rollback_live(self) -> None:
        """Put the live objects back to the remembered commit (parameters and optimizer state are
        untouched since: only the copies of everything else are applied)."""
        live = self._live
        assert live is not None
        if self._sampler is not None and live.aux["sampler"] is not None:
            self._sampler.load_state_dict(live.aux["sampler"])
        for k, v in copy.deepcopy(live.aux["extras"]).items():
            if k in self._extras and hasattr(self._extras[k], "load_state_dict"):
                self._extras[k].load_state_dict(v)
            else:
                self._extras[k] = v
        module = self._module()
        if module is not None:
            with torch.no_grad():
                for b, saved in zip(module.buffers(), live.aux["buffers"], strict=True):
                    b.copy_(saved)
        self.step = live.step


    # -- restore ---------------------------------------------------------------------------------
    def _report(self) -> tuple[Report, dict[int, SlotInfo], dict[int, DiskCandidate]]:
        slots = {i.step: i for i in self._mem.scan()}
        disk = {c.step: c for c in self._ckpt.scan(warn=self._rank == 0) if c.kind != "dcp"} if self._ckpt else {}
        mem_rng = self._mem.scan_rng()
        live = self.live_step()
        if live is not None:  # this rank's own RNG states of its live step, held in memory
            mem_rng[self._rank] = sorted({*mem_rng.get(self._rank, ()), live})
        report = Report(
            rank=self._rank,
            mem={s: i.world_size for s, i in slots.items()},
            mem_rng=mem_rng,
            disk={s: c.world_size for s, c in disk.items()},
            disk_rng={s: c.rng_ranks for s, c in disk.items()},
            live={live: self._live.world_size} if live is not None and self._live is not None else {},
            server=snapclient.my_server(),
            mem_ids={s: (f"shared.{i.slot}", i.meta_crc) for s, i in slots.items()},
        )
        return report, slots, disk

    def restore(self) -> str | None:
        """Load the newest saved state all ranks agree on; returns its source or None (fresh start).

        ``"memory"``: each node's own snapshot; ``"peer"``: sent by a rank whose node has it;
        ``"disk"``: the checkpoint directory; ``"live"`` (after an in-process re-form under
        ``elastrun.train.run`` only): this process's own objects, rolled back without a copy.
        Collective: every rank must call it.
        """
        began = time.time()
        with reform.section():
            self.last_restore = self._restore()
            self._steplog.restored(began, self.step, self.last_restore)
        return self.last_restore

    def _restore(self) -> str | None:
        self.last_transfer = None
        if self._sharded is not None:  # issue 24
            source = self._sharded.restore()
            self.last_transfer = self._sharded.transfer
            return source
        if self._model is None and self._optimizer is None and reform.active():
            return None  # issue 24: under et.run a State without a model waits for attach() (no collective)
        self._drain()
        self._abandon.set()
        try:
            self._persister.wait()
        finally:
            self._abandon.clear()
        report, slots, disk = self._report()
        reports = edist.all_gather(report)
        excluded: set[tuple] = set()
        landed = False
        for _ in range(4 * (len(slots) + len(disk)) + 8):
            plan = make_plan(reports, excluded)
            if plan is None:
                if landed:  # every rank knows it (gathered below): none starts fresh beside a torn one
                    raise RuntimeError(
                        "State.restore(): a transfer that had begun writing into a rank's model failed part-way and "
                        "no other copy of a committed step is left: that model is neither fresh nor restored, so "
                        "the restore stops here (restart the job: it starts fresh)")
                return None
            self._landed = False
            loaded, failed = self._fetch(plan, slots, disk, reports, excluded)
            outcomes = edist.all_gather((failed, self._landed))
            bad = {f for f, _ in outcomes if f is not None}
            if bad:  # the copies that could not be read are left out of the next plan
                excluded |= bad
                landed = landed or any(lnd for _, lnd in outcomes)  # written into, not applied
                continue
            if loaded is USE_LIVE:
                self._rollback_live()
                source = "live"
            else:
                self._apply(loaded())
                # What this process remembered of its own last commit is not what it now holds (the
                # plan chose another step): a re-form before the next commit must not roll back to it.
                self._live = None
                source = "memory" if plan.source == "live" else plan.source
            self._restore_rng(plan, disk)
            return source
        raise RuntimeError("State.restore(): no saved state could be loaded on every rank")

    def _live_bytes(self) -> tuple[dict[str, Any], torch.Tensor]:
        """Header and bytes of the live objects (rolled back to their commit first), to send to peers."""
        self._rollback_live()
        flat = flatten(self._tree())
        header = make_header(flat, step=self.step, world_size=self._live.world_size if self._live else 0)
        data = torch.empty(flat.nbytes, dtype=torch.uint8)
        copy_into(flat, data)
        return header, data

    def _landing(self, header: dict[str, Any], device: bool = False) -> dict[int, torch.Tensor]:
        """The entries of ``header`` that can land straight in the model's own parameters and
        buffers (their pages are already touched: no fresh memory, no second copy); on a GPU too
        with ``device`` (``gpu/load.py``)."""
        module = self._module()
        if module is None:
            return {}
        return landing(header, "model", module.state_dict(), device)

    def _materializer(self, header: dict[str, Any], source: Any) -> Any:
        """A function building the state tree of ``header`` from ``source`` (a slot file's path or a
        host buffer): for a GPU state, straight onto the GPU at the card's speed (``gpu/load.py``)."""
        dev = self._pipe.device
        if dev is None or "devices" not in header:
            data = self._mem.read_path(source, header) if not isinstance(source, torch.Tensor) else source
            return lambda: materialize(header, data, self._landing(header))
        from elastrun.train.gpu import load

        where = torch.device("cuda", getattr(dev, "index", torch.cuda.current_device()))
        return lambda: load.materialize(header, source, self._landing(header, device=True), where)

    def _fetch(self, plan: Plan, slots: dict[int, SlotInfo], disk: dict[int, DiskCandidate],
               reports: list[Report], excluded: set[tuple]) -> tuple[Any, tuple | None]:  # fmt: skip
        """A function giving the state tree of ``plan.step`` on this rank (or ``USE_LIVE``), and
        None; or None and the key of the copy that could not be read (left out of the next plan).
        The tree is built only once every rank has its bytes (a local buffer is copied into the
        model's own tensors then, not before: a plan that fails on another rank leaves this one's
        objects as they were).

        A ``peer`` restore goes through the snapshot servers when every rank has one (each rank
        whose node lacks the step reads it from a node that has it; not collective), else by a
        broadcast from the plan's source rank over the process group (collective)."""
        live = self.live_step() == plan.step
        holders = [r for r in reports if plan.step in r.mem and ("mem", r.rank, plan.step) not in excluded]
        by_server = plan.source == "peer" and bool(holders) and all(r.server for r in reports)
        if plan.source in ("memory", "live") or (by_server and (live or plan.step in slots)):
            if live:
                return USE_LIVE, None
            try:
                info = slots[plan.step]
                check(info.header)
                return self._materializer(info.header, self._mem.data_file(info)), None
            except (OSError, ValueError, KeyError) as e:
                notes.warn(f"memory snapshot of step {plan.step} unreadable on rank {self._rank}: {e}", stacklevel=3)
                return None, ("mem", self._rank, plan.step)
        if by_server:
            return self._from_server(plan, holders)
        return self._broadcast(plan, slots, disk, live)

    def _from_server(self, plan: Plan, holders: list[Report]) -> tuple[Any, tuple | None]:
        """A rank whose node lacks the step reads it from the snapshot server of a node that has
        it (``elastrun/agent/snapserver.py``): the meta, then the bytes, each range straight into
        where it belongs: the model's own parameters when they match (see ``_landing``; a
        transfer that fails part-way then leaves them neither fresh nor restored, which
        ``_restore`` refuses to start from), fresh tensors for the rest."""
        holder = holders[self._rank % len(holders)]
        name, crc = holder.mem_ids[plan.step]
        began = time.perf_counter()
        try:
            key = snapclient.job_key()
            with snapclient.SnapshotClient(holder.server, key) as client:  # type: ignore[arg-type]
                header = parse_meta(client.meta("", name), self._mem.run_id)
            if header is None or header["step"] != plan.step:
                raise ValueError(f"{name} on {holder.server} is not step {plan.step} any more")
            # Not into a live commit's objects (et.run): a failed transfer must not overwrite them.
            receipt = Receipt(header, self._landing(header) if self._live is None else {})
            gets = [snapclient.Get("", name, crc, offset, t.numel(), snapclient.writable(t))
                    for offset, t in receipt.ranges]  # fmt: skip
            self._landed = bool(receipt.landed)
            errors = snapclient.fetch(holder.server, key, gets)  # type: ignore[arg-type]
            error = next((e for e in errors if e is not None), None)
            if error is not None:
                raise ValueError(error)
        except (OSError, ValueError) as e:
            notes.warn(f"step {plan.step} unreadable from rank {holder.rank}'s node ({holder.server}): {e}",
                       stacklevel=4)  # fmt: skip
            return None, ("mem", holder.rank, plan.step)
        self.last_transfer = {"via": "server", "bytes": header["nbytes"], "seconds": time.perf_counter() - began,
                              "in_place": sum(header["entries"][i][3] for i in receipt.landed)}  # fmt: skip
        return receipt.tree, None

    def _broadcast(self, plan: Plan, slots: dict[int, SlotInfo], disk: dict[int, DiskCandidate],
                   live: bool) -> tuple[Any, tuple | None]:  # fmt: skip
        """The lowest rank that has the step (in memory, live, or on disk) sends it to every rank."""
        header: Any = None
        data = None
        if self._rank == plan.src_rank:
            try:
                if plan.source == "peer" and live:
                    header, data = self._live_bytes()
                elif plan.source == "peer":
                    info = slots[plan.step]
                    header, data = info.header, self._mem.read(info)
                else:
                    header, data = self._ckpt.load_shared(disk[plan.step])  # type: ignore[union-attr]
            except CheckpointCorrupt as e:
                notes.warn(f"{e}; using an older checkpoint", stacklevel=3)
                header = {"error": str(e)}
            except (OSError, ValueError, KeyError) as e:
                notes.warn(f"step {plan.step} unreadable from {plan.source} on rank {self._rank}: {e}", stacklevel=3)
                header = {"error": str(e)}
        began = time.perf_counter()
        header = edist.broadcast_obj(header, plan.src_rank)  # type: ignore[arg-type]
        if "error" in header:
            return None, ("disk", plan.step) if plan.source == "disk" else ("mem", plan.src_rank, plan.step)
        if data is None:
            data = torch.empty(header["nbytes"], dtype=torch.uint8)
        edist.broadcast_bytes(data, plan.src_rank)  # type: ignore[arg-type]
        if plan.source == "peer" and self._rank != plan.src_rank:
            self.last_transfer = {"via": "group", "bytes": header["nbytes"], "seconds": time.perf_counter() - began}
        if live:
            return USE_LIVE, None  # this rank's own objects already hold the step
        return self._materializer(header, data), None

    def _restore_rng(self, plan: Plan, disk: dict[int, DiskCandidate]) -> None:
        """Gather each rank's RNG state from whoever holds it, then apply (or derive) it."""
        mine: dict[int, bytes] = {}
        live = self._live if self.live_step() == plan.step else None
        for k, holder in plan.rng_holders.items():
            if holder != self._rank:
                continue
            blob = live.rng if live is not None and k == self._rank else self._mem.read_rng(k, plan.step)
            if blob is None and plan.step in disk and self._ckpt is not None:
                blob = self._ckpt.load_rng(disk[plan.step], k)
            if blob is not None:
                mine[k] = blob
        merged: dict[int, bytes] = {}
        for part in edist.all_gather(mine):
            merged.update(part)
        payload = merged.get(self._rank)
        step, rank = plan.step, self._rank
        if payload is None and reform.active():  # derived states, captured for a later re-form
            current = rng.capture()
            rng.derive(step, rank)
            payload = rng.capture()
            rng.apply(current)
        if payload is not None:
            self._remember_live(payload)

        def apply() -> None:
            if payload is not None:
                rng.apply(payload)
            else:
                rng.derive(step, rank)

        # The DataLoader draws a seed from torch's generator whenever an iterator is created.  An
        # uninterrupted run does that at the start of an epoch only, so mid-epoch the restored
        # states are applied after the new iterator has drawn, just before its first batch.
        if self._sampler is not None and self._sampler.position > 0:
            self._sampler.before_first_batch(apply)
        else:
            apply()
