"""The training script of ``bench_reform.py``: a 100M-parameter MLP trained with elastrun.train.

``MODE=reform`` runs the training body through ``et.run`` (in-process re-forms); ``MODE=restart``
is the same script written the usual way (``init_distributed``, ``restore``, loop), which every
launcher restarts.  One JSON line per event in ``$BENCH_LOG/<pid>.jsonl``, as ``workload.py``:
``restored`` (rank, world, source) each time the state is restored, one ``commit`` line as each
``commit()`` is called (a pause for a join ends the worker's fn at that commit's end, so its ``step``
line never comes) and one ``step`` line per committed step (``t0`` its start, ``tc`` the commit's call,
``t`` its return).  Environment: SIZE_M (model size
in millions, 100), BATCH (8), STEPS (100000), CRASH_AT_STEP/CRASH_RANK/CRASH_ONCE_FILE (exit 1
there, once: the file's mtime is the crash).

``FSDP=1`` (issue 24): the model is ``bench_sharded.make_model`` (FSDP2, ``fully_shard`` per layer)
with AdamW and a durable DCP checkpoint every 5 steps in ``CKPT``, built and sharded on the meta device
(docs/train.md's shape; initialised only on a fresh start); under ``MODE=reform`` inside the training
body and handed over with ``state.attach`` (the et.run shape).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import elastrun.train as et  # noqa: E402
from bench.bench_train import make_model  # noqa: E402


def main() -> None:
    log = open(os.path.join(os.environ["BENCH_LOG"], f"{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115

    def emit(event: str, **fields) -> None:
        log.write(json.dumps({"ev": event, "t": time.time(), **fields}) + "\n")

    size = int(os.environ.get("SIZE_M", "100"))
    if os.environ.get("FSDP") == "1":
        return sharded(size, emit)
    net = make_model(size)
    width = net[0].in_features
    opt = torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9)
    steps = int(os.environ.get("STEPS", "100000"))
    batch = int(os.environ.get("BATCH", "8"))
    crash_at = int(os.environ.get("CRASH_AT_STEP", "-1"))
    crash_rank = int(os.environ.get("CRASH_RANK", "0"))
    once = os.environ.get("CRASH_ONCE_FILE")
    state = et.State(model=net, optimizer=opt)

    def train(state: et.State) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        emit("restored", rank=rank, world=world, source=state.last_restore, step=state.step)
        model = DDP(net)
        g = torch.Generator().manual_seed(rank)
        while state.step < steps:
            began = time.time()
            if state.step == crash_at and rank == crash_rank and once and not os.path.exists(once):
                open(once, "w").close()
                sys.exit(1)
            x = torch.randn(batch, width, generator=g)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            committing = time.time()
            emit("commit", n=state.step + 1, rank=rank, world=world)  # a join's pause may end the fn there
            state.commit()
            emit("step", n=state.step, rank=rank, world=world, gen=int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
                 t0=began, tc=committing)

    if os.environ.get("MODE", "reform") == "reform":
        et.run(train, state)
    else:
        et.init_distributed()
        state.restore()
        train(state)


def sharded(size: int, emit) -> None:
    from bench.bench_sharded import make_model as make_sharded

    steps = int(os.environ.get("STEPS", "100000"))
    batch = int(os.environ.get("BATCH", "8"))
    reform = os.environ.get("MODE", "reform") == "reform"

    def build():
        """The documented shape (docs/train.md): built and sharded on the meta device, then given
        storage; its weights come from the restore, or from ``init`` on a fresh start."""
        with torch.device("meta"):
            model = make_sharded(size)
        model.to_empty(device="cpu")
        return model, torch.optim.AdamW(model.parameters(), lr=1e-6)

    def init(model) -> None:
        torch.manual_seed(0)
        for layer in model:
            layer.reset_parameters()

    def loop(state: et.State, model) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        emit("restored", rank=rank, world=world, source=state.last_restore, step=state.step)
        g = torch.Generator().manual_seed(rank)
        while state.step < steps:
            began = time.time()
            x = torch.randn(batch, model[0].in_features, generator=g)
            model(x).pow(2).mean().backward()
            backward = time.time()
            state._optimizer.step()
            state._optimizer.zero_grad()
            committing = time.time()
            emit("commit", n=state.step + 1, rank=rank, world=world, t=committing)
            state.commit()
            emit("step", n=state.step, rank=rank, world=world, gen=int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
                 t0=began, tb=backward, tc=committing)

    ckpt = {"checkpoint_dir": os.environ["CKPT"], "checkpoint_every": 5}
    if "ELASTRUN_SNAPSHOT_DIR" not in os.environ:  # torchrun: one memory per "node" (its agent), not one per machine
        ckpt["snapshot_dir"] = f"/dev/shm/elastrun-snap-bench-node-{os.getppid()}"
    if reform:
        state = et.State(**ckpt)

        def train(state: et.State) -> None:
            emit("group", rank=dist.get_rank(), world=dist.get_world_size())
            model, opt = build()
            emit("built", rank=dist.get_rank(), world=dist.get_world_size())
            if state.attach(model, opt) is None:  # nothing saved yet: a fresh start
                init(model)
            loop(state, model)

        et.run(train, state)
    else:
        et.init_distributed()
        emit("group", rank=dist.get_rank(), world=dist.get_world_size())
        model, opt = build()
        emit("built", rank=dist.get_rank(), world=dist.get_world_size())
        state = et.State(model=model, optimizer=opt, **ckpt)
        if state.restore() is None:
            init(model)
        loop(state, model)


if __name__ == "__main__":
    main()
