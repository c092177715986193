"""Node-local memory snapshots that outlive the worker process.

Layout of the snapshot directory (on ``/dev/shm``, owned by the node's agent):

* ``shared.<slot>.data`` / ``shared.<slot>.meta``: the replicated state (model, optimizer, sampler,
  extras), written by local rank 0 only.  ``SLOTS`` slots are reused round-robin (oldest step
  first) so the data files stay mapped and their pages stay allocated: a snapshot is one memory copy.
* ``rng.r<rank>.s<step>``: each rank's RNG states, written by that rank at every commit.

A slot is whole or ignored: its ``.meta`` is unlinked before the data is overwritten and renamed
into place (with a CRC of its own bytes) only after the copy has finished.  A worker SIGKILLed in
the middle of a copy therefore leaves that slot without a meta, and the other slots untouched.
The data itself carries no checksum: the meta is the commit record, and checksumming a gigabyte
per step would cost more than the copy.  Four slots: under DDP the ranks' snapshot progress can
differ by one step (a rank may be copying step s+1 while another is still on step s), and a rank
that died between a step's collective and its commit leaves that step without its RNG state (the
restore then goes back one snapshot), so the two newest complete snapshots must survive, plus one
being written: three slots; a fourth only for a state with a checkpoint directory, whose
checkpoint holds a slot while it is written to disk (:func:`slots_needed`).

A slot's memory is made ready on a helper thread before its first write (:meth:`MemorySnapshots.prepare`,
``slotmem.py``): allocated, mapped, and for a GPU state page-locked.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import threading
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from elastrun.shared.replicas import META_MAGIC, meta_crc
from elastrun.train.copier import at_idle_priority
from elastrun.train.fileio import atomic_write
from elastrun.train.slotmem import SlotMemory, allocated, fallocate

#: The most slots a node's directory holds per writer (what readers scan).
SLOTS = 4
RNG_KEEP = 8


def slots_needed(checkpoints: bool) -> int:
    """Slots a writer uses: the two newest complete snapshots and one being written, and one more
    when checkpoints hold a slot while they are written to disk (see the module docstring)."""
    return 4 if checkpoints else 3


@dataclass
class SlotInfo:
    """A complete snapshot found in a slot."""

    slot: int
    step: int
    world_size: int
    header: dict[str, Any]
    meta_crc: int = 0  # the CRC the meta records of itself: this generation of the slot


def parse_meta(raw: bytes, run_id: str) -> dict[str, Any] | None:
    """The header in a meta file's bytes, or None when they are torn, corrupt or of another job."""
    if meta_crc(raw) is None:
        return None
    header = pickle.loads(raw[12:])
    return header if header.get("run_id") == run_id else None


class MemorySnapshots:
    """The snapshot directory of one node, seen from one worker."""

    def __init__(self, directory: Path, run_id: str) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self._maps: dict[int, SlotMemory] = {}
        self._pinned: set[int] = set()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a slot's preparation ended
        self._slot_steps: dict[int, int | None] = {s: None for s in range(SLOTS)}
        for info in self.scan():
            self._slot_steps[info.slot] = info.step
        #: How many slots this writer uses (:func:`slots_needed`).
        self.count = SLOTS
        self._kept_rng: dict[int, list[int]] = {}  # rank -> old steps whose RNG files write_rng kept
        #: Slots a helper thread is making ready (never claimed meanwhile), and the size asked for.
        self._preparing: set[int] = set()
        self._writing: set[int] = set()  # claimed by begin(), until published or let go
        self._prepared_for = 0
        self._preparer: threading.Thread | None = None
        #: Called once with the reason when page-locking a slot was refused (then they stay pageable).
        self.on_unpinned: Callable[[str], None] | None = None

    # -- shared state: writer side ----------------------------------------------------------
    def _data_path(self, slot: int) -> Path:
        return self.dir / f"shared.{slot}.data"

    def _meta_path(self, slot: int) -> Path:
        return self.dir / f"shared.{slot}.meta"

    def _choose(self, free: list[int]) -> int:
        """The slot to overwrite among ``free`` (unpinned): the empty or oldest one."""
        return min(free, key=lambda s: (self._slot_steps[s] is not None, self._slot_steps[s] or 0))

    def prepare(self, nbytes: int, device: Any = None, background: bool = True) -> threading.Thread | None:
        """Make this writer's slots ready for snapshots of ``nbytes`` ahead of their first write
        (``slotmem.py``), on a helper thread, or now (``background`` False).

        For a GPU state (``device``) each slot is made whole: allocated, mapped with its page tables
        filled, page-locked; :meth:`begin` with ``ready_only`` takes only such slots.  For a state in
        host memory the slot files' pages are only allocated (one ``fallocate`` each), at idle
        priority: the copy into them runs at idle priority too, and a helper that ran more Python
        there could hold the interpreter lock while it gets no CPU.  Slots being written or pinned
        are left alone.  Returns the thread, or None when there was nothing to do."""
        with self._lock:
            if nbytes <= 0 or self._prepared_for >= nbytes or self._preparer is not None:
                return None
            self._prepared_for = nbytes

        refused: list[str] = []
        # Registrations go one slot after another (slotmem.py: piece by piece, one piece at a time in
        # the process), so that the first slot is ready first and snapshots can begin.
        turns = [threading.Event() for _ in range(self.count + 1)]
        turns[0].set()

        def make_slot(slot: int) -> None:
            try:
                make_one(slot)
            finally:
                turns[slot + 1].set()

        def make_one(slot: int) -> None:
            device.activate()
            with self._lock:
                m = self._maps.get(slot)
                held = slot in self._pinned or slot in self._writing
                if held or (m is not None and m.ready and m.size >= nbytes):
                    return  # held or being written, or ready
                self._preparing.add(slot)
            made: SlotMemory | None = None
            try:
                made = SlotMemory.make(self._data_path(slot), nbytes)  # allocated and mapped: all slots at once
                turns[slot].wait()
                made.pin(device)
            except OSError:
                pass
            finally:
                with self._lock:
                    self._preparing.discard(slot)
                    if made is not None:
                        old = self._maps.get(slot)
                        self._maps[slot] = made
                        if old is not None:
                            old.close()
                    self._changed.notify_all()
                    say = made is not None and not made.pinned and not refused
                    if say:
                        refused.append(device.why_not or "refused")
            if say and self.on_unpinned is not None:
                self.on_unpinned(refused[0])

        def make() -> None:
            # Every slot at once: each is mostly the kernel zeroing its pages, which spreads over the
            # cores (one after the other, a 4 GB state's three slots took 6 s); their registrations
            # then go in turn (above).
            threads = [threading.Thread(target=make_slot, args=(slot,), name=f"elastrun-make-slot-{slot}",
                                        daemon=True) for slot in range(self.count)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        def allocate() -> None:
            with at_idle_priority():
                for slot in range(self.count):
                    path = self._data_path(slot)
                    if allocated(path) >= nbytes:
                        continue
                    try:
                        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                    except OSError:
                        continue
                    try:
                        fallocate(fd, nbytes)
                    finally:
                        os.close(fd)

        def run() -> None:
            try:
                (make if device is not None else allocate)()
            finally:
                with self._lock:
                    self._preparer = None
                    self._changed.notify_all()

        if not background:
            with self._lock:
                self._preparer = threading.current_thread()
            run()
            return None
        thread = threading.Thread(target=run, name="elastrun-prepare-slots", daemon=True)
        with self._lock:
            self._preparer = thread
        thread.start()
        return thread

    def check_room(self, nbytes: int, writers: int = 1) -> None:
        """Refuse, with one clear line, slots this node's memory cannot hold: ``writers`` processes of
        the node each writing ``count`` slots of ``nbytes`` (what their files already hold counts as
        room).  Raised at the first snapshot of a size, never as an out-of-memory kill (or a SIGBUS
        on a full ``/dev/shm``) in the middle of a run."""
        need = writers * self.count * nbytes
        have = sum(allocated(self._data_path(s)) for s in range(SLOTS)) * writers
        try:
            st = os.statvfs(self.dir)
            free_fs = st.f_bavail * st.f_frsize + have
        except OSError:
            return
        free_mem = psutil.virtual_memory().available + have
        if need <= min(free_fs, free_mem):
            return
        raise RuntimeError(
            f"elastrun.train: this node cannot hold the memory snapshots: {writers} writer(s) x {self.count} slots x "
            f"{nbytes / 1e9:.2f} GB = {need / 1e9:.1f} GB, but {self.dir} has {free_fs / 1e9:.1f} GB free and the host "
            f"{free_mem / 1e9:.1f} GB available; give the node more memory or its /dev/shm more room (docker: "
            "--shm-size), or set snapshot_dir (ELASTRUN_SNAPSHOT_DIR) to a larger memory file system")

    def wait_ready(self, nbytes: int, timeout: float = 300.0) -> bool:
        """Wait (bounded) until a slot is ready for ``nbytes`` or no slot is being made any more;
        True when one is ready."""
        with self._lock:
            return self._changed.wait_for(lambda: bool(self._free_ready(nbytes)) or self._preparer is None, timeout) \
                and bool(self._free_ready(nbytes))

    def ready_slot(self, nbytes: int) -> bool:
        """Whether :meth:`begin` with ``ready_only`` would find a slot now."""
        with self._lock:
            return self._free_ready(nbytes) != []

    def _free_ready(self, nbytes: int) -> list[int]:
        """Ready slots that may be written now: not held, and not one of the two newest complete
        snapshots.  While the other slots are still being made, only the newest is kept (with two
        slots ready snapshots alternate between them); with one, a snapshot waits or is put off
        rather than overwrite the only complete one."""
        ready = [s for s in range(self.count) if s not in self._preparing and (m := self._maps.get(s)) is not None
                 and m.ready and m.size >= nbytes]  # fmt: skip
        newest = sorted(((st, s) for s, st in self._slot_steps.items() if st is not None and s in ready),
                        reverse=True)[: 2 if len(ready) > 2 else 1]  # fmt: skip
        kept = {s for _, s in newest}
        return [s for s in ready if s not in self._pinned and s not in self._writing and s not in kept]

    def begin(self, nbytes: int, ready_only: bool = False) -> tuple[int, torch.Tensor, memoryview] | None:
        """Claim the oldest unpinned slot, invalidate it, and return it as a writable buffer.
        ``ready_only``: only a slot made ready ahead (:meth:`prepare`), else None."""
        with self._lock:
            if ready_only:
                free = self._free_ready(nbytes)
                if not free:
                    return None
            else:
                while True:  # a slot being made ready is waited for only when no other is free
                    free = [s for s in range(self.count) if s not in self._pinned and s not in self._writing]
                    if [s for s in free if s not in self._preparing] or not free:
                        free = [s for s in free if s not in self._preparing] or free
                        break
                    self._changed.wait(1.0)
                if not free:
                    raise RuntimeError(f"no free snapshot slot in {self.dir}: all {self.count} are held")
            slot = self._choose(free)
            self._slot_steps[slot] = None
            self._writing.add(slot)
            m = self._maps.get(slot)
            if m is None or m.size < nbytes:
                if m is not None:
                    m.close()
                m = self._maps[slot] = SlotMemory(self._data_path(slot), nbytes)
        try:
            self._meta_path(slot).unlink()
        except FileNotFoundError:
            pass
        if m.mm is None:
            return slot, torch.empty(0, dtype=torch.uint8), memoryview(b"")
        view = memoryview(m.mm)[:nbytes]
        return (
            slot,
            torch.frombuffer(view, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8),
            view,
        )

    def pinned_memory(self, slot: int) -> bool:
        """Whether ``slot`` is page-locked for a device (its copies then run at the device's speed)."""
        m = self._maps.get(slot)
        return m is not None and m.pinned

    def publish(self, slot: int, header: dict[str, Any]) -> int:
        """Mark ``slot`` complete: its data holds the state ``header`` describes.  Returns the meta's
        CRC (this generation of the slot, by which snapshot servers name it)."""
        body = pickle.dumps({**header, "run_id": self.run_id}, protocol=pickle.HIGHEST_PROTOCOL)
        crc = zlib.crc32(body)
        atomic_write(self._meta_path(slot), [META_MAGIC, struct.pack("<I", crc), body], False)
        with self._lock:
            self._slot_steps[slot] = header["step"]
            self._writing.discard(slot)
        return crc

    def let_go(self, slot: int) -> None:
        """A claimed slot that will not be published (its copy failed): it may be claimed again."""
        with self._lock:
            self._writing.discard(slot)

    def pin(self, slot: int) -> None:
        with self._lock:
            self._pinned.add(slot)

    def unpin(self, slot: int) -> None:
        with self._lock:
            self._pinned.discard(slot)

    def written(self, step: int) -> SlotInfo | None:
        """A complete snapshot of ``step`` that this process wrote (one it can persist), or None.  A
        snapshot left by an earlier process under the same step number is not one."""
        with self._lock:
            own = set(self._maps)
        return next((i for i in self.scan() if i.step == step and i.slot in own), None)

    def data_view(self, slot: int, nbytes: int) -> memoryview:
        """The bytes of a slot this process wrote (for persisting it to disk)."""
        m = self._maps[slot]
        return memoryview(m.mm)[:nbytes] if m.mm is not None else memoryview(b"")

    # -- shared state: reader side ----------------------------------------------------------
    def read_meta(self, slot: int) -> dict[str, Any] | None:
        """The header of a complete slot, or None when the slot is empty, torn, or foreign."""
        found = self._read_meta(slot)
        return found[0] if found is not None else None

    def _read_meta(self, slot: int) -> tuple[dict[str, Any], int] | None:
        try:
            raw = self._meta_path(slot).read_bytes()
        except FileNotFoundError:
            return None
        header = parse_meta(raw, self.run_id)
        if header is None:
            return None
        try:
            if self._data_path(slot).stat().st_size < header["nbytes"]:
                return None
        except FileNotFoundError:
            return None
        return header, struct.unpack("<I", raw[8:12])[0]

    def scan(self) -> list[SlotInfo]:
        """Complete snapshots on this node, newest first."""
        found = []
        for slot in range(SLOTS):
            meta = self._read_meta(slot)
            if meta is not None:
                header, crc = meta
                found.append(SlotInfo(slot, header["step"], header["world_size"], header, crc))
        return sorted(found, key=lambda i: -i.step)

    def data_file(self, info: SlotInfo) -> Path:
        """The data file of a complete slot (ValueError if it is shorter than its header says)."""
        path = self._data_path(info.slot)
        if path.stat().st_size < info.header["nbytes"]:
            raise ValueError(f"{path} is shorter than its meta says (truncated)")
        return path

    def read_path(self, path: Path, header: dict[str, Any]) -> torch.Tensor:
        """A private (copy-on-write) view of the first ``header["nbytes"]`` bytes of a data file."""
        nbytes = header["nbytes"]
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY)
        return torch.frombuffer(mm, dtype=torch.uint8)

    def read(self, info: SlotInfo) -> torch.Tensor:
        """A private (copy-on-write) view of a slot's bytes; the slot itself is never modified."""
        nbytes = info.header["nbytes"]
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with open(self._data_path(info.slot), "rb") as f:
            mm = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY)
        return torch.frombuffer(mm, dtype=torch.uint8)

    # -- per-rank RNG ----------------------------------------------------------------------------
    def _rng_path(self, rank: int, step: int) -> Path:
        return self.dir / f"rng.r{rank}.s{step}"

    def write_rng(self, rank: int, step: int, payload: bytes, keep: Collection[int] = ()) -> None:
        """Write a rank's RNG states of ``step``, and drop the ones of ``step - RNG_KEEP`` unless that is
        in ``keep`` (the last snapshots' steps, whatever their age: a restore needs their RNG states).
        A kept step that left ``keep`` goes with the next step that drops its own."""
        atomic_write(self._rng_path(rank, step), [payload], False)
        old = step - RNG_KEEP
        gone = [old] if old not in keep else []
        gone += [s for s in self._kept_rng.get(rank, ()) if s not in keep and s < old]
        self._kept_rng[rank] = [s for s in {*self._kept_rng.get(rank, ()), *keep} if s not in gone and s <= old]
        for s in gone:
            try:
                self._rng_path(rank, s).unlink()
            except FileNotFoundError:
                pass

    def scan_rng(self) -> dict[int, list[int]]:
        """``{rank: [steps]}`` of the RNG states stored on this node."""
        out: dict[int, list[int]] = {}
        for p in self.dir.glob("rng.r*.s*"):
            try:
                r, s = p.name[5:].split(".s")
                out.setdefault(int(r), []).append(int(s))
            except ValueError:
                continue
        return out

    def read_rng(self, rank: int, step: int) -> bytes | None:
        try:
            return self._rng_path(rank, step).read_bytes()
        except FileNotFoundError:
            return None

    def prune_rng(self, below_step: int) -> None:
        """Remove RNG files of any rank older than ``below_step`` (ranks that no longer exist)."""
        for rank, steps in self.scan_rng().items():
            for s in steps:
                if s < below_step:
                    try:
                        self._rng_path(rank, s).unlink()
                    except FileNotFoundError:
                        pass

    def close(self) -> None:
        preparer = self._preparer
        if preparer is not None:
            preparer.join(timeout=60)
        with self._lock:
            for m in self._maps.values():
                m.close()
            self._maps.clear()
            self._prepared_for = 0


