"""One worker of ``bench_gpu.py``'s crash measurement: a GPU model under elastrun, ``elastrun.train``
at its defaults, SIGKILLed once after ``--crash-at`` commits.

Appends JSON lines to ``--log``: ``main`` (when the script's first line ran and when ``main()`` began),
``cuda`` (with ``--cuda-first``: the CUDA context made), ``distributed`` (the process group made),
``model`` (built and wrapped), ``built`` (the batch too), ``restored`` (source, step, seconds in
``restore()``), ``step`` (the first steps of each worker, once finished on the device) and ``kill``
(when it killed itself).
"""

from __future__ import annotations

import time

BEGAN = time.time()  # the script's first line: what came before it is the launcher's and the fork's

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import elastrun.train as et  # noqa: E402
from bench.gpu_models import batch, build, step  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="336M")
    p.add_argument("--mode", default="ddp")
    p.add_argument("--steps", type=int, default=70)
    p.add_argument("--crash-at", type=int, default=50)
    p.add_argument("--log", required=True)
    p.add_argument("--cuda-first", action="store_true", help="make the CUDA context before the process group")
    a = p.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def log(**record) -> None:
        with open(a.log, "a") as f:
            f.write(json.dumps({"attempt": attempt, "t": time.time(), **record}) + "\n")

    log(event="main", began=BEGAN)  # the script's first line, then main() (its imports done)
    if a.cuda_first:  # the CUDA context made alone first: its time apart from the process group's
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.empty(1, device="cuda")
        log(event="cuda")
    et.init_distributed()
    log(event="distributed")
    model, opt = build(a.model, a.mode)
    torch.cuda.synchronize()
    log(event="model")  # built on the GPU and wrapped (DDP: NCCL's communicator made, parameters broadcast)
    x = batch(a.model)
    torch.cuda.synchronize()
    log(event="built")
    state = et.State(model=model, optimizer=opt, handle_signals=False)
    began = time.perf_counter()
    source = state.restore()
    torch.cuda.synchronize()
    log(event="restored", source=source, step=state.step, seconds=time.perf_counter() - began)
    first = 0
    while state.step < a.steps:
        step(model, opt, x)
        state.commit()
        if first < 3:
            first += 1
            torch.cuda.synchronize()
            log(event="step", step=state.step)
        if attempt == 0 and state.step == a.crash_at:
            torch.cuda.synchronize()
            log(event="kill", step=state.step, every=state._pipe.every_now)
            os.kill(os.getpid(), signal.SIGKILL)
    state.close()


if __name__ == "__main__":
    main()
