"""The invariants checked after every chaos run, each returning a :class:`Check` (never raising),
so a run reports every violation at once.

* every sample is used exactly once per epoch by committed steps, and every committed step was
  run by a complete group (ranks 0..W-1, one record each);
* no committed step is lost: a step counts as committed once every rank of its group has begun
  the step after the next (its ``commit()`` of the next step returned, and that waited for the
  step's memory snapshot to be published), and every later group restores that step or a newer one;
* the parameters are bit for bit the same on every rank of a group: after each committed step and
  after each restore (also after an in-process re-form, where a survivor rolls back its own objects),
  and a restore of step *s* holds exactly the parameters that step *s* committed;
* the final parameters equal a failure-free reference: bit for bit a real failure-free run of the
  same length when every committed step ran at that world size; otherwise (the world size changed)
  an in-process replay of the committed steps (same model, same slices, gradients averaged over
  the step's world size) within :data:`REPLAY_RTOL` — the replay sums the ranks' gradients in rank
  order while gloo's all-reduce may add them in another order, so the last bits can differ;
* the job never stalls: after every fault it steps again within the stall bound, and at no other
  moment does it go that long without a committed step (:func:`steps_again`);
* no process of the run is left (PIDs tracked with psutil, never looked up by name);
* no key of the job is left in etcd.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

#: Largest allowed relative difference (max |a-b| / max |b|) between a resized run and its replay.
REPLAY_RTOL = 1e-4


@dataclass
class Check:
    """One invariant's verdict."""

    name: str
    ok: bool
    detail: str


def samples_once(steps: dict[int, list[dict[str, Any]]], samples: int) -> Check:
    """Every committed epoch used each sample id exactly once (the last epoch must be complete)."""
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for recs in steps.values():
        for r in recs:
            per_epoch[r["e"]].extend(r["i"])
    bad = []
    for epoch, ids in sorted(per_epoch.items()):
        if sorted(ids) != list(range(samples)):
            bad.append(f"epoch {epoch}: {len(ids)} ids, {len(set(ids))} distinct (expected {samples} once)")
    if not per_epoch:
        return Check("samples used once per epoch", False, "no committed step")
    if sorted(per_epoch) != list(range(len(per_epoch))):
        bad.append(f"epochs seen: {sorted(per_epoch)}")
    detail = "; ".join(bad[:5]) if bad else f"{len(per_epoch)} epochs x {samples} samples"
    return Check("samples used once per epoch", not bad, detail)


def complete_steps(steps: dict[int, list[dict[str, Any]]]) -> Check:
    """Steps 1..N all committed, each by ranks 0..W-1 of one generation with one world size."""
    bad = []
    if list(steps) != list(range(1, len(steps) + 1)):
        missing = sorted(set(range(1, max(steps, default=0) + 1)) - set(steps))
        bad.append(f"missing steps {missing[:10]}")
    for step, recs in steps.items():
        worlds = {r["w"] for r in recs}
        if len(worlds) != 1 or [r["r"] for r in recs] != list(range(recs[0]["w"])):
            bad.append(f"step {step}: ranks {[r['r'] for r in recs]} worlds {sorted(worlds)}")
    return Check("every committed step ran on a complete group", not bad,
                 "; ".join(bad[:5]) if bad else f"{len(steps)} steps")


def no_step_lost(records: list[dict[str, Any]], restores: list[dict[str, Any]]) -> Check:
    """Each generation restores at least the newest step every rank of the earlier ones committed.

    ``records`` are all step records (every generation's, committed or not); ``restores`` what every
    worker's ``restore()`` returned.  Step *s* is committed for good once every rank of its group
    wrote its record of step *s* + 2: that rank's ``commit()`` of *s* + 1 returned, and it waits for
    the snapshot of *s* to be published (and each rank's RNG state of *s* is written inside
    ``commit()`` of *s*).
    """
    ranks_at: dict[tuple[int, int], set[int]] = defaultdict(set)  # (generation, step) -> ranks with a record
    world: dict[int, int] = {}
    for r in records:
        ranks_at[(r["g"], r["s"])].add(r["r"])
        world[r["g"]] = r["w"]
    durable_of: dict[int, int] = {}
    for (g, s), ranks in ranks_at.items():
        if len(ranks) == world[g] and s >= 2:
            durable_of[g] = max(durable_of.get(g, 0), s - 2)
    restored: dict[int, int] = {}
    for r in restores:
        restored[r["g"]] = min(restored.get(r["g"], r["s"]), r["s"])
    bad = []
    durable = 0
    checked = 0
    gens = sorted(set(restored) | set(durable_of))
    for g in gens:
        if g in restored and durable:
            checked += 1
            if restored[g] < durable:
                bad.append(f"generation {g} restored step {restored[g]}, step {durable} had been committed")
        durable = max(durable, durable_of.get(g, 0))
    return Check("no committed step lost", not bad,
                 "; ".join(bad[:5]) if bad else f"{checked} restores, none behind a committed step")


def same_parameters(steps: dict[int, list[dict[str, Any]]], restores: list[dict[str, Any]],
                    records: list[dict[str, Any]] | None = None) -> Check:
    """Every rank of a group holds bit for bit the same parameters after each committed step and
    after each restore (records carry a SHA-256 of the parameters, ``h``); with ``records`` (all
    step records), a restore of step *s* also holds what the generation before it recorded for *s*."""
    recorded = {(r["g"], r["s"]): r.get("h") for r in records or [] if r.get("h") is not None}
    bad = []
    for step, recs in steps.items():
        if len({r.get("h") for r in recs}) != 1:
            bad.append(f"step {step} (generation {recs[0]['g']}): {len({r.get('h') for r in recs})} different")
    by_gen: dict[int, set[str | None]] = defaultdict(set)
    step_of: dict[int, int] = {}
    for r in restores:
        by_gen[r["g"]].add(r.get("h"))
        step_of[r["g"]] = r["s"]
    for g, hashes in sorted(by_gen.items()):
        if len(hashes) != 1:
            bad.append(f"restore of generation {g}: {len(hashes)} different")
            continue
        # What a restore of step s loads must be what step s committed: the parameters recorded by
        # the latest earlier generation that ran it.
        s = step_of[g]
        ran = [(gen, h) for (gen, st), h in (recorded or {}).items() if st == s and gen < g]
        if ran and max(ran)[1] not in hashes:
            bad.append(f"generation {g} restored step {s} with other parameters than generation "
                       f"{max(ran)[0]} committed there")
    return Check("parameters bit-identical across the ranks of a group", not bad,
                 "; ".join(bad[:5]) if bad else f"{len(steps)} steps and {len(by_gen)} restores, "
                 "each restore equal to what its step committed")


def replay(steps: dict[int, list[dict[str, Any]]], samples: int) -> dict[str, Any]:
    """The parameters a failure-free run of exactly these committed steps ends with."""
    import torch

    from tests.chaos.trainer import apply_grad, build, local_step

    dataset, net, opt = build(samples)
    _, xs, ys = dataset.tensors
    for recs in steps.values():
        world = recs[0]["w"]
        total = None
        for r in recs:
            idx = torch.tensor(r["i"])
            grad = local_step(net, xs[idx], ys[idx])
            total = grad if total is None else total + grad
        apply_grad(net, opt, total / world)
    return net.state_dict()


def final_parameters(out: Path, steps: dict[int, list[dict[str, Any]]], samples: int,
                     reference_sha: str | None) -> Check:
    """Bit for bit against ``reference_sha`` (a failure-free run at the same, fixed world size) when
    given, else within :data:`REPLAY_RTOL` of :func:`replay`."""
    import json

    import torch

    final = out / "final.json"
    if not final.exists():
        return Check("final parameters", False, "no final.json: the job did not finish")
    doc = json.loads(final.read_text())
    if doc["step"] != len(steps):
        return Check("final parameters", False, f"final step {doc['step']} but {len(steps)} committed steps")
    if reference_sha is not None:
        same = doc["sha256"] == reference_sha
        return Check("final parameters", same,
                     f"bit for bit equal to the failure-free run (sha256 {doc['sha256'][:12]})" if same
                     else f"sha256 {doc['sha256'][:12]} != failure-free {reference_sha[:12]}")
    got = torch.load(out / "final.pt")
    want = replay(steps, samples)
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    scale = max(float(want[k].abs().max()) for k in want)
    rel = diff / scale
    return Check("final parameters", rel <= REPLAY_RTOL,
                 f"relative difference to the failure-free replay {rel:.2e} (tolerance {REPLAY_RTOL:g})")


def step_gaps(records: list[dict[str, Any]], bound: float) -> list[str]:
    """Every stretch longer than ``bound`` seconds between two consecutive step records of the job
    (any rank, any generation), as text: a stall, even one nobody was watching while it lasted."""
    times = sorted(r["t"] for r in records)
    return [f"no step from {time.strftime('%H:%M:%S', time.localtime(a))} for {b - a:.1f} s"
            for a, b in zip(times, times[1:], strict=False) if b - a > bound]


def steps_again(faults: list[Any], bound: float, stalls: list[str], records: list[dict[str, Any]] = ()) -> Check:
    """After every fault the job stepped again within ``bound`` seconds (its ``first_step``: from the
    injection, or for a fault that must not restart anything from its end), no stall was seen at
    any other moment (``stalls``: the harness's stall findings), and no two consecutive step
    ``records`` are further apart than ``bound``."""
    late = [f"{f.kind}@node{f.node}: " + ("never" if f.first_step is None else f"{f.first_step:.1f} s")
            for f in faults if f.first_step is None or f.first_step > bound]
    bad = late + stalls + step_gaps(list(records), bound)
    steps = [f.first_step for f in faults if f.first_step is not None]
    slowest = max(steps, default=0.0)
    detail = ("; ".join(bad[:5]) if bad else
              f"{len(faults)} faults, the slowest stepped again after {slowest:.1f} s (bound {bound:g} s)")
    return Check("steps again after every fault (no stall)", not bad, detail)


def no_orphans(tracked: dict[int, float], timeout: float = 10.0) -> Check:
    """None of the tracked ``{pid: create_time}`` processes is still alive (waits up to ``timeout``)."""
    deadline = time.monotonic() + timeout
    alive: list[str] = []
    while True:
        alive = []
        for pid, created in tracked.items():
            try:
                proc = psutil.Process(pid)
                if abs(proc.create_time() - created) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid} ({' '.join(proc.cmdline()[:4])[:80]})")
            except psutil.Error:
                continue
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    return Check("no orphan processes", not alive,
                 f"still running: {', '.join(alive[:5])}" if alive else f"{len(tracked)} processes tracked, all gone")


def no_etcd_keys(list_keys, prefix: str, timeout: float = 10.0) -> Check:
    """No key under the job's prefix (leases of killed agents expire within their TTL: wait a bit)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            keys = list_keys(prefix)
        except RuntimeError as exc:
            return Check("no keys left in etcd", False, str(exc))
        if not keys or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    return Check("no keys left in etcd", not keys,
                 f"{len(keys)} left, e.g. {keys[:3]}" if keys else f"0 keys under {prefix}")
