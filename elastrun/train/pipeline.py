"""The snapshot pipeline: commit -> copy -> publish -> persist, for every kind of state.

``State`` (a replicated state: one copy per node, written by local rank 0) and its sharded half
(every rank its own shard) hand the pipeline the same thing: a flattened state (``blob.py``: tensors
and the byte layout of their slot), a header, the tensors that only ``optimizer.step()`` changes,
and what to do once the slot is published (persist it to disk, ask for copies on other nodes).
The pipeline decides when a snapshot is taken (``spacing.py``), claims a slot (``snapshot.py``),
copies, publishes on a helper thread, and makes ``optimizer.step()`` wait for what it is about to
change.  How it copies depends on where the tensors live:

* **host memory**: parameters and optimizer state are copied by the idle-priority helper while the
  next step's forward and backward run (``copier.py``); the optimizer's pre-hook finishes the copy
  on the training thread.  Every other tensor (buffers, extras: forward may change them) is cloned
  in ``commit()``.  What a snapshot costs the step beside it is timed, and by default snapshots
  are spaced so that it stays within 5 % of the steps (``spacing.HostMeter``).
* **a GPU**: the device's part goes on a side stream (``gpu/copy.py``): staged through a buffer on
  the card when it has room (the optimizer then waits only for that device-to-device copy), into
  slot memory page-locked ahead of time (``slotmem.py``).  Nothing blocks the training thread unless
  a copy it must wait for is still running: at most one snapshot's copy is in flight, and by default
  snapshots are spaced so that one never is when the next is due.

Usage (``state.py`` and the parts, ``replicated.py`` and ``sharded/shards.py``)::

    pipe.settle()                              # commit(): the last snapshot's failure, if any
    unready, every = pipe.propose()            # all-reduced (max) with the other ranks
    if pipe.due(step, every, unready): pipe.write(mem, flat, header, stable, published)
    pipe.persist(step, must, write)            # in ``published``: a durable checkpoint of the slot
    pipe.before_step()                         # optimizer pre-hook
    pipe.drain()                               # restore, checkpoint, flush, close
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from elastrun.train import notes, spacing
from elastrun.train.background import BackgroundJob
from elastrun.train.blob import Flattened, copy_into
from elastrun.train.copier import SnapshotCopy
from elastrun.train.gpu.copy import DeviceCopy
from elastrun.train.gpu.device import POLL_S, Device, device_of
from elastrun.train.snapshot import MemorySnapshots

#: Snapshots whose RNG files are kept whatever their age (a restore may need the previous one's).
KEEP_SNAPSHOTS = 3


class SnapshotPipeline:
    """Snapshots of one rank's state (``every``: ``State(snapshot_every=)``, None: chosen)."""

    def __init__(self, every: int | None) -> None:
        self.explicit = every
        self.device: Device | None = None
        self._writer = BackgroundJob("elastrun-snapshot")
        #: Writes durable checkpoints of published slots, one at a time (:meth:`persist`).
        self.persister = BackgroundJob("elastrun-checkpoint")
        self._skipped_warned = False
        self._copy: SnapshotCopy | None = None  # the host copy in flight
        self._device_copy: DeviceCopy | None = None  # the device copy in flight (guarded or not)
        self._guarded = False
        self._staging: torch.Tensor | None = None
        self._no_staging = ""  # why the card has no staging buffer (said once)
        self._unpinned = ""  # why slots are not page-locked (said once)
        self._mem: MemorySnapshots | None = None
        self._nbytes = 0
        self._last = 0  # the step of the last snapshot decided
        #: Steps of the last snapshots (their RNG files are kept).
        self.kept: deque[int] = deque(maxlen=KEEP_SNAPSHOTS)
        self.meter: spacing.Meter | spacing.HostMeter = spacing.HostMeter()  # host memory until use()
        self.every_now = every or 1
        self.said = ""  # the spacing line last logged
        self.said_every = 0
        #: Called with the spacing line whenever it changes (the step log records it for goodput).
        self.on_spacing: Callable[[int, str], None] | None = None
        self.deferred = 0  # snapshots put off: no slot ready yet, or the last copy still in flight
        #: Processes of this node writing slots like these (for the room check): 1 for a replicated
        #: state (local rank 0), every local rank for a sharded one.
        self.writers = 1
        self._checked: dict[int, int] = {}  # id(slots) -> the largest size whose room was checked

    # -- where the state lives -------------------------------------------------------------
    def use(self, tensors: list[torch.Tensor]) -> None:
        """Take the device of the state's tensors (a GPU, or None: host memory)."""
        dev = device_of(tensors)
        if dev is not self.device:
            self.drain()
            self.device = dev
            self._staging = None
            self.meter = spacing.Meter(dev.seconds, dev.done) if dev is not None else spacing.HostMeter()

    # -- the commit --------------------------------------------------------------------------
    def settle(self) -> None:
        """At the start of ``commit()``: a host state's last snapshot is published first (as before
        every copy); a GPU state's is not waited for, only its failure is raised."""
        if self.device is None:
            self.before_step()  # (the optimizer's pre-hook has done it, unless there is no optimizer)
            began = time.perf_counter()
            self._writer.wait()  # the last snapshot's publication
            self._stalled(began)
        elif not self._writer.busy():
            self._writer.wait()  # re-raises a failed job's error; returns at once

    def mark_step(self) -> None:
        """At each commit: the step's end for the meter (on a GPU, an event on the training stream)."""
        self.meter.step(self.device.record() if self.device is not None else None)
        self._respace()

    def propose(self) -> tuple[bool, int]:
        """This rank's view of the next snapshot: whether it could not start one now (the last copy
        is still in flight, or no slot is ready), and the spacing it asks for."""
        if self.device is None:
            return False, self.every_now
        inflight = self._device_copy is not None and not self._device_copy.landed()
        unready = inflight or (self._mem is not None and self._nbytes > 0 and not self._mem.ready_slot(self._nbytes))
        return unready, self.every_now

    def due(self, step: int, every: int, unready: bool) -> bool:
        """Whether ``step`` is snapshotted (every rank decides the same from the all-reduced view)."""
        # explicit: every k-th step (as checkpoints count); chosen: k after the last (the first commit's
        # at once, which starts making the slots; after a roll-back, at once), when all can start one
        if self.explicit is not None:
            hit = step % every == 0
        else:
            hit = (not self.kept or step - self._last >= every or step <= self._last) and not unready
        if hit:
            self.decided(step)
        return hit

    def decided(self, step: int) -> None:
        """``step`` is a snapshot step (also a checkpoint's or pre-emption's)."""
        self._last = step
        if not self.kept or self.kept[-1] != step:
            self.kept.append(step)

    def _respace(self) -> None:
        meter = self.meter
        if self.explicit is not None:
            return
        every = meter.every()
        if every is None:
            self.every_now = meter.probe  # the spacing while there is nothing measured yet
            return
        self.every_now = every
        settled = meter.samples >= 3
        moved = self.said_every and not self.said_every // 2 <= every <= 2 * self.said_every
        if (settled and not self.said) or moved:  # said once, and again only when it halves or doubles
            line = spacing.describe(every, meter.nbytes, meter.step_s, meter.cost_s or 0.0, meter.copy_s,
                                    meter.staged, host=self.device is None)  # fmt: skip
            self.said, self.said_every = line, every
            if os.environ.get("RANK", "0") == "0":
                print(f"elastrun.train: {line}", file=sys.stderr, flush=True)
            if self.on_spacing is not None:
                self.on_spacing(every, line)

    # -- one snapshot ----------------------------------------------------------------------
    def write(self, mem: MemorySnapshots, flat: Flattened, header: dict[str, Any], stable: set[int] | None,
              published: Callable[[int, int], None], failed: Callable[[], None] = lambda: None,
              force: bool = False) -> bool:  # fmt: skip
        """Copy ``flat`` into a free slot of ``mem`` and publish it with ``header``, then call
        ``published(slot, meta CRC)`` on the helper thread (``failed()`` if the copy fails).

        ``stable`` (the addresses of parameters and optimizer state) is given for a copy in the
        background: those tensors are copied straight from where they live while the next step's
        forward and backward run; every other tensor is cloned now.  ``None``: the copy is made
        now, on this thread, and published before this returns.

        A GPU state's snapshot waits for nothing it need not: at the default spacing, until a slot
        is ready (made on a helper thread, see ``slotmem.py``) it is put off and False is returned;
        ``force`` (a checkpoint, a pre-emption) and an explicit ``snapshot_every`` wait for one (the
        first commits only).  A snapshot due while the last one's copy is in flight waits for it
        (at the default spacing one never is: :meth:`propose` says the pipeline is not ready)."""
        if flat.nbytes > self._checked.get(id(mem), 0):
            mem.check_room(flat.nbytes, self.writers)
            self._checked[id(mem)] = flat.nbytes
        self._mem, self._nbytes = mem, flat.nbytes
        dev = self.device
        if dev is None or stable is None:
            return self._write_host(mem, flat, header, stable, published, failed)
        if self._device_copy is not None:
            self.drain()
        if mem.on_unpinned is None:
            mem.on_unpinned = self._say_unpinned
        mem.prepare(flat.nbytes, dev)
        claimed = mem.begin(flat.nbytes, ready_only=True)
        if claimed is None and (force or self.explicit is not None):
            # A checkpoint, a pre-emption, or snapshots the user spaced: wait for a slot being made
            # (the first commits only), or take one as it is (its first write then faults its pages in).
            mem.wait_ready(flat.nbytes)
            claimed = mem.begin(flat.nbytes, ready_only=True) or mem.begin(flat.nbytes)
        if claimed is None:
            self.deferred += 1
            return False
        slot, buf, view = claimed
        on_device = [i for i, t in enumerate(flat.tensors) if dev.holds(t)]
        for i, t in enumerate(flat.tensors):
            if t.numel() and not (t.data_ptr() in stable and t.is_contiguous()):
                flat.tensors[i] = t.clone()  # forward may change it before the copy runs (on the device: there)
        host_copy = SnapshotCopy(flat, buf, skip=on_device)
        device_copy = DeviceCopy(dev, flat, on_device, buf, self._staging_for(flat, on_device))
        pinned = mem.pinned_memory(slot)
        device_copy.start(pinned)
        self.meter.started(device_copy, device_copy.nbytes, device_copy.staging is not None)
        host_copy.start()
        self._copy, self._device_copy, self._guarded = host_copy, device_copy, False

        def copy(_: torch.Tensor) -> None:
            dev.activate()
            if not pinned:
                device_copy.to_host()  # pageable: returns once it landed
            host_copy.wait()
            device_copy.wait()

        del buf
        self._writer.submit(_completion(mem, claimed, header, copy, published, failed))
        return True

    def _write_host(self, mem: MemorySnapshots, flat: Flattened, header: dict[str, Any], stable: set[int] | None,
                    published: Callable[[int, int], None], failed: Callable[[], None]) -> bool:  # fmt: skip
        """A snapshot of tensors in host memory (or made now, on this thread: ``stable`` None)."""
        if stable is not None:
            for i, t in enumerate(flat.tensors):
                if t.numel() and not (t.data_ptr() in stable and t.is_contiguous()):
                    flat.tensors[i] = t.clone()  # forward may change it before the copy runs
        claimed = mem.begin(flat.nbytes)
        assert claimed is not None
        copy = SnapshotCopy(flat, claimed[1]) if stable is not None else None

        def copy_all(buf: torch.Tensor) -> None:
            if copy is None:
                copy_into(flat, buf)
            else:
                if copy.device_indices:  # a device tensor in a host state (not the GPU path)
                    copy_into(flat, buf, copy.device_indices)
                copy.wait()

        complete = _completion(mem, claimed, header, copy_all, published, failed)
        if copy is None:
            complete()
            return True
        copy.start()
        self._copy = copy
        if copy.background:
            self.meter.started(copy, flat.nbytes, False)
        self._writer.submit(complete)
        return True

    def _staging_for(self, flat: Flattened, on_device: list[int]) -> torch.Tensor | None:
        """The card's staging buffer (as long as the slot), made once while the card has room."""
        if self._staging is not None and self._staging.numel() >= flat.nbytes:
            return self._staging
        if self._no_staging or self.device is None or not on_device:
            return None
        self._staging = None
        staging = self.device.staging(flat.nbytes)
        if staging is None:
            self._no_staging = self.device.why_not
            notes.warn(f"snapshots copy straight from the parameters, without a staging buffer on the GPU "
                       f"({self._no_staging}): optimizer.step() then waits for each snapshot's whole copy, "
                       "and by default snapshots are spaced further apart", stacklevel=4)  # fmt: skip
        self._staging = staging
        return staging

    def _say_unpinned(self, why: str) -> None:
        if not self._unpinned:
            self._unpinned = why
            notes.warn(f"snapshot slots are not page-locked ({why}): a snapshot copies from the GPU at pageable "
                       "speed (about a fifth: 11 against 55 GB/s on an H100), on a helper thread", stacklevel=2)

    # -- persist ------------------------------------------------------------------------------
    def persist(self, step: int, must: bool, write: Callable[[], None]) -> bool:
        """Queue ``write`` (a durable checkpoint of ``step`` from its published slot) on the persister
        thread; skipped (False) while the previous checkpoint is still being written, unless ``must``
        (a pre-emption): said once per pipeline."""
        if self.persister.busy() and not must:
            if not self._skipped_warned:
                self._skipped_warned = True
                notes.warn(f"checkpoint of step {step} skipped: the previous one is still being written "
                           "(raise checkpoint_every); this warning is shown once", stacklevel=4)  # fmt: skip
            return False
        self.persister.submit(write)
        return True

    # -- around optimizer.step() and at the ends -------------------------------------------
    def before_step(self) -> None:
        """The optimizer's pre-hook: what ``optimizer.step()`` changes must be copied first.  The
        host copy is finished on this thread; the device copy is waited for on the device."""
        copy, self._copy = self._copy, None
        if copy is not None:
            began = time.perf_counter()
            copy.finish()
            self._stalled(began)
        job = self._device_copy
        if job is not None and not self._guarded:
            while job.staged is None:  # pageable and direct: the helper copies, this thread waits
                if not self._writer.busy():
                    break
                time.sleep(POLL_S)
            if job.staged is not None:
                job.guard()
            self._guarded = True
        elif copy is not None and copy.device_indices and self.device is None:
            self._writer.wait()  # device tensors of a host state are copied by the writer job itself

    def _stalled(self, began: float) -> None:
        """The training thread waited for a host snapshot from ``began`` until now."""
        if isinstance(self.meter, spacing.HostMeter):
            self.meter.stalled(time.perf_counter() - began)

    def drain(self) -> None:
        """Wait until the last snapshot is copied and published (and raise its failure)."""
        self.before_step()
        self._writer.wait()
        self._device_copy = None

    def busy(self) -> bool:
        return self._writer.busy()

    def wait(self, timeout: float | None = None) -> bool:
        return self._writer.wait(timeout=timeout)

    def close(self, timeout: float | None = None) -> bool:
        """:meth:`wait`, then let the helper thread end (``State.close()``)."""
        return self._writer.close(timeout=timeout)

    def reset(self) -> None:
        """After a re-form: step times start again (the group, and perhaps the rank, changed)."""
        self.meter.reset()


def _completion(mem: MemorySnapshots, claimed: tuple[int, torch.Tensor, memoryview], header: dict[str, Any],
                copy: Callable[[torch.Tensor], None], published: Callable[[int, int], None],
                failed: Callable[[], None]) -> Callable[[], None]:  # fmt: skip
    """The job that finishes a snapshot: ``copy`` into the claimed slot's buffer (or wait for it),
    then publish the slot with ``header`` and call ``published(slot, meta CRC)``; on a failure the
    slot is let go and ``failed()`` called.  The buffer is let go before the meta is written (the
    mapping may then be closed or replaced)."""
    slot, buf, view = claimed
    holder = [buf]
    del buf, claimed

    def complete() -> None:
        try:
            copy(holder[0])
        except BaseException:
            mem.let_go(slot)
            failed()
            raise
        holder.clear()
        view.release()
        published(slot, mem.publish(slot, header))

    return complete
