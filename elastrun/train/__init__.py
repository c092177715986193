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

Importing this package imports torch; ``import elastrun`` alone does not.
"""

from elastrun.train.dist import DistInfo, init_distributed
from elastrun.train.sampler import ElasticSampler
from elastrun.train.state import State

__all__ = ["DistInfo", "ElasticSampler", "State", "init_distributed"]
