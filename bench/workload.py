"""The training script every launcher benchmark runs, under torchrun and elastrun alike.

A small DDP model on gloo, one JSON line per event in ``$BENCH_LOG/<pid>.jsonl``:
``proc`` (process creation time, from /proc), ``start`` (script begins), ``imported``
(torch and DDP imported), ``pg`` (process group initialised), ``ddp`` (model wrapped) and one
``step`` line per step (``t0`` its start, ``t`` its end: for goodput, bench/goodput_steps.py).
Per-process files keep the phases of each attempt apart, since ranks are reassigned on restarts.
Environment: STEPS (default 1000), STEP_SECONDS (default 0.05), CRASH_AT_STEP/CRASH_RANK/
CRASH_ONCE_FILE (exit 1 there, once: the file's mtime is the crash).
"""

import time

T_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402


def _log(fh, event: str, **fields) -> None:
    fh.write(json.dumps({"ev": event, "t": time.time(), **fields}) + "\n")


def _process_start() -> float:
    """This process's creation time (10 ms resolution), as Unix time."""
    with open("/proc/self/stat") as fh:
        ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
    since_boot = ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


def main() -> None:
    log = open(os.path.join(os.environ["BENCH_LOG"], f"{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115
    _log(log, "proc", value=_process_start())
    log.write(json.dumps({"ev": "start", "t": T_START}) + "\n")
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    _log(log, "imported")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _log(log, "pg", rank=rank, world=world, gen=gen)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _log(log, "ddp", rank=rank)
    steps = int(os.environ.get("STEPS", "1000"))
    pause = float(os.environ.get("STEP_SECONDS", "0.05"))
    crash_at = int(os.environ.get("CRASH_AT_STEP", "-1"))
    crash_rank = int(os.environ.get("CRASH_RANK", "0"))
    once = os.environ.get("CRASH_ONCE_FILE")
    for step in range(steps):
        began = time.time()
        if step == crash_at and rank == crash_rank and once and not os.path.exists(once):
            open(once, "w").close()
            sys.exit(1)
        x = torch.randn(16, 32)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        _log(log, "step", n=step, rank=rank, world=world, gen=gen, t0=began)
        if pause:
            time.sleep(pause)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
