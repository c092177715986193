"""Copies of each rank's committed shards in other nodes' memory: which steps, and to where.

A node that is lost takes its memory with it: without copies elsewhere, its ranks' shards are then
only in the last durable checkpoint.  So, by default, every committed shard is also copied into the
memory of the next node of the group (``State(copies=2)``; ``copies=k`` keeps it on k nodes while
the job has that many, ``copies=1`` none).  The copy is the agents' work, in the background
(``elastrun/agent/replicator.py``): a rank only leaves a push request beside its published slot.

Which steps are copied is decided by all ranks together, so that a step's every shard is copied or
none is: at each commit, the all-reduce that already carries the pre-emption flag also carries
"my last copy is still going" (:meth:`Copies.busy`); a step whose commit finds every rank's last
copy done is a *copy step*, and each rank asks for its shard of it to be copied.  The copies keep
pace with training when the agents can, and are spaced out when they cannot (one step in flight,
never a wait in training).  The slots of the last two copy steps are held, so that the last step
whose copies all finished stays in memory on every node with its copies.

With HSDP (a 2-D mesh, replicate x shard), a rank whose chunks are also held by a rank on another
node (its *twin* in another replica group) needs no copy: that node already has them.

A step is committed against the loss of a node once it is a copy step and every rank's copy of it
finished (the agent's ``replicated.shard.r<rank>.json`` says ``ok``), or, under HSDP, once each of
its files is committed on a node and its twin's on another.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from elastrun.shared.replicas import PushRequest, PushStatus, push_path, status_path
from elastrun.train.sharded.shard_plan import ShardReport
from elastrun.train.sharded.slots import ShardSlots


class Copies:
    """One rank's side of the copies (see the module docstring)."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"copies must be >= 1 (1: no copies in other nodes' memory), got {count}")
        self.count = count
        #: The snapshot servers this rank's shards are copied to (empty: no copies).
        self.targets: list[str] = []
        self._dir: Path | None = None
        self._rank = -1
        self._queued = False  # a copy step's snapshot is still being written: its request comes after
        self._held: list[int] = []
        self._done: int | None = None
        self._last_commit: float | None = None
        #: Seconds between this rank's recent commits (a moving average; 0 until two were seen).
        self.interval = 0.0

    def configure(self, reports: list[ShardReport], me: int, snapshot_dir: Path, my_twins: tuple[int, ...]) -> None:
        """After a restore (every rank's report): copy to the next ``count - 1`` nodes in the order of
        their lowest rank, unless twins on that many other nodes hold this rank's chunks already."""
        first: dict[str, tuple[int, str | None]] = {}
        for r in reports:
            if r.node not in first or r.rank < first[r.node][0]:
                first[r.node] = (r.rank, r.server)
        order = sorted(first, key=lambda n: first[n][0])
        node_of = {r.rank: r.node for r in reports}
        mine = node_of[me]
        wanted = min(self.count, len(order)) - 1
        twin_nodes = {node_of[t] for t in my_twins if t in node_of and node_of[t] != mine}
        if (self._dir, self._rank) != (Path(snapshot_dir), me):
            self._done = None
        self._dir, self._rank = Path(snapshot_dir), me
        self._queued, self._held = False, []
        self._last_commit = None  # the gap across a restore is not a commit interval
        if wanted <= 0 or len(twin_nodes) >= wanted:
            self.targets = []
            return
        i = order.index(mine)
        servers = [first[order[(i + j) % len(order)]][1] for j in range(1, wanted + 1)]
        self.targets = [s for s in servers if s] if all(servers) else []

    def done(self) -> int | None:
        """The newest step of this rank whose copy into other nodes' memory finished (as far as this
        rank has seen its agent report it), or None."""
        if self._dir is None:
            return None
        status = PushStatus.read(status_path(self._dir, "shard", self._rank))
        if status is not None and status.ok and (self._done is None or status.step > self._done):
            self._done = status.step
        return self._done

    def busy(self) -> bool:
        """Whether this rank's last copy is not finished (its request not yet written or still there).
        Asked once per commit, it also times the commits (the agent paces copies by their interval)."""
        now = time.monotonic()
        if self._last_commit is not None:
            gap = now - self._last_commit
            self.interval = gap if not self.interval else 0.75 * self.interval + 0.25 * gap
        self._last_commit = now
        if self._queued:
            return True
        return self._dir is not None and push_path(self._dir, "shard", self._rank).exists()

    def mark(self) -> bool:
        """This commit is a copy step (decided together): True if this rank asks for a copy."""
        if not self.targets:
            return False
        self._queued = True
        return True

    def request(self, mem: ShardSlots, slot: int, header: dict[str, Any], meta_crc: int) -> None:
        """The marked step's slot is published (on the snapshot writer's thread): ask for its copy."""
        req = PushRequest(mem.kind, mem.rank, mem.name(slot), header["step"], header["world_size"], header["nbytes"],
                          meta_crc, list(self.targets), round(self.interval, 3))  # fmt: skip
        req.write(mem.dir)
        self._queued = False
        mem.hold(slot)
        self._held.append(slot)
        while len(self._held) > 2:
            mem.release(self._held.pop(0))

    def cancel(self) -> None:
        """A marked snapshot was not published (an error): do not wait for its request."""
        self._queued = False
