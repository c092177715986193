"""Per-rank random number generator states: capture, apply, and a deterministic fallback.

Each rank has its own RNG streams (torch CPU, CUDA, ``random``, and numpy when the program uses
it).  They are small (about 10 kB) and are snapshotted with every commit, so a replayed step
draws the same random numbers (dropout, augmentation) as the original one.
"""

from __future__ import annotations

import ctypes
import hashlib
import pickle
import random
import sys
from typing import Any

import torch


def _raw(t: torch.Tensor) -> bytes:
    """A generator state (a CPU ``uint8`` tensor) as plain bytes: pickling the tensor itself goes
    through torch's serialisation, two thirds of what a commit spent on its RNG states (70 of 124 us)."""
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel())


def _tensor(raw: bytes | torch.Tensor) -> torch.Tensor:
    """A generator state back as a tensor (payloads written before the raw form hold tensors)."""
    if isinstance(raw, torch.Tensor):
        return raw
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def capture() -> bytes:
    """This process's RNG states, pickled."""
    state: dict[str, Any] = {"torch": _raw(torch.get_rng_state()), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_raw(t) for t in torch.cuda.get_rng_state_all()]
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)


def apply(payload: bytes) -> None:
    """Restore RNG states captured by :func:`capture`."""
    state = pickle.loads(payload)
    torch.set_rng_state(_tensor(state["torch"]))
    random.setstate(state["random"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_tensor(t) for t in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def derive(step: int, rank: int) -> None:
    """Seed every generator from ``(step, rank)``: used for a rank whose saved state is gone
    (a node lost with its memory, or a rank that did not exist at that step)."""
    digest = hashlib.sha256(f"elastrun-rng/{step}/{rank}".encode()).digest()
    seed = int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF
    torch.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed & 0xFFFF_FFFF)
