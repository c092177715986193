"""The tensors a sharded restore loads into, and loading any DCP checkpoint into a sharded state.

Both ``State``'s sharded restore (``shards.py``) and ``State.load_dcp`` give DCP's planner a
destination: a tensor for every saved key, on this rank's new shards (:func:`destination`): the
model's and optimizer's own tensors where they exist, new ones shaped like their parameter where
they do not (an optimizer whose state was never created).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from elastrun.train import dist as edist
from elastrun.train.sharded import durable
from elastrun.train.sharded.layout import Entry, Unsupported, is_dtensor, optimizer_positional, optimizer_tree

if TYPE_CHECKING:
    from elastrun.train.sharded.shards import ShardedPart


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a destination tensor must be: from a snapshot entry or a checkpoint's metadata."""

    dtype: torch.dtype
    size: tuple[int, ...]
    placements: tuple | None | str  # a DTensor's placements, None (plain), or "?" (unknown: disk)
    device: str


def spec_of(e: Entry) -> Spec:
    return Spec(getattr(torch, e.dtype), tuple(e.size), e.placements, e.device)


def agree(error: BaseException | None) -> None:
    """Raise the same error on every rank when any rank has one (before a collective load)."""
    errors = [e for e in edist.all_gather(str(error) if error is not None else None) if e is not None]
    if errors:
        if isinstance(error, Unsupported) or error is None:
            raise Unsupported(errors[0])
        raise error


def destination(module: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                specs: dict[str, Spec]) -> dict[str, torch.Tensor]:
    """A tensor for every saved key, on this rank's new shards: the live ones where they exist
    (parameters, buffers, optimizer state), new ones like their parameter otherwise."""
    from torch.distributed.tensor import DTensor

    live: dict[str, torch.Tensor] = {}
    params: dict[str, torch.Tensor] = {}
    if module is not None:
        live.update({f"model.{k}": v for k, v in module.state_dict().items()})
        params = dict(module.named_parameters())
        missing = [k for k in live if k not in specs]
        if missing:
            raise Unsupported(f"the saved state has no {missing[0]} (the model has changed?)")
    if optimizer is not None:
        for fqn, p in params.items():
            for name, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    live[f"optimizer.state.{fqn}.{name}"] = v
    out: dict[str, torch.Tensor] = {}
    for key, spec in specs.items():
        t = live.get(key)
        if t is not None and tuple(t.shape) == spec.size and t.dtype == spec.dtype:
            out[key] = t
            continue
        if key.startswith("model."):
            what = f"size {tuple(t.shape)}" if t is not None else "no such tensor"
            raise Unsupported(f"{key}: the model has {what}, the saved state {spec.size}: build the same model")
        param = params.get(key.removeprefix("optimizer.state.").rpartition(".")[0]) if key.startswith(
            "optimizer.state.") else None  # fmt: skip
        if param is not None and is_dtensor(param) and tuple(param.shape) == spec.size and spec.placements:
            local = torch.empty_like(param.to_local(), dtype=spec.dtype)
            out[key] = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                          shape=param.shape, stride=param.stride())  # fmt: skip
        elif spec.placements in (None, "?"):
            device = torch.device("cuda", torch.cuda.current_device()) if spec.device == "cuda" else "cpu"
            out[key] = torch.empty(spec.size, dtype=spec.dtype, device=device)
        else:
            raise Unsupported(f"{key} is a DTensor shaped unlike any parameter: elastrun.train cannot place it")
    return out


def load_dcp(part: ShardedPart, checkpoint_id: str | os.PathLike) -> None:
    """Load the part's model and optimizer from any DCP checkpoint, at this world size (collective).

    The checkpoint's keys are DCP's for ``{"model": model.state_dict(), "optimizer":
    get_optimizer_state_dict(model, optimizer)}`` (torchtitan's, and elastrun's own); the optimizer
    is loaded when the checkpoint has one.  Step, sampler and extras are left as they are.
    """
    error: BaseException | None = None
    try:
        metadata = durable.read_metadata(checkpoint_id)
        saved = metadata.state_dict_metadata
        specs = {
            key: Spec(meta.properties.dtype, tuple(meta.size), "?", "cpu")
            for key, meta in saved.items()
            if isinstance(meta, TensorStorageMetadata) and key.startswith(("model.", "optimizer.state."))
        }
        with_optimizer = part.optimizer is not None and any(k.startswith("optimizer.") for k in saved)
        if not with_optimizer:
            specs = {k: v for k, v in specs.items() if k.startswith("model.")}
        dest = destination(part.module, part.optimizer, specs)
        model = {k.removeprefix("model."): v for k, v in dest.items() if k.startswith("model.")}
        tree: dict[str, Any] = {"model": model}
        if with_optimizer:
            per_param: dict[str, dict[str, Any]] = {}
            for key in saved:
                if key.startswith("optimizer.state."):
                    fqn, _, name = key.removeprefix("optimizer.state.").rpartition(".")
                    per_param.setdefault(fqn, {})[name] = dest.get(key)
            groups = optimizer_tree(part.optimizer, part.names)["param_groups"]
            tree["optimizer"] = {"state": per_param, "param_groups": groups}
    except (Unsupported, ValueError, KeyError, OSError) as e:
        error = e
    agree(error)
    dcp.load(tree, checkpoint_id=checkpoint_id)
    if with_optimizer:
        part.optimizer.load_state_dict(optimizer_positional(tree["optimizer"], part.names))  # type: ignore[union-attr]
