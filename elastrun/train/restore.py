"""The one restore loop, for every kind of state: agree on a plan, fetch, load, restore the RNG states.

``State.restore()`` is collective.  Each rank reports what it can read (its part's ``report()``:
snapshots and RNG files on its node, complete-looking checkpoints, what its own objects hold under
``et.run``); one ``all_gather`` shares the reports; every rank runs the same pure function on them
(the part's ``plan()``: ``plan.py``, ``sharded/shard_plan.py``) and fetches its bytes of the agreed step
(``load()``).  A copy that could not be read, on any rank, is left out and the next plan is tried;
the objects are written only once every rank has its bytes.  Then each rank's RNG states are
gathered from whoever holds them (or derived from the step and rank) and applied.

The kind of state decides where bytes come from and how they are laid out (``replicated.py``,
``sharded/shards.py``); this loop, the order of its collectives and the RNG rule are the same.
"""

from __future__ import annotations

from typing import Any

from elastrun.train import dist as edist
from elastrun.train import reform, rng
from elastrun.train.part import Core, Objects, Part


def run(core: Core, objects: Objects, part: Part) -> str | None:
    """Load the newest state every rank can reach; its source (``memory``, ``peer``, ``disk``,
    ``live``), None for a fresh start, or ``Part.LATER`` when ``State.attach()`` will do it.
    Collective (unless the part answers alone)."""
    core.pipe.drain()
    core.abandon.set()
    try:
        core.pipe.persister.wait()
    finally:
        core.abandon.clear()
    part.transfer = None
    answer = part.prepare()
    if answer is not Part.GO:
        return answer
    reports = edist.all_gather(part.report())
    part.begin(reports)
    excluded: set[tuple] = set()
    wrote = False
    for _ in range(part.attempts(reports)):
        plan = part.plan(reports, excluded)
        if plan is None:
            part.nothing(reports, excluded, wrote)
            return None
        apply, failed, written = part.load(plan, reports, excluded)
        outcomes = edist.all_gather((list(failed), written))
        bad = {tuple(f) for mine, _ in outcomes for f in mine}
        if bad:  # the copies that could not be read are left out of the next plan
            excluded |= bad
            wrote = wrote or any(w for _, w in outcomes)  # written into, not loaded
            continue
        assert apply is not None
        source = apply()
        restore_rng(core, objects, plan, part)
        part.restored(plan)
        return source
    raise RuntimeError("State.restore(): no saved state could be loaded on every rank")


def restore_rng(core: Core, objects: Objects, plan: Any, part: Part) -> None:
    """Gather each rank's RNG states of ``plan.step`` from whoever holds them (``plan.rng_holders``),
    then apply them, or derive them from the step and rank where nobody does."""
    mine: dict[int, bytes] = {}
    live = objects.live if objects.live_step() == plan.step else None
    for k, holder in plan.rng_holders.items():
        if holder != core.rank:
            continue
        blob = live.rng if live is not None and k == core.rank else core.mem.read_rng(k, plan.step)
        if blob is None and plan.step in part.disk and core.ckpt is not None:
            blob = core.ckpt.load_rng(part.disk[plan.step], k)
        if blob is not None:
            mine[k] = blob
    merged: dict[int, bytes] = {}
    for got in edist.all_gather(mine):
        merged.update(got)
    payload = merged.get(core.rank)
    step, rank = plan.step, core.rank
    if payload is None and reform.active():  # derived states, captured for a later re-form
        current = rng.capture()
        rng.derive(step, rank)
        payload = rng.capture()
        rng.apply(current)
    if payload is not None:
        objects.remember_live(payload, core.world_size)

    def apply() -> None:
        if payload is not None:
            rng.apply(payload)
        else:
            rng.derive(step, rank)

    # The DataLoader draws a seed from torch's generator whenever an iterator is created.  An
    # uninterrupted run does that at the start of an epoch only, so mid-epoch the restored
    # states are applied after the new iterator has drawn, just before its first batch.
    sampler = objects.sampler
    if sampler is not None and sampler.position > 0:
        sampler.before_first_batch(apply)
    else:
        apply()
