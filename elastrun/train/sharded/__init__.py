"""Sharded training states (FSDP2, DTensor parameters) in elastrun.train: issue 24.

Layers, bottom up:

* ``layout.py``: a state tree as named chunks of global tensors, and what is refused;
* ``slots.py``: each rank's snapshot in its node's memory (a data file and a meta file per slot);
* ``plan.py``: which step to restore and where each old rank's file is (a pure function);
* ``fetch.py``: the resolver (own node, else a peer) and the peer transport;
* ``reader.py``: DCP metadata from the snapshots, and the ``StorageReader`` DCP's planner reads with;
* ``durable.py``: durable checkpoints as DCP checkpoints, written from the snapshots;
* ``core.py``: what ``State`` does with all of it;
* ``storage.py``: the memory store for scripts that call ``dcp.save``/``dcp.load`` themselves.

Importing this package imports nothing heavy: ``State`` loads ``core`` only for a sharded model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastrun.train.sharded import layout

if TYPE_CHECKING:
    import torch

    from elastrun.train.state import State


def part_of(state: State, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> Any:
    """The ``ShardedState`` half of ``state`` when the model or optimizer has DTensor parameters
    (FSDP2), else None.  Refuses (:class:`~elastrun.train.sharded.layout.Unsupported`, one line) what
    neither half can snapshot: FSDP1, ZeroRedundancyOptimizer, Partial DTensors, meta tensors."""
    if not (layout.check_model(layout.unwrap(model)) | layout.check_optimizer(optimizer)):
        return None
    from elastrun.train.sharded.core import ShardedState

    return ShardedState(state)
