"""One rank of the DDP joiner tests (``test_joiner_wire.py``), run without a launcher.

``train SNAP CKPT``: at world size 1, six committed steps of a small MLP with SGD + momentum, a
durable checkpoint of step 3; prints the last step and a digest of the model's and optimizer's bytes.
``restore SNAP CKPT``: builds the model from another seed, restores, and prints the source, the step,
the digest, whether the parameters kept their memory (the bytes landed in place) and the transfer;
exits 3 with the message when ``restore()`` refuses.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import torch.distributed as dist

import elastrun.train as et
from elastrun.shared import procexit


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                h.update(v.numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    mode, snap, ckpt = sys.argv[1:4]
    et.init_distributed()
    torch.manual_seed(dist.get_rank() + 1)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)])  # 4 MiB weights, 4 KiB biases
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    # every commit snapshotted (the default would space a 24 MiB state's out): node 0 holds steps 4-6
    state = et.State(model=model, optimizer=opt, snapshot_dir=snap, checkpoint_dir=ckpt or None, handle_signals=False,
                     snapshot_every=1)
    if mode == "train":
        x = torch.randn(8, 1024)
        for i in range(6):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            state.commit()
            if i == 2:
                state.checkpoint()
        state.flush()
        out = {"step": state.step, "digest": digest(model, opt)}
    else:
        ptrs = [p.data_ptr() for p in model.parameters()]
        try:
            source = state.restore()
        except RuntimeError as e:
            print(json.dumps({"error": str(e)}), flush=True)
            procexit.leave(3)
        out = {"source": source, "step": state.step, "digest": digest(model, opt),
               "in_place": ptrs == [p.data_ptr() for p in model.parameters()], "transfer": state.last_transfer}
    state.close()
    print(json.dumps(out), flush=True)
    procexit.leave(0)  # as elastrun's workers end: torch's own teardown can abort or hang after the work


if __name__ == "__main__":
    main()
