"""Sharded training states (FSDP2, DTensor parameters) in elastrun.train: issue 24.

Layers, bottom up:

* ``layout.py``: a state tree as named chunks of global tensors, and what is refused;
* ``slots.py``: each rank's snapshot in its node's memory (a data file and a meta file per slot);
* ``shard_plan.py``: which step to restore and where each old rank's file is (a pure function);
* ``fetch.py``: the resolver (own node, else a peer) and the peer transport;
* ``reader.py``: DCP metadata from the snapshots, and the ``StorageReader`` DCP's planner reads with;
* ``durable.py``: durable checkpoints as DCP checkpoints, written from the snapshots;
* ``destination.py``: the tensors a restore loads into, and loading any DCP checkpoint (``State.load_dcp``);
* ``shards.py``: the sharded :class:`~elastrun.train.part.Part` (what ``State`` does with all of it);
* ``storage.py``: the memory store for scripts that call ``dcp.save``/``dcp.load`` themselves.

Importing this package imports nothing heavy: ``State`` loads ``shards`` only for a sharded model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastrun.train.sharded import layout

if TYPE_CHECKING:
    from elastrun.train.part import Core, Objects
    from elastrun.train.sharded.shards import ShardedPart


def part_of(core: Core, objects: Objects) -> ShardedPart | None:
    """The :class:`~elastrun.train.sharded.shards.ShardedPart` for ``objects`` when the model or
    optimizer has DTensor parameters (FSDP2), else None (the replicated part fits).  Refuses
    (:class:`~elastrun.train.sharded.layout.Unsupported`, one line) what no part can snapshot: FSDP1,
    ZeroRedundancyOptimizer, Partial DTensors, meta tensors."""
    if not (layout.check_model(layout.unwrap(objects.model)) | layout.check_optimizer(objects.optimizer)):
        return None
    from elastrun.train.sharded.shards import ShardedPart

    return ShardedPart(core, objects)
