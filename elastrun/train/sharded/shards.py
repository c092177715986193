"""The sharded state (FSDP2: DTensor parameters): the :class:`~elastrun.train.part.Part` for a sharded model.

Under DDP one copy of the replicated state per node is enough; here every rank holds a different
part, so every rank snapshots, persists and restores its own shard:

* ``commit()``: the rank's chunks (parameters, optimizer state, buffers) are copied into its slot
  in node memory (``slots.py``) by the same snapshot pipeline as DDP's (``pipeline.py``: in host
  memory the idle-priority copy, on a GPU the side-stream copy), overlapping the next step; the
  optimizer pre-hook completes it before ``optimizer.step()`` changes them.  Every
  ``checkpoint_every`` commits the slot is also written as this rank's part of a DCP checkpoint
  (``durable.py``), in the background.
* ``restore()``: one ``all_gather`` of what each node holds (``shard_plan.py``), then either every rank
  loads exactly its new shards from the snapshots of the chosen step, wherever they are (its own
  node's memory first, its own or a replica, then a peer's: ``fetch.py``; resharded by DCP's
  planner: ``reader.py``), or all load the step's DCP checkpoint from disk.
* copies in other nodes' memory: at copy steps (decided together at the commit), each rank asks its
  agent to copy its published slot to the next node (``copies.py``).

It works through the ``Core`` and ``Objects`` that ``State`` hands it (``part.py``), as the replicated
state does, and the one restore loop (``restore.py``) drives its restore.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from elastrun.train import dist as edist
from elastrun.train import notes, reform, snapclient
from elastrun.train.blob import Entry as BlobEntry
from elastrun.train.blob import Flattened
from elastrun.train.checkpoint import DiskCandidate
from elastrun.train.part import Core, Loaded, Objects, Part
from elastrun.train.sharded import durable, slots
from elastrun.train.sharded.copies import Copies
from elastrun.train.sharded.destination import Spec, agree, destination, spec_of
from elastrun.train.sharded.layout import (
    Layout,
    Unsupported,
    is_dtensor,
    join,
    lay_out,
    optimizer_positional,
    optimizer_tree,
    param_names,
    refs_of,
    split,
    twins,
    unwrap,
)
from elastrun.train.sharded.reader import entries_of, open_step
from elastrun.train.sharded.shard_plan import ShardPlan, ShardReport, lost, make_plan

FORMAT = "elastrun-shard/1"
#: Stale snapshots (of another world size) are looked for every this many commits.
PRUNE_EVERY = 50


class ShardedPart(Part):
    """The sharded state (FSDP2): made by ``State`` when the model has DTensor parameters."""

    def __init__(self, core: Core, objects: Objects) -> None:
        super().__init__(core, objects)
        self.module = unwrap(objects.model)
        self.optimizer = objects.optimizer
        if self.optimizer is not None and self.module is None:
            raise Unsupported("a sharded optimizer needs its model: pass model= to State too")
        self.names = param_names(self.module, self.optimizer) if self.optimizer is not None else []
        self._slots: slots.ShardSlots | None = None
        self._layout = Layout()
        #: What the last snapshot's layout gave (reused while it does not change): entries as
        #: tuples for the header, and the storage only ``optimizer.step()`` changes.
        self._entries: list[tuple] = []
        self._stable: set[int] = set()
        st = os.stat(core.mem.dir)
        self.node = f"{socket.gethostname()}:{st.st_dev}:{st.st_ino}"
        #: The worker group the model was sharded on; after an in-process re-form (``et.run``) the
        #: model is bound to a destroyed group and must be built again (``State.attach``).
        self.generation = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        self.stale = False
        #: Whether the model came through ``State.attach`` (the et.run shape), not ``State(model=...)``.
        self.attached = False
        #: Copies of the committed shards in other nodes' memory (configured by each restore).
        self.copies = Copies(core.copies)
        core.pipe.writers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # every local rank writes its shard
        self._twins: tuple[int, ...] = (core.rank,)

    # -- what is saved ------------------------------------------------------------------------
    def slots(self) -> slots.ShardSlots:
        """This rank's slots (made again when the rank changed, or after a restore)."""
        core = self.core
        if self._slots is None or self._slots.rank != core.rank:
            self.close()
            self._slots = slots.ShardSlots(core.mem.dir, core.mem.run_id, core.rank)
            self._slots.count = core.mem.count
        return self._slots

    def _reserve(self, nbytes: int) -> None:
        """Make this rank's slots ready in the background (``slotmem.py``): a shard that is new or
        bigger would otherwise fault its pages in, one by one, inside its first commits."""
        self.slots().prepare(nbytes, self.core.pipe.device)

    def _shard_bytes(self) -> int:
        """The size of this rank's next snapshot file (its chunks of the model and optimizer state)."""
        _, tensors = split(self.tree())
        return lay_out(tensors)[2]

    def close(self) -> None:
        """Unmap this rank's slots (``State.close()``, or a model replaced by ``State.attach()``)."""
        if self._slots is not None:
            self._slots.close()
            self._slots = None

    def tree(self) -> dict[str, Any]:
        """The state as DCP names it: ``model.<fqn>``, ``optimizer.state.<fqn>.<name>``, ..."""
        o = self.objects
        return {
            "model": self.module.state_dict(keep_vars=True) if self.module is not None else {},
            "optimizer": optimizer_tree(self.optimizer, self.names) if self.optimizer is not None else {},
            "elastrun": {
                "step": o.step,
                "sampler": o.sampler.state_dict() if o.sampler is not None else None,
                "extras": o.tree_extras(),
            },
        }

    def _stable_ptrs(self) -> set[int]:
        """Storage that only ``optimizer.step()`` changes (copied in the background)."""
        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if is_dtensor(t) else t

        ptrs = set()
        if self.module is not None:
            ptrs.update(local(p).data_ptr() for p in self.module.parameters())
        if self.optimizer is not None:
            for s in self.optimizer.state.values():
                ptrs.update(local(v).data_ptr() for v in s.values() if isinstance(v, torch.Tensor))
        return ptrs

    # -- commit ----------------------------------------------------------------------------------
    def copying(self) -> bool:
        return self.copies.busy()

    def commit(self, durable: bool, stop: bool, due: bool, background: bool, copy_step: bool) -> None:
        """Every rank snapshots and persists its own shard; ``copy_step``: no rank's last copy to
        another node is still going (all-reduced), so this step's snapshot is copied."""
        if self.stale:
            raise RuntimeError(
                "State: the sharded model was built on the process group before the last re-form; under "
                "et.run build and shard it inside fn and hand it over with state.attach(model, optimizer)"
            )
        if durable or stop or due:
            self.snapshot(durable, stop, background, copy_step)

    def snapshot(self, persist: bool, stop: bool, background: bool, copy_step: bool = False) -> None:
        """Copy this rank's shard of ``objects.step`` into a memory slot (and queue its checkpoint)."""
        core, step = self.core, self.objects.step
        skeleton, tensors = split(self.tree())
        entries, locals_, nbytes, changed = self._layout(tensors)
        if changed:
            self._entries = [dataclasses.astuple(e) for e in entries]
            self._stable = self._stable_ptrs()
            self._twins = twins(tensors.values(), core.rank)
            self._reserve(nbytes)
        flat = Flattened(None, locals_, [BlobEntry(e.dtype, e.chunk, e.offset, e.nbytes) for e in entries], nbytes)
        header = {
            "format": FORMAT, "step": step, "world_size": core.world_size, "rank": core.rank, "nbytes": nbytes,
            "entries": self._entries, "twins": self._twins,
            "skeleton": pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL),
        }  # fmt: skip
        mem = self.slots()
        prune = core.local_rank == 0 and step % PRUNE_EVERY == 0
        marked = copy_step and self.copies.mark()

        def published(slot: int, crc: int) -> None:
            if marked:
                self.copies.request(mem, slot, header, crc)
            if persist:
                self._persist(slot, header, must=stop)
            if prune:  # every rank has published step - 2 by now (see slots.prune)
                slots.prune(mem.dir, mem.run_id, header["world_size"], header["step"] - 2)

        failed = self.copies.cancel if marked else (lambda: None)  # a marked step's request will not come
        try:
            written = core.pipe.write(mem, flat, header, self._stable if background else None, published, failed,
                                      force=persist or stop)  # fmt: skip
        except BaseException:  # before the copy began (no slot): the same
            if marked:
                self.copies.cancel()
            raise
        if not written and marked:  # put off (no slot ready yet): no request comes for this step
            self.copies.cancel()

    def _persist(self, slot: int, header: dict[str, Any], must: bool) -> None:
        """Queue this rank's part of the DCP checkpoint of a just-published slot."""
        core = self.core
        assert core.ckpt is not None
        ckpt, mem, step, ws, rank = core.ckpt, self.slots(), header["step"], header["world_size"], header["rank"]
        payload = core.mem.read_rng(rank, step) or b""
        state = pickle.dumps(
            {"skeleton": header["skeleton"], "step": step, "world_size": ws,
             "placements": {e.key: e.placements for e in entries_of(header)}},
            protocol=pickle.HIGHEST_PROTOCOL,
        ) if rank == 0 else b""  # fmt: skip

        def write() -> None:
            try:
                ckpt.write_rng(step, rank, payload)
                durable.write_part(ckpt, header, mem.data_view(slot, header["nbytes"]))
            finally:
                mem.unpin(slot)
            if rank == 0:
                durable.finish(ckpt, step, ws, state, abandoned=core.abandon.is_set)

        mem.pin(slot)
        if not core.pipe.persist(step, must, write):
            mem.unpin(slot)

    def checkpoint(self) -> None:
        """This rank's part of a DCP checkpoint of the last commit, waited for."""
        core, step = self.core, self.objects.step
        core.pipe.drain()
        core.pipe.persister.wait()
        mem = self.slots()
        if mem.written(step) is None:
            self.snapshot(persist=False, stop=False, background=False)  # a step the spacing skipped
        info = mem.written(step)
        if info is None:
            raise RuntimeError(f"no memory snapshot of step {step} to checkpoint; commit() first")
        self._persist(info.slot, info.header, must=True)
        core.pipe.persister.wait()

    # -- restore --------------------------------------------------------------------------------
    def prepare(self) -> Any:
        if reform.active() and os.environ.get("TORCHELASTIC_RESTART_COUNT") != self.generation:
            if not self.attached:
                raise Unsupported(
                    "a sharded model cannot follow an in-process re-form: under et.run build and shard it inside "
                    "fn and hand it to state.attach(model, optimizer) (docs/train.md, Sharded states)"
                )
            self.stale = True  # fn builds the model again on the new group and calls State.attach()
            return self.LATER
        return self.GO

    def report(self) -> ShardReport:
        core = self.core
        shards: dict[tuple[int, int], list[int]] = {}
        found_twins: dict[tuple[int, int], tuple[int, ...]] = {}
        for f in slots.scan_node(core.mem.dir, core.mem.run_id):
            shards.setdefault((f.step, f.world_size), []).append(f.rank)
            if len(f.header.get("twins", ())) > 1:
                found_twins[(f.step, f.rank)] = tuple(f.header["twins"])
        self.disk = {}
        if core.ckpt is not None:
            self.disk = {c.step: c for c in core.ckpt.scan(warn=core.rank == 0) if c.kind == durable.KIND}
        return ShardReport(
            rank=core.rank,
            node=self.node,
            shards={k: sorted(set(v)) for k, v in shards.items()},
            mem_rng=core.mem.scan_rng(),
            disk={s: c.world_size for s, c in self.disk.items()},
            disk_rng={s: c.rng_ranks for s, c in self.disk.items()},
            twins=found_twins,
            server=snapclient.my_server(),
        )

    def begin(self, reports: list[Any]) -> None:
        self.sources = {}
        self.copies.configure(reports, self.core.rank, self.core.mem.dir, self._current_twins())

    def attempts(self, reports: list[Any]) -> int:
        return 4 * sum(len(r.shards) for r in reports) + len(self.disk) + 8

    def plan(self, reports: list[Any], excluded: set[tuple]) -> ShardPlan | None:
        plan = make_plan(reports, excluded)
        if plan is not None and plan.lost is not None and self.core.rank == 0:
            where = f"the checkpoint {self.disk[plan.step].dir}" if plan.source == "disk" else "memory"
            notes.warn(f"{_lost_text(plan.lost)}: restoring step {plan.step} from {where} "
                       f"({plan.lost[0] - plan.step} step(s) lost)", stacklevel=4)  # fmt: skip
        return plan

    def nothing(self, reports: list[Any], excluded: set[tuple], wrote: bool) -> None:
        gone = lost(reports, excluded, None)
        if gone is not None and self.core.rank == 0:
            notes.warn(f"{_lost_text(gone)} and there is no checkpoint: starting afresh", stacklevel=4)

    def load(self, plan: ShardPlan, reports: list[Any], excluded: set[tuple]) -> Loaded:
        """Every rank loads exactly its new shards of the plan's step (collective: DCP's planner
        reshards, ``reader.py`` reads); the loaded tree is applied by the returned function."""
        if plan.source == "memory":
            return self._from_memory(plan, reports)
        return self._from_disk(plan, self.disk[plan.step])

    def restored(self, plan: Any) -> None:
        core = self.core
        slots.drop_newer(core.mem.dir, core.mem.run_id, plan.step)  # an abandoned timeline
        self.close()
        self._reserve(self._shard_bytes())

    def _current_twins(self) -> tuple[int, ...]:
        """This rank's twins on the current mesh (HSDP: the same chunks in another replica group)."""
        if self.module is None:
            return (self.core.rank,)
        return twins(self.module.parameters(), self.core.rank)

    def _from_memory(self, plan: ShardPlan, reports: list[ShardReport]) -> Loaded:
        core, step = self.core, plan.step
        error: BaseException | None = None
        try:  # collective, and the same answer on every rank
            reader, headers, missing = open_step(core.mem.dir, core.mem.run_id, "shard", self.node, step,
                                                 plan.saved_world_size, plan.holders)  # fmt: skip
        except ValueError as e:  # the metas disagree (every rank sees the same ones)
            reader, headers, missing = None, {}, {("mem", self.node, step, old) for old in plan.holders}
            error = e
        if reader is None:
            if error is not None and core.rank == 0:
                notes.warn(f"memory snapshots of step {step} not used: {error}", stacklevel=4)
            return None, missing, False
        try:
            specs = {}
            for h in headers.values():
                for e in entries_of(h):
                    specs.setdefault(e.key, spec_of(e))
            skeleton = pickle.loads(headers[min(headers)]["skeleton"])
            dest = destination(self.module, self.optimizer, specs)
        except (Unsupported, ValueError, KeyError) as e:
            error = e
        agree(error)
        try:
            dcp.load(dest, storage_reader=reader, planner=DefaultLoadPlanner())
            error = None
        except Exception as e:  # every rank fails together (DCP gathers the read results)
            error = e
        failed = {("mem", reports[holder].node, step, ref.rank) for holder, ref in reader.failed}
        failed = {f for part in edist.all_gather(failed) for f in part}
        if failed:
            if core.rank == 0:
                notes.warn(f"memory snapshots unreadable, not used: {sorted(failed)}", stacklevel=4)
            return None, failed, False
        if error is not None:
            raise error

        def apply() -> str:
            self._apply(skeleton, dest)
            self.sources = dict(reader.sources)
            moved = getattr(reader.transport, "received", None)
            if moved:
                self.transfer = {"via": "server", "bytes": moved, "seconds": reader.transport.seconds}  # type: ignore[attr-defined]
            return "peer" if reader.fetched else "memory"

        return apply, set(), False

    def _from_disk(self, plan: ShardPlan, cand: DiskCandidate) -> Loaded:
        core = self.core
        bad = [b for part in edist.all_gather(durable.verify(cand, core.rank, core.world_size)) for b in part]
        if bad:
            if core.rank == 0:
                for b in bad:
                    notes.warn(f"{b}; using an older checkpoint", stacklevel=4)
            return None, {("disk", plan.step)}, False
        error: BaseException | None = None
        try:
            saved = durable.read_state(cand)
            metadata = durable.read_metadata(cand.dir)
            specs = {
                key: Spec(meta.properties.dtype, tuple(meta.size), saved["placements"].get(key, "?"), "cpu")
                for key, meta in metadata.state_dict_metadata.items()
                if isinstance(meta, TensorStorageMetadata)
            }
            skeleton = pickle.loads(saved["skeleton"])
            refs = refs_of(skeleton)
            if refs - specs.keys():
                raise ValueError(f"checkpoint {cand.dir} lacks {sorted(refs - specs.keys())[:3]}")
            dest = destination(self.module, self.optimizer, {k: v for k, v in specs.items() if k in refs})
        except (Unsupported, ValueError, KeyError, OSError) as e:
            error = e
        agree(error)
        try:
            dcp.load(join(skeleton, dest), checkpoint_id=cand.dir)
        except Exception as e:  # every rank fails together (DCP gathers the read results)
            if core.rank == 0:
                notes.warn(f"checkpoint {cand.dir} could not be loaded ({e}); using an older one", stacklevel=4)
            return None, {("disk", plan.step)}, False

        def apply() -> str:
            self._apply(skeleton, dest)
            self.sources = {old: "disk" for old in range(plan.saved_world_size)}
            return "disk"

        return apply, set(), False

    def _apply(self, skeleton: Any, dest: dict[str, torch.Tensor]) -> None:
        """Put the loaded tree into the live objects (the model's tensors were loaded in place)."""
        tree = join(skeleton, dest)
        own = tree["elastrun"]
        optimizer = optimizer_positional(tree["optimizer"], self.names) if self.optimizer is not None else None
        self.objects.apply({"step": own["step"], "model": None, "optimizer": optimizer,
                            "sampler": own["sampler"], "extras": own["extras"]})  # fmt: skip


def _lost_text(gone: tuple[int, list[int]]) -> str:
    step, ranks = gone
    return (f"step {step} is not complete in any surviving node's memory: the shards of rank(s) "
            f"{', '.join(map(str, ranks))} of step {step} were only on nodes that are gone (with their copies)")
