"""The models and the training step of the GPU benchmark (``bench_gpu.py``, ``gpu_job.py``).

A stack of ``Linear(d, 4d)``, GELU, ``Linear(4d, d)`` blocks without biases, a batch of 16,384 rows,
bf16 autocast, fused AdamW: the setup in which ``commit()`` was first measured on a GPU (issue 32).
"""

from __future__ import annotations

import torch

#: name -> (d, blocks)
MODELS = {"126M": (1024, 15), "336M": (2048, 10)}
BATCH = 16384


def build(name: str, mode: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model on the current GPU, wrapped for ``mode`` (``ddp``: DDP; ``fsdp``: FSDP2 with
    ``fully_shard`` on every Linear and the root), and its fused AdamW (foreach where fused is refused)."""
    d, blocks = MODELS[name]
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    with torch.device("cuda"):  # initialised on the GPU: a restarted worker does not wait for the CPU
        for _ in range(blocks):
            layers += [torch.nn.Linear(d, 4 * d, bias=False), torch.nn.GELU(), torch.nn.Linear(4 * d, d, bias=False)]
    net = torch.nn.Sequential(*layers)
    if mode == "ddp":
        model: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(net)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        model = fully_shard(net)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    except (RuntimeError, ValueError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def batch(name: str) -> torch.Tensor:
    d, _ = MODELS[name]
    g = torch.Generator(device="cuda").manual_seed(1)
    return torch.randn(BATCH, d, device="cuda", generator=g)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the parameters and optimizer state (what a snapshot copies)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    n = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    for s in opt.state.values():
        n += sum(local(v).numel() * local(v).element_size() for v in s.values() if isinstance(v, torch.Tensor))
    return n
