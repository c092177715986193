"""elastrun.train: training that survives crashes, restarts and resizes.

Usage (see docs/train.md)::

    import elastrun.train as et

    et.init_distributed()
    sampler = et.ElasticSampler(dataset, batch_size=32, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    state = et.State(model=model, optimizer=opt, sampler=sampler, checkpoint_dir="ckpt", checkpoint_every=50)
    state.restore()
    while sampler.epoch < 3:
        for x, y in loader:
            ...
            state.commit()

Or, to keep the process when the job changes (in-process re-form, docs/train.md)::

    def train(state):
        model = DDP(net)                       # built on the current group, every time
        while sampler.epoch < 3:
            for x, y in loader:
                ...
                state.commit()

    et.run(train, state)                       # init_distributed + restore + train, re-formed on changes

A model sharded with FSDP2 (``fully_shard``) is handed to ``State`` the same way: each rank then
snapshots its own shard and a restore at any world size gives each rank its new shard.  Scripts
that call ``dcp.save``/``dcp.load`` themselves can keep them in node memory with
``storage_writer=et.MemoryWriter(step)`` / ``storage_reader=et.MemoryReader()``.

Importing this package imports torch; ``import elastrun`` alone does not.
"""

from elastrun.train.dist import DistInfo, init_distributed
from elastrun.train.reform import Reform, run
from elastrun.train.sampler import ElasticSampler
from elastrun.train.state import State

__all__ = ["DistInfo", "ElasticSampler", "MemoryReader", "MemoryWriter", "Reform", "State", "init_distributed", "run"]


def __getattr__(name: str) -> object:
    """``MemoryWriter`` and ``MemoryReader`` (DCP storage in node memory) import DCP when first used."""
    if name in ("MemoryWriter", "MemoryReader"):
        from elastrun.train.sharded import storage

        return getattr(storage, name)
    raise AttributeError(f"module 'elastrun.train' has no attribute {name!r}")
