"""Choosing what to restore: a pure function of what every rank reports, so all ranks agree.

Each rank reports what it can read: complete memory snapshots on its node, RNG states on its node,
and complete-looking disk checkpoints.  After one ``all_gather`` every rank runs :func:`make_plan`
on the same list and gets the same answer, with no extra round of messages.

Rules, in order:

1. The step is the newest one whose replicated state is readable somewhere (any node's memory or
   the checkpoint directory).
2. If some rank's RNG state for that step is missing but the step before is complete with every
   rank's RNG, the step before is used.  Under DDP a rank that died between the gradient
   all-reduce and its ``commit()`` lags the others by exactly one step; going back that one step
   keeps a crashed run bit-for-bit equal to an uninterrupted one.  Otherwise (a node was lost with
   its memory, or the world grew) the missing RNG states are derived from ``(step, rank)``.
3. The source is ``memory`` when every rank's node holds that step, ``peer`` when only some do
   (the others read it from the snapshot server of a node that has it, or, without snapshot
   servers, the lowest such rank broadcasts it), else ``disk`` (the lowest rank that sees the checkpoint
   reads and verifies it, then broadcasts it, so a checkpoint is read once, not once per rank).

After an in-process re-form (``elastrun.train.run``) a surviving rank also reports the step its
own objects hold (``live``: nothing ran ``optimizer.step()`` since that commit).  A live step
counts as readable on that rank, as its node's memory does: the source is ``live`` when every
rank holds the step live or in its node's memory (at least one live: those ranks copy nothing),
and a live rank can be the sender of ``peer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Report:
    """What one rank can read at restore time."""

    rank: int
    mem: dict[int, int] = field(default_factory=dict)  # step -> world size of a complete snapshot
    mem_rng: dict[int, list[int]] = field(default_factory=dict)  # rank -> steps on this node
    disk: dict[int, int] = field(default_factory=dict)  # step -> world size
    disk_rng: dict[int, list[int]] = field(default_factory=dict)  # step -> ranks with an RNG file
    live: dict[int, int] = field(default_factory=dict)  # step -> world size, held by this process's objects
    server: str | None = None  # this node's snapshot server (``host:port``), if any
    mem_ids: dict[int, tuple[str, int]] = field(default_factory=dict)  # step -> (slot name, meta CRC) there


@dataclass
class Plan:
    """The agreed restore: step, source, which rank sends the state, who supplies each RNG state."""

    step: int
    source: str  # "live" | "memory" | "peer" | "disk"
    src_rank: int | None
    saved_world_size: int
    rng_holders: dict[int, int]  # rank -> rank that supplies its RNG state (absent: derive)


def _holders(reports: list[Report], step: int, excluded: set[tuple]) -> tuple[list[int], list[int]]:
    mem = [r.rank for r in reports if (step in r.mem and ("mem", r.rank, step) not in excluded) or step in r.live]
    disk = [r.rank for r in reports if step in r.disk and ("disk", step) not in excluded]
    return mem, disk


def _rng_holders(reports: list[Any], step: int, ranks: int, excluded: set[tuple]) -> dict[int, int]:
    out: dict[int, int] = {}
    for k in range(ranks):
        have = [
            r.rank
            for r in reports
            if step in r.mem_rng.get(k, ()) or (k in r.disk_rng.get(step, ()) and ("disk", step) not in excluded)
        ]
        if have:
            out[k] = k if k in have else min(have)
    return out


def pick_step(reports: list[Any], saved_ws: dict[int, int], excluded: set[tuple]) -> tuple[int, dict[int, int]]:
    """Rule 2 for any state: the newest saved step, or the one before it when only that one has every
    needed rank's RNG state; with the RNG holders of the step picked (``reports``: each with ``rank``,
    ``mem_rng`` and ``disk_rng``; ``saved_ws``: step -> world size, not empty)."""
    world = len(reports)

    def rng_complete(step: int) -> tuple[bool, dict[int, int]]:
        needed = min(world, saved_ws[step])
        holders = _rng_holders(reports, step, needed, excluded)
        return len(holders) == needed, holders

    step = max(saved_ws)
    complete, holders = rng_complete(step)
    if not complete and step - 1 in saved_ws:
        prev_complete, prev_holders = rng_complete(step - 1)
        if prev_complete:
            step, holders = step - 1, prev_holders
    return step, holders


def make_plan(reports: list[Report], excluded: set[tuple] | None = None) -> Plan | None:
    """The restore every rank agrees on, or None for a fresh start (nothing saved anywhere)."""
    excluded = excluded or set()
    world = len(reports)
    saved_ws: dict[int, int] = {}
    for r in reports:
        for step, ws in r.live.items():
            saved_ws[step] = ws
        for step, ws in r.mem.items():
            if ("mem", r.rank, step) not in excluded:
                saved_ws[step] = ws
        for step, ws in r.disk.items():
            if ("disk", step) not in excluded:
                saved_ws[step] = ws
    if not saved_ws:
        return None

    step, holders = pick_step(reports, saved_ws, excluded)
    mem, disk = _holders(reports, step, excluded)
    if len(mem) == world:
        live = any(step in r.live for r in reports)
        return Plan(step, "live" if live else "memory", None, saved_ws[step], holders)
    if mem:
        return Plan(step, "peer", min(mem), saved_ws[step], holders)
    return Plan(step, "disk", min(disk), saved_ws[step], holders)
