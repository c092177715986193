"""Choosing the step to restore a sharded state from: a pure function of every rank's report.

Each rank reports the shard snapshot files its node holds (old rank, step, world size), the RNG
states on its node and the complete-looking durable checkpoints.  After one ``all_gather`` every
rank runs :func:`make_plan` on the same list, so all agree without another message.

A step is in memory when, for the world size it was committed at, the shard of every old rank
``0..W-1`` is in the memory of some node of the new group: the rank's own file or a replica of it
(the agents copy each node's committed shards to another node), or, under HSDP, the file of a
*twin* (a rank of another replica group that holds the same chunks); it is on disk when its
checkpoint is complete.  The newest such step is chosen (memory before disk at equal steps), with the rule of
``elastrun/train/plan.py`` on RNG states: when some rank's RNG state of that step is missing but
the step before is complete with all of them, the step before is used (a rank that died between
its collective and its commit lags by one step).  A memory restore reads each old rank's file from
the rank's own node if it holds it, else from a rank whose node does (``holders``); a disk restore
loads the step's DCP checkpoint.  When the plan goes to disk although a newer step is in some
node's memory, it says which old ranks' shards of that step are in no surviving node's memory
(``ShardPlan.lost``): the message names the step lost to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastrun.train.plan import pick_step


@dataclass
class ShardReport:
    """What one rank can read at restore time."""

    rank: int
    node: str  # ranks with the same node share a snapshot directory
    shards: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (step, world size) -> old ranks
    mem_rng: dict[int, list[int]] = field(default_factory=dict)  # rank -> steps of its RNG files on this node
    disk: dict[int, int] = field(default_factory=dict)  # step -> world size
    disk_rng: dict[int, list[int]] = field(default_factory=dict)  # step -> ranks with an RNG file
    #: (step, old rank) -> the old ranks holding the same chunks (HSDP's other replica groups), if any.
    twins: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    server: str | None = None  # this node's snapshot server (``host:port``), if any


@dataclass
class ShardPlan:
    """The agreed restore."""

    step: int
    source: str  # "memory" | "disk"
    saved_world_size: int
    holders: dict[int, list[int]]  # old rank -> new ranks whose node holds its shard of ``step``
    rng_holders: dict[int, int]  # new rank -> rank that supplies its RNG state (absent: derive)
    #: A newer step some node's memory has, and the old ranks whose shards of it none of the new
    #: group's nodes has (the plan went to an older step because of them), or None.
    lost: tuple[int, list[int]] | None = None


def _held(reports: list[ShardReport], excluded: set[tuple]) -> dict[tuple[int, int], dict[int, list[int]]]:
    """``{(step, world size): {old rank: new ranks whose node holds its file}}``."""
    have: dict[tuple[int, int], dict[int, list[int]]] = {}
    for r in reports:
        for (step, ws), olds in r.shards.items():
            for old in olds:
                if ("mem", r.node, step, old) not in excluded:
                    have.setdefault((step, ws), {}).setdefault(old, []).append(r.rank)
    return have


def _uncovered(reports: list[ShardReport], step: int, ws: int, holders: dict[int, list[int]]) -> list[int]:
    """Old ranks of ``(step, ws)`` whose chunks no held file has (neither their own nor a twin's)."""
    covered = set(holders)
    for old in holders:
        for r in reports:
            covered.update(r.twins.get((step, old), ()))
    return [k for k in range(ws) if k not in covered]


def memory_steps(reports: list[ShardReport], excluded: set[tuple]) -> dict[int, tuple[int, dict[int, list[int]]]]:
    """``{step: (world size, holders)}`` of the steps whose every shard is in some node's memory
    (``holders``: the old ranks whose files are read, each with the new ranks whose node has it)."""
    out: dict[int, tuple[int, dict[int, list[int]]]] = {}
    for (step, ws), holders in sorted(_held(reports, excluded).items()):
        if not _uncovered(reports, step, ws, holders):
            out[step] = (ws, {k: sorted(v) for k, v in sorted(holders.items())})  # the larger world wins a tie
    return out


def lost(reports: list[ShardReport], excluded: set[tuple], below: int | None) -> tuple[int, list[int]] | None:
    """The newest step in some node's memory newer than ``below`` (None: any), with the old ranks
    whose shards of it no node of the group has."""
    newer = [(step, ws, holders) for (step, ws), holders in _held(reports, excluded).items()
             if below is None or step > below]  # fmt: skip
    if not newer:
        return None
    step, ws, holders = max(newer)
    missing = _uncovered(reports, step, ws, holders)
    return (step, missing) if missing else None


def make_plan(reports: list[ShardReport], excluded: set[tuple] | None = None) -> ShardPlan | None:
    """The restore every rank agrees on, or None for a fresh start (nothing complete anywhere)."""
    excluded = excluded or set()
    mem = memory_steps(reports, excluded)
    disk: dict[int, int] = {}
    for r in reports:
        for step, ws in r.disk.items():
            if ("disk", step) not in excluded:
                disk[step] = ws
    saved = {**disk, **{s: ws for s, (ws, _) in mem.items()}}
    if not saved:
        return None
    step, holders = pick_step(reports, saved, excluded)
    if step in mem:
        ws, shard_holders = mem[step]
        return ShardPlan(step, "memory", ws, shard_holders, holders, lost(reports, excluded, step))
    return ShardPlan(step, "disk", disk[step], {}, holders, lost(reports, excluded, step))
