"""GPU benchmark of elastrun.train: what ``commit()`` costs beside the step, the copy rates, restores,
and a crash to the next step, side by side with no snapshot and with torch DCP's ``async_save``.

For each model (``gpu_models.py``: 126M and 336M parameters) and mode (DDP, FSDP2), in one process
on one GPU (NCCL, world size 1), blocks of steps each ended by a device synchronise:

* ``plain``: no ``elastrun.train`` (blocks of it alternate with the blocks below: each overhead is the
  median ratio of such pairs);
* ``default``: ``State`` at its defaults (snapshots spaced from their measured cost), measured once
  the spacing has settled; the spacing chosen and its figures;
* ``every1``: ``State(snapshot_every=1)``;
* ``dcp``: ``dcp.async_save`` of the same state every as many steps as the default chose, staged
  in pinned shared memory (``DefaultStager``), written to ``/dev/shm``; the optimizer's pre-hook
  waits for its staging, as ``State``'s waits for its copy;
* ``restore``: a second ``State`` restoring the last snapshot from node memory onto the GPU, three
  times: the first restore, a second, and a third under cProfile (where the fixed costs go).

Beside them, for the puzzles of the first H200 run: each settling step's time on the card, the Python
threads alive during the pairs, a block without snapshots after the ``State`` is closed, the training
thread's CPU time and the garbage collector's in each block, and steps each followed by a host wait for
the training stream (what a flag all-reduce read on the host costs under NCCL).

Before them a crash (``gpu_job.py`` under ``elastrun --standalone``, SIGKILLed after 50 commits, timed
from the kill to its replacement's first finished step); after them the raw rates (device to host into
a page-locked and a pageable ``/dev/shm`` mapping; host to device through ``gpu/load.py``).

With ``--teardown``, how a killed CUDA worker dies and what a replacement started at the kill could do
meanwhile (``gpu_teardown.py``).

Usage: ``python bench/bench_gpu.py [--models 126M,336M] [--modes ddp,fsdp] [--out results.json]``.
Every part is bounded; a part that fails is reported and the others go on.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import inspect
import io
import itertools
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import elastrun.train as et  # noqa: E402
from bench.gpu_models import batch, build, state_bytes, step  # noqa: E402
from bench.gpu_teardown import teardowns  # noqa: E402

SHM = Path("/dev/shm")
#: Pairs of blocks (without, with commit()) per measurement.
ROUNDS = 3


#: Python's garbage collections so far: how many (of the oldest generation) and their seconds.
_GC = {"s": 0.0, "n": 0, "full": 0, "t0": 0.0}


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _GC["t0"] = time.perf_counter()
    else:
        _GC["s"] += time.perf_counter() - _GC["t0"]
        _GC["n"] += 1
        _GC["full"] += info.get("generation") == 2


gc.callbacks.append(_on_gc)


def block(n: int, fn, host: list | None = None) -> float:
    """Seconds per call of ``fn`` over ``n`` calls, the training stream synchronised at both ends.

    Not the whole device: a snapshot's copy still on the side stream at a block's end is not time
    the training waits for (it overlaps the next steps).  ``torch.cuda.synchronize()`` here charged
    up to one whole copy per block to the block (measured on the H200: up to 7 ms a step for the
    336M model in blocks of 16 steps).

    ``host``: appended with the training thread's CPU time and the garbage collector's, per call
    (a step bound by the host slows down when either grows: the 126M FSDP2 puzzle of the H200 run)."""
    torch.cuda.current_stream().synchronize()
    gc0, full0, s0 = _GC["n"], _GC["full"], _GC["s"]
    cpu = time.thread_time()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.current_stream().synchronize()
    wall = (time.perf_counter() - t) / n
    if host is not None:
        host.append({"cpu_ms": round((time.thread_time() - cpu) / n * 1e3, 2),
                     "gc_ms": round((_GC["s"] - s0) / n * 1e3, 3), "gcs": _GC["n"] - gc0,
                     "full_gcs": _GC["full"] - full0})  # fmt: skip
    return wall


def until(predicate, fn, most: int) -> int:
    """Call ``fn`` until ``predicate()`` (at most ``most`` times); returns the calls made."""
    for i in range(most):
        if predicate():
            return i
        fn()
    return most


def measure(name: str, mode: str, steps: int, parts: set[str]) -> dict:
    out: dict = {"model": name, "mode": mode}
    model, opt = build(name, mode)
    x = batch(name)
    for _ in range(3):
        step(model, opt, x)
    out["state_gb"] = state_bytes(model, opt) / 1e9
    host: list = []
    plain = block(steps, lambda: step(model, opt, x), host)
    out["plain_ms"] = plain * 1e3
    out["plain_host"] = host[0]
    out["objects"] = [len(gc.get_objects())]
    # Each step followed by a wait for the training stream on the host: what a per-commit flag all-reduce
    # read back on the host (``dist.maxima`` under NCCL, world size > 1) would cost.
    out["sync_each_ms"] = block(steps, lambda: (step(model, opt, x), torch.cuda.current_stream().synchronize())) * 1e3

    def trained(state: et.State):
        def one() -> None:
            step(model, opt, x)
            state.commit()
        return one

    work = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=SHM))
    try:
        # -- default settings: spaced by their measured cost ------------------------------------
        began = time.perf_counter()
        state = et.State(model=model, optimizer=opt, snapshot_dir=work / "default", handle_signals=False)
        pipe = state._pipe
        # Each step's end marked on the training stream: the gaps between the marks are the steps as
        # the card saw them, stalls included (issue 32, item 4: no step pays for the slots' first touch
        # while they are made in the background).
        marks: list[torch.cuda.Event] = []
        one = trained(state)

        def marked() -> None:
            one()
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()

        warm = until(lambda: pipe.meter is not None and pipe.meter.samples >= 3, marked, 400)
        out["settle_steps"], out["settle_s"] = warm, time.perf_counter() - began
        torch.cuda.current_stream().synchronize()
        gaps = [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
        if gaps:
            out["settle_step_ms"] = {"median": statistics.median(gaps), "max": max(gaps),
                                     "over_2x_plain": sum(g > 2 * out["plain_ms"] for g in gaps),
                                     "first": [round(g, 1) for g in gaps[:12]]}  # fmt: skip
        # Blocks with and without commit() alternate; the overhead is the median of each pair's ratio,
        # so that the card's drift (clocks, temperature) does not land on one side.
        plain_host: list = []
        commit_host: list = []
        pairs = [(block(steps, lambda: step(model, opt, x), plain_host), block(steps, trained(state), commit_host))
                 for _ in range(ROUNDS)]  # fmt: skip
        out["pairs_ms"] = [(round(p * 1e3, 2), round(c * 1e3, 2)) for p, c in pairs]
        out["pairs_host"] = {"plain": plain_host, "commit": commit_host}
        out["threads"] = sorted(t.name for t in threading.enumerate())  # alive beside the plain blocks too
        out["objects"].append(len(gc.get_objects()))
        out["default_ms"] = statistics.median(c for _, c in pairs) * 1e3
        out["default_ratio"] = statistics.median(c / p for p, c in pairs)
        m = pipe.meter
        out["every"] = pipe.every_now
        out["spacing"] = pipe.said
        if m is not None:
            out.update(step_s=m.step_s, cost_s=m.cost_s, copy_s=m.copy_s, staged=m.staged,
                       d2h_gbps=(m.nbytes / m.copy_s / 1e9) if m.copy_s else None)
        out["deferred"] = pipe.deferred
        out["pinned"] = not pipe._unpinned
        if "profile" in parts:  # where the training thread's time goes in a block with commit()
            profile = cProfile.Profile()
            profile.runcall(block, steps, trained(state))
            report = io.StringIO()
            pstats.Stats(profile, stream=report).sort_stats("tottime").print_stats(30)
            out["commit_profile"] = report.getvalue()[-6000:]
        state.flush()
        every = max(1, int(out["every"]))
        # -- restore from node memory onto the GPU ------------------------------------------------
        if "restore" in parts:
            # Three restores: the first (the lanes' page-locked buffers made in it when this is the
            # process's first), a second (buffers made), a third under cProfile: where the fixed costs go.
            timed = []
            for k in range(3):
                again = et.State(model=model, optimizer=opt, snapshot_dir=work / "default", handle_signals=False)
                torch.cuda.synchronize()
                profile = cProfile.Profile() if k == 2 else None
                t = time.perf_counter()
                source = again.restore() if profile is None else profile.runcall(again.restore)
                torch.cuda.synchronize()
                timed.append(time.perf_counter() - t)
                again.close()
            report = io.StringIO()
            pstats.Stats(profile, stream=report).sort_stats("cumulative").print_stats(14)
            out.update(restore_source=source, restore_step=again.step, restore_s=timed[0],
                       restore_gbps=out["state_gb"] / timed[0], restore_again_s=timed[1],
                       restore_profile=report.getvalue()[-3000:])  # fmt: skip
        state.close()
        host = []
        out["plain_after_close_ms"] = block(steps, lambda: step(model, opt, x), host) * 1e3
        out["after_close_host"] = host[0]
        # -- a snapshot of every step --------------------------------------------------------------
        if "every1" in parts:
            state = et.State(model=model, optimizer=opt, snapshot_dir=work / "every1", snapshot_every=1,
                             handle_signals=False)  # fmt: skip
            until(lambda: len(state._mem.scan()) >= 2, trained(state), 400)
            pairs = [(block(steps, lambda: step(model, opt, x)), block(steps, trained(state)))
                     for _ in range(ROUNDS)]  # fmt: skip
            out["every1_ms"] = statistics.median(c for _, c in pairs) * 1e3
            out["every1_ratio"] = statistics.median(c / p for p, c in pairs)
            out["every1_deferred"] = state._pipe.deferred
            state.close()
        # -- torch DCP async_save, at the default's spacing ----------------------------------------
        if "dcp" in parts:
            try:
                plain_ms = block(steps, lambda: step(model, opt, x)) * 1e3
                out["dcp_ms"] = dcp_async(model, opt, x, work / "dcp", every, steps) * 1e3
                out["dcp_ratio"] = out["dcp_ms"] / plain_ms
            except Exception as e:  # reported, the rest goes on
                out["dcp_error"] = f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for k in ("default", "every1", "dcp"):
        if f"{k}_ratio" in out:
            out[f"{k}_overhead_pct"] = (out[f"{k}_ratio"] - 1) * 100
    return out


def dcp_async(model, opt, x, where: Path, every: int, steps: int) -> float:
    """Seconds per step with ``dcp.async_save`` every ``every`` steps (pinned shared-memory staging)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # torch 2.11's async_save closes the stager it is given once the upload is done (the KeyError
    # "<class 'type'>" of the H200 runs: a closed stager has no copier left); the versions whose
    # async_save closes only the stagers it made keep theirs, with their pinned storages cached.
    keeps = "owned_async_stager" in inspect.getsource(dcp.async_save)
    options = StagingOptions(True, True, True, True)  # pinned, shared memory, async, non-blocking
    stager = DefaultStager(options)
    pending: dict = {"staging": None, "upload": None, "saves": 0}

    def hook(*_):
        if pending["staging"] is not None:
            pending["staging"].result()  # the parameters are about to change
            pending["staging"] = None

    handle = opt.register_step_pre_hook(hook)
    count = [0]

    def one() -> None:
        nonlocal stager
        step(model, opt, x)
        count[0] += 1
        if count[0] % every == 0:
            if pending["upload"] is not None:
                pending["upload"].result()
            if pending["saves"] and not keeps:
                stager = DefaultStager(options)
            pending["saves"] += 1
            tensors = {f"{i}.{k}": v for i, s in enumerate(opt.state.values()) for k, v in s.items()}
            resp = dcp.async_save({"model": dict(model.state_dict()), "optim": tensors},
                                  checkpoint_id=str(where / str(count[0])), async_stager=stager)  # fmt: skip
            if hasattr(resp, "staging_completion"):
                pending["staging"], pending["upload"] = resp.staging_completion, resp.upload_completion
            else:
                pending["upload"] = resp

    try:
        # One save to warm up, then two saves timed: each costs seconds (the H200 run: 1.9-4.9 s), so
        # more would take the bench past its time in tools/gpu_check.sh and tell nothing new.
        for _ in range(every):
            one()
        return block(max(2 * every, 4), one)
    finally:
        hook()
        if pending["upload"] is not None:
            pending["upload"].result()
        handle.remove()
        stager.close()


def rates(nbytes: int = 4 << 30) -> dict:
    """Device <-> host rates: into a page-locked and a pageable ``/dev/shm`` mapping, and back
    through ``gpu/load.py``'s page-locked lanes and a plain pageable copy."""
    from elastrun.train.gpu import load
    from elastrun.train.gpu.device import CudaDevice
    from elastrun.train.slotmem import SlotMemory

    out: dict = {}
    dev = CudaDevice(torch.cuda.current_device())
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(7)
    d = Path(tempfile.mkdtemp(prefix="bench-rates-", dir=SHM))
    try:
        t = time.perf_counter()
        pinned = SlotMemory.make(d / "pinned", nbytes, dev)
        out["make_pinned_s"] = time.perf_counter() - t
        out["pinned"] = pinned.pinned
        plain = SlotMemory.make(d / "plain", nbytes)
        for label, mem in (("d2h_pinned_gbps", pinned), ("d2h_pageable_gbps", plain)):
            host = torch.frombuffer(mem.mm, dtype=torch.uint8)
            s = torch.cuda.Stream()
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.cuda.stream(s):
                host.copy_(src, non_blocking=True)
            s.synchronize()
            out[label] = nbytes / (time.perf_counter() - t) / 1e9
            del host
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        load.load([load.Piece(dst, 0, nbytes)], d / "plain")
        torch.cuda.synchronize()
        out["h2d_lanes_gbps"] = nbytes / (time.perf_counter() - t) / 1e9
        assert bool((dst[:: 1 << 20] == 7).all()), "the loaded bytes differ"
        host = torch.frombuffer(plain.mm, dtype=torch.uint8)
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(host)
        torch.cuda.synchronize()
        out["h2d_pageable_gbps"] = nbytes / (time.perf_counter() - t) / 1e9
        del host
        pinned.close()
        plain.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


def crash(model: str, mode: str, *extra: str, timeout: float = 240.0) -> dict:
    """``gpu_job.py`` under ``elastrun --standalone``, SIGKILLed after 50 commits: kill -> next step.
    ``extra``: more arguments for ``gpu_job.py`` (``--cuda-first``)."""
    work = Path(tempfile.mkdtemp(prefix="bench-crash-"))
    log = work / "steps.jsonl"
    cmd = [sys.executable, "-m", "elastrun", "--standalone", "--nproc-per-node=1", "--max-restarts=1",
           f"--log-dir={work / 'logs'}", str(REPO / "bench" / "gpu_job.py"), "--model", model, "--mode", mode,
           "--log", str(log), *extra]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=work)
    out: dict = {"model": model, "mode": mode, "rc": proc.returncode, "wall_s": time.perf_counter() - t}
    try:
        records = [json.loads(line) for line in log.read_text().splitlines()]
        kill = next(r for r in records if r["event"] == "kill")
        after = [r for r in records if r["attempt"] == 1]
        restored = next(r for r in after if r["event"] == "restored")
        first = next(r for r in after if r["event"] == "step")
        out.update(kill_step=kill["step"], every=kill.get("every"), restore_source=restored["source"],
                   restored_step=restored["step"], restore_s=restored["seconds"],
                   crash_to_step_s=first["t"] - kill["t"])  # fmt: skip
        # Where the time went, from the kill: the script's first line ran (the agent restarted the
        # group and the worker was forked), main() began (its imports), the process group made, the
        # model built, restored, the first step done.
        at = {r["event"]: r for r in after}
        marks = [("script", at["main"]["began"])] + [(k, at[k]["t"]) for k in ("main", "cuda", "distributed",
                 "model", "built") if k in at] + [("restored", restored["t"]), ("step", first["t"])]  # fmt: skip
        # The agent's side, from its event log: when it saw the worker's exit (the dead process's
        # teardown, its CUDA context and page-locked memory included, comes before that) and when it
        # started the replacement.
        files = (work / "logs").glob("**/events-*.jsonl")
        events = [json.loads(line) for f in files for line in f.read_text().splitlines()]
        def earliest(kind: str) -> float | None:
            return min((e["ts"] for e in events if e["event"] == kind and e["ts"] >= kill["t"]), default=None)

        agent = [(name, t) for name, t in (("agent_saw_exit", earliest("worker_exit")),
                                           ("worker_started", earliest("worker_start"))) if t is not None]
        out["breakdown_s"] = {name: round(t - kill["t"], 3) for name, t in agent + marks}
        # The agent's own account of the restart ("workers running again N s after the failure").
        out["agent"] = [line for line in proc.stderr.splitlines() if "again" in line or "formed" in line][-3:]
    except (OSError, StopIteration, ValueError, KeyError) as e:
        out["error"] = f"{type(e).__name__}: {e}; {proc.stderr[-1500:]}"
    shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="126M,336M")
    p.add_argument("--modes", default="ddp,fsdp")
    p.add_argument("--pairs", default="", help="model:mode,... (instead of every model x mode)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--parts", default="restore,every1,dcp",
                   help="beside the default: restore, every1, dcp, profile (cProfile of a block with commit())")
    p.add_argument("--teardown", action="store_true", help="how a killed CUDA process dies (gpu_teardown.py)")
    p.add_argument("--crash-split", action="store_true",
                   help="the crash again, its CUDA context made before the process group (their times apart)")
    p.add_argument("--crash", default="336M:ddp", help="model:mode of the crash measurement ('' to skip)")
    p.add_argument("--rates", action=argparse.BooleanOptionalAction, default=True, help="the raw copy rates")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.exit(2, f"bench_gpu.py: no CUDA device here (torch {torch.__version__}): run it on a GPU machine, "
                  "e.g. through tools/gpu_check.sh\n")
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}

    def save() -> None:
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=1))

    # The crash first: a job of its own, whose figures are then kept if the bench runs out of its time.
    if a.crash:
        model, mode = a.crash.split(":")
        results["crash"] = crash(model, mode)
        print(json.dumps(results["crash"]), flush=True)
        if a.crash_split:
            results["crash_cuda_first"] = crash(model, mode, "--cuda-first")
            print(json.dumps(results["crash_cuda_first"]), flush=True)
        save()
    if a.teardown:
        results["teardown"] = teardowns()
        print(json.dumps(results["teardown"]), flush=True)
        save()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    # DCP's async_save needs a CPU backend beside NCCL (its own collectives run on a thread).
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    pairs = ([tuple(s.split(":")) for s in a.pairs.split(",")] if a.pairs else
             [(m, k) for m in a.models.split(",") for k in a.modes.split(",")])  # fmt: skip
    for name, mode in pairs:
        try:
            r = measure(name, mode, a.steps, set(a.parts.split(",")))
        except Exception:
            r = {"model": name, "mode": mode, "error": traceback.format_exc()[-2000:]}
        torch.cuda.empty_cache()
        results["runs"].append(r)
        print(json.dumps(r), flush=True)
        save()
    if a.rates:
        try:
            results["rates"] = rates()
        except Exception:
            results["rates"] = {"error": traceback.format_exc()[-2000:]}
        print(json.dumps(results["rates"]), flush=True)
        save()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
