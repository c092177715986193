"""The replicated state (data parallelism: DDP or plain): one copy per node, the same on every rank.

* **commit**: local rank 0 of each node hands the whole state (model, optimizer, sampler, extras) to
  the snapshot pipeline as one flat buffer (``blob.py``); on checkpoint steps global rank 0 also
  persists it (``checkpoint.py``) while every other rank writes its RNG states beside it.
* **restore**: each rank reports what it can read (memory snapshots and RNG files on its node,
  complete-looking checkpoints, the commit its own objects hold under ``et.run``); the agreed plan
  (``plan.py``) loads the step from where it is: the objects themselves (``live``), the node's memory,
  a peer (the agent's snapshot server when every rank has one, else a broadcast over the group), or
  disk.  A GPU state's bytes go straight onto the GPU (``gpu/load.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from elastrun.train import dist as edist
from elastrun.train import notes, reform, snapclient
from elastrun.train.blob import Receipt, check, copy_into, flatten, landing, make_header, materialize
from elastrun.train.checkpoint import CheckpointCorrupt
from elastrun.train.part import Loaded, Part
from elastrun.train.plan import Plan, Report, make_plan
from elastrun.train.snapshot import SlotInfo, parse_meta


class ReplicatedPart(Part):
    """See the module docstring."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._slots: dict[int, SlotInfo] = {}

    # -- what is saved ------------------------------------------------------------------------
    def tree(self) -> dict[str, Any]:
        o = self.objects
        module = o.module()
        return {
            "step": o.step,
            "model": module.state_dict() if module is not None else None,
            "optimizer": o.optimizer.state_dict() if o.optimizer is not None else None,
            "sampler": o.sampler.state_dict() if o.sampler is not None else None,
            "extras": o.tree_extras(),
        }

    def stable_ptrs(self) -> set[int]:
        """Storage of tensors that only ``optimizer.step()`` changes (safe to copy in the background)."""
        ptrs = set()
        module = self.objects.module()
        if module is not None:
            ptrs.update(p.data_ptr() for p in module.parameters())
        if self.objects.optimizer is not None:
            for st in self.objects.optimizer.state.values():
                ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
        return ptrs

    # -- commit --------------------------------------------------------------------------------
    def commit(self, durable: bool, stop: bool, due: bool, background: bool, copy_step: bool) -> None:
        core = self.core
        if core.local_rank == 0 and (durable or stop or due):
            self.snapshot(durable and core.rank == 0, stop, background)
        if durable and core.rank != 0:  # rank 0 writes the state; every other rank its RNG states beside it
            assert core.ckpt is not None
            ckpt, step, rank = core.ckpt, self.objects.step, core.rank
            payload = core.mem.read_rng(rank, step)
            core.pipe.persister.submit(lambda: ckpt.write_rng(step, rank, payload or b""))

    def snapshot(self, persist: bool, stop: bool, background: bool) -> None:
        """Hand the state of ``objects.step`` to the pipeline (and its checkpoint, once published).

        In the background, parameters and optimizer state are copied straight from where they
        live while the next step's forward and backward run (only ``optimizer.step()`` changes
        them, and its pre-hook completes the copy first); every other tensor is cloned now.
        """
        core = self.core
        flat = flatten(self.tree())
        header = make_header(flat, step=self.objects.step, world_size=core.world_size)

        def published(slot: int, crc: int) -> None:
            if persist:
                self.persist(slot, header, must=stop)

        core.pipe.write(core.mem, flat, header, self.stable_ptrs() if background else None, published,
                        force=persist or stop)  # fmt: skip

    def persist(self, slot: int, header: dict[str, Any], must: bool) -> None:
        """Queue the durable checkpoint of a just-published slot (global rank 0)."""
        core = self.core
        assert core.ckpt is not None
        ckpt, mem, step, ws, rank = core.ckpt, core.mem, header["step"], header["world_size"], core.rank
        payload = mem.read_rng(rank, step) or b""

        def write() -> None:
            try:
                ckpt.write_rng(step, rank, payload)
                shared = ckpt.write_shared(step, header, mem.data_view(slot, header["nbytes"]))
                ckpt.write_manifest(step, ws, shared, abandon=core.abandon)
            finally:
                mem.unpin(slot)

        mem.pin(slot)
        if not core.pipe.persist(step, must, write):
            mem.unpin(slot)

    def checkpoint(self) -> None:
        core, step = self.core, self.objects.step
        assert core.ckpt is not None
        core.pipe.drain()
        core.pipe.persister.wait()
        if core.local_rank == 0 and core.mem.written(step) is None:
            self.snapshot(persist=False, stop=False, background=False)  # a step the spacing skipped
        if core.rank == 0:
            info = core.mem.written(step)
            if info is None:
                raise RuntimeError(f"no memory snapshot of step {step} to checkpoint; commit() first")
            self.persist(info.slot, info.header, must=True)
        else:
            payload = core.mem.read_rng(core.rank, step) or b""
            ckpt, rank = core.ckpt, core.rank
            core.pipe.persister.submit(lambda: ckpt.write_rng(step, rank, payload))
        core.pipe.persister.wait()

    # -- restore -------------------------------------------------------------------------------
    def prepare(self) -> Any:
        o = self.objects
        if o.model is None and o.optimizer is None and reform.active():
            return self.LATER  # under et.run a State without a model waits for attach() (no collective)
        return self.GO

    def report(self) -> Report:
        core = self.core
        self._slots = {i.step: i for i in core.mem.scan()}
        self.disk = {c.step: c for c in core.ckpt.scan(warn=core.rank == 0) if c.kind != "dcp"} if core.ckpt else {}
        mem_rng = core.mem.scan_rng()
        live = self.objects.live_step()
        if live is not None:  # this rank's own RNG states of its live step, held in memory
            mem_rng[core.rank] = sorted({*mem_rng.get(core.rank, ()), live})
        return Report(
            rank=core.rank,
            mem={s: i.world_size for s, i in self._slots.items()},
            mem_rng=mem_rng,
            disk={s: c.world_size for s, c in self.disk.items()},
            disk_rng={s: c.rng_ranks for s, c in self.disk.items()},
            live={live: self.objects.live.world_size} if live is not None and self.objects.live is not None else {},
            server=snapclient.my_server(),
            mem_ids={s: (f"shared.{i.slot}", i.meta_crc) for s, i in self._slots.items()},
        )

    def attempts(self, reports: list[Any]) -> int:
        return 4 * (len(self._slots) + len(self.disk)) + 8

    def plan(self, reports: list[Any], excluded: set[tuple]) -> Plan | None:
        return make_plan(reports, excluded)

    def load(self, plan: Plan, reports: list[Any], excluded: set[tuple]) -> Loaded:
        """A ``peer`` restore goes through the snapshot servers when every rank has one (each rank
        whose node lacks the step reads it from a node that has it; not collective), else by a
        broadcast from the plan's source rank over the process group (collective).  The tree is built
        only once every rank has its bytes (a local buffer is copied into the model's own tensors
        then, not before: a plan that fails on another rank leaves this one's objects as they were)."""
        o = self.objects
        live = o.live_step() == plan.step
        holders = [r for r in reports if plan.step in r.mem and ("mem", r.rank, plan.step) not in excluded]
        by_server = plan.source == "peer" and bool(holders) and all(r.server for r in reports)
        if plan.source in ("memory", "live") or (by_server and (live or plan.step in self._slots)):
            if live:
                return self._use_live, set(), False
            try:
                info = self._slots[plan.step]
                check(info.header)
                return self._applier(info.header, self.core.mem.data_file(info), plan), set(), False
            except (OSError, ValueError, KeyError) as e:
                notes.warn(f"memory snapshot of step {plan.step} unreadable on rank {self.core.rank}: {e}",
                           stacklevel=3)  # fmt: skip
                return None, {("mem", self.core.rank, plan.step)}, False
        if by_server:
            return self._from_server(plan, holders)
        return self._broadcast(plan, live)

    def _use_live(self) -> str:
        self.objects.rollback_live()
        return "live"

    def _applier(self, header: dict[str, Any], source: Any, plan: Plan) -> Callable[[], str]:
        """The function that builds the tree of ``header`` from ``source`` (a slot file or a host
        buffer), loads it into the objects and returns the source's name.  A GPU state's tensors go
        straight onto the GPU at the card's speed (``gpu/load.py``)."""
        dev = self.core.pipe.device
        name = "memory" if plan.source == "live" else plan.source
        if dev is None or "devices" not in header:
            data = self.core.mem.read_path(source, header) if not isinstance(source, torch.Tensor) else source

            def build() -> Any:
                return materialize(header, data, self._landing(header))
        else:
            from elastrun.train.gpu import load

            where = torch.device("cuda", getattr(dev, "index", 0))

            def build() -> Any:
                return load.materialize(header, source, self._landing(header, device=True), where)

        def apply() -> str:
            self.objects.apply(build())
            # What this process remembered of its own last commit is not what it now holds (the plan
            # chose another step): a re-form before the next commit must not roll back to it.
            self.objects.live = None
            return name

        return apply

    def _landing(self, header: dict[str, Any], device: bool = False) -> dict[int, torch.Tensor]:
        """The entries of ``header`` that can land straight in the model's own parameters and
        buffers (their pages are already touched: no fresh memory, no second copy); on a GPU too
        with ``device``."""
        module = self.objects.module()
        return landing(header, "model", module.state_dict(), device) if module is not None else {}

    def _live_bytes(self) -> tuple[dict[str, Any], torch.Tensor]:
        """Header and bytes of the live objects (rolled back to their commit first), to send to peers."""
        o = self.objects
        o.rollback_live()
        flat = flatten(self.tree())
        header = make_header(flat, step=o.step, world_size=o.live.world_size if o.live else 0)
        data = torch.empty(flat.nbytes, dtype=torch.uint8)
        copy_into(flat, data)
        return header, data

    def _from_server(self, plan: Plan, holders: list[Report]) -> Loaded:
        """A rank whose node lacks the step reads it from the snapshot server of a node that has
        it (``elastrun/agent/snapserver.py``): the meta, then the bytes, each range straight into
        where it belongs: the model's own parameters when they match (a transfer that fails part-way
        then leaves them neither fresh nor restored, which the restore refuses to start from), fresh
        tensors for the rest."""
        core = self.core
        holder = holders[core.rank % len(holders)]
        name, crc = holder.mem_ids[plan.step]
        began = time.perf_counter()
        wrote = False
        try:
            key = snapclient.job_key()
            with snapclient.SnapshotClient(holder.server, key) as client:  # type: ignore[arg-type]
                header = parse_meta(client.meta("", name), core.mem.run_id)
            if header is None or header["step"] != plan.step:
                raise ValueError(f"{name} on {holder.server} is not step {plan.step} any more")
            # Not into a live commit's objects (et.run): a failed transfer must not overwrite them.
            receipt = Receipt(header, self._landing(header) if self.objects.live is None else {})
            gets = [snapclient.Get("", name, crc, offset, t.numel(), snapclient.writable(t))
                    for offset, t in receipt.ranges]  # fmt: skip
            wrote = bool(receipt.landed)
            errors = snapclient.fetch(holder.server, key, gets)  # type: ignore[arg-type]
            error = next((e for e in errors if e is not None), None)
            if error is not None:
                raise ValueError(error)
        except (OSError, ValueError) as e:
            notes.warn(f"step {plan.step} unreadable from rank {holder.rank}'s node ({holder.server}): {e}",
                       stacklevel=4)  # fmt: skip
            return None, {("mem", holder.rank, plan.step)}, wrote
        self.transfer = {"via": "server", "bytes": header["nbytes"], "seconds": time.perf_counter() - began,
                         "in_place": sum(header["entries"][i][3] for i in receipt.landed)}  # fmt: skip

        def apply() -> str:
            self.objects.apply(receipt.tree())
            self.objects.live = None
            return plan.source

        return apply, set(), wrote

    def _broadcast(self, plan: Plan, live: bool) -> Loaded:
        """The lowest rank that has the step (in memory, live, or on disk) sends it to every rank."""
        core = self.core
        header: Any = None
        data = None
        if core.rank == plan.src_rank:
            try:
                if plan.source == "peer" and live:
                    header, data = self._live_bytes()
                elif plan.source == "peer":
                    info = self._slots[plan.step]
                    header, data = info.header, core.mem.read(info)
                else:
                    header, data = core.ckpt.load_shared(self.disk[plan.step])  # type: ignore[union-attr]
            except CheckpointCorrupt as e:
                notes.warn(f"{e}; using an older checkpoint", stacklevel=3)
                header = {"error": str(e)}
            except (OSError, ValueError, KeyError) as e:
                notes.warn(f"step {plan.step} unreadable from {plan.source} on rank {core.rank}: {e}", stacklevel=3)
                header = {"error": str(e)}
        began = time.perf_counter()
        header = edist.broadcast_obj(header, plan.src_rank)  # type: ignore[arg-type]
        if "error" in header:
            failed = ("disk", plan.step) if plan.source == "disk" else ("mem", plan.src_rank, plan.step)
            return None, {failed}, False
        if data is None:
            data = torch.empty(header["nbytes"], dtype=torch.uint8)
        edist.broadcast_bytes(data, plan.src_rank)  # type: ignore[arg-type]
        if plan.source == "peer" and core.rank != plan.src_rank:
            self.transfer = {"via": "group", "bytes": header["nbytes"], "seconds": time.perf_counter() - began}
        if live:
            return self._use_live, set(), False  # this rank's own objects already hold the step
        return self._applier(header, data, plan), set(), False

