"""A GPU job for ``test_snapshots_cuda.py``: deterministic training of a model whose snapshot copy
takes tens of milliseconds, under elastrun with ``State(snapshot_every=1)``.

``CRASH_AT`` (attempt 0 only): SIGKILL right after that commit returned, while the snapshot's copy is
still on the side stream (``inflight.json`` says whether it was).  Every attempt writes
``restore.a<attempt>.json`` (source, step); the last writes ``final.json`` (step, SHA-256 of the
parameters).  ``STEPS`` (default 16) steps in all.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
from pathlib import Path

import torch

import elastrun.train as et


def main() -> None:
    torch.use_deterministic_algorithms(True)
    out = Path(os.environ["OUT_DIR"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    et.init_distributed()
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(2048, 8192, bias=False), torch.nn.GELU(),
                                  torch.nn.Linear(8192, 2048, bias=False)) for _ in range(4)]  # fmt: skip
    net = torch.nn.Sequential(*blocks).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    g = torch.Generator(device="cuda").manual_seed(1)
    data = torch.randn(16, 256, 2048, device="cuda", generator=g)
    state = et.State(model=net, optimizer=opt, snapshot_every=1, handle_signals=False)
    source = state.restore()
    (out / f"restore.a{attempt}.json").write_text(json.dumps({"source": source, "step": state.step}))
    crash_at = int(os.environ.get("CRASH_AT", "-1"))
    while state.step < int(os.environ.get("STEPS", "16")):
        net(data[state.step]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state.commit()
        if attempt == 0 and state.step == crash_at:
            copy = state._pipe._device_copy
            inflight = copy is not None and not copy.landed()
            (out / "inflight.json").write_text(json.dumps({"inflight": inflight, "step": state.step}))
            os.kill(os.getpid(), signal.SIGKILL)
    state.close()
    sha = hashlib.sha256()
    for t in net.state_dict().values():
        host = t.detach().cpu().contiguous()
        sha.update((ctypes.c_char * (host.numel() * host.element_size())).from_address(host.data_ptr()))
    (out / "final.json").write_text(json.dumps({"step": state.step, "sha256": sha.hexdigest()}))


if __name__ == "__main__":
    main()
