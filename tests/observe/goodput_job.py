"""Worker of the goodput accuracy test: elastrun.train steps that log their own times.

``MODE=run`` trains through ``et.run`` (kept processes, in-process re-forms); ``MODE=plain`` is the
usual loop (``init_distributed``, ``restore``, loop), restarted by the agent after every fault.
Each process appends JSON lines to ``$TRUTH_DIR/<pid>.jsonl``, written with its own clock and
independent of elastrun's step records: ``proc`` (process creation, from /proc), ``ready`` (model
built, before the restore), ``restore`` (plain mode: start, end, source, step), ``enter`` (the
training body starts: after the restore), and ``step`` (n, start, commit entered, commit returned; also
when the commit ends the body with a re-form, as a join's pause does at the end of a commit, or ends a
pre-empted rank after its checkpoint).
Each line is flushed at once, so a SIGKILLed worker loses none.

The job runs until ``$STOP_FILE`` names a step count (written by the test), then finishes at it.
"""

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import elastrun.train as et
from elastrun.train.reform import Reform

STEP_SECONDS = float(os.environ.get("STEP_SECONDS", "0.05"))


def _created() -> float:
    with open("/proc/self/stat") as fh:
        ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


def main() -> None:
    out = open(Path(os.environ["TRUTH_DIR"]) / f"{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def log(event: str, **fields) -> None:
        out.write(json.dumps({"ev": event, "pid": os.getpid(), **fields}) + "\n")

    log("proc", t=_created())
    stop_file = Path(os.environ["STOP_FILE"])
    torch.manual_seed(0)
    net = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    state = et.State(model=net, optimizer=opt)
    log("ready", t=time.time())
    final: list[int] = []

    def done() -> bool:
        if not final and stop_file.exists():
            final.append(int(stop_file.read_text()))
        return bool(final) and state.step >= final[0]

    def train(state: et.State) -> None:
        log("enter", t=time.time(), step=state.step, source=state.last_restore, rank=dist.get_rank(),
            world=dist.get_world_size())
        model = DDP(net)
        while not done():
            began = time.time()
            loss = model(torch.randn(4, 16)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(STEP_SECONDS)
            entered, before, ended = time.time(), state.step, False
            try:
                state.commit()
                ended = True
            except (Reform, SystemExit):  # raised as the commit ended (a join's pause; a pre-empted rank's exit
                ended = True                # after its checkpoint): the step is done all the same
                raise
            finally:  # not a commit whose all-reduce failed (a dead peer): its step counted, then was lost
                if ended and state.step > before:
                    log("step", n=state.step, t0=began, t1=entered, t2=time.time(), rank=dist.get_rank(),
                        world=dist.get_world_size())

    if os.environ.get("MODE") == "run":
        et.run(train, state)
    else:
        et.init_distributed()
        began = time.time()
        source = state.restore()
        log("restore", t0=began, t1=time.time(), source=source, step=state.step)
        train(state)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
