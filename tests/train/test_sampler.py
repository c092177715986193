"""ElasticSampler arithmetic and its behaviour inside a real DataLoader (in-process)."""

from __future__ import annotations

import random

import pytest
import torch

from elastrun.train import ElasticSampler

pytestmark = pytest.mark.unit


def step_all_ranks(sampler: ElasticSampler, world: int) -> list[list[int]]:
    """The batches every rank gets for the next global step, then commit it."""
    batches = [sampler.rank_batch(sampler.epoch, sampler.position, world, r) for r in range(world)]
    sampler.num_replicas = world
    sampler.rank = 0
    sampler.advance()
    return batches


def test_order_does_not_depend_on_world_size():
    a = ElasticSampler(100, batch_size=4, seed=3, num_replicas=1, rank=0)
    b = ElasticSampler(100, batch_size=4, seed=3, num_replicas=4, rank=2)
    assert a.order(0) == b.order(0)
    assert a.order(0) != a.order(1)
    assert sorted(a.order(1)) == list(range(100))
    assert ElasticSampler(10, 2, shuffle=False).order(5) == list(range(10))


def test_global_batch_is_split_into_contiguous_rank_slices():
    s = ElasticSampler(64, batch_size=4, seed=0, num_replicas=2, rank=0)
    order = s.order(0)
    assert s.rank_batch(0, 0, 2, 0) == order[0:4]
    assert s.rank_batch(0, 0, 2, 1) == order[4:8]


@pytest.mark.parametrize("seed", range(20))
def test_every_sample_once_per_epoch_across_random_resizes(seed):
    rnd = random.Random(seed)
    n = rnd.randrange(20, 300)
    s = ElasticSampler(n, batch_size=rnd.randrange(1, 9), seed=seed, num_replicas=1, rank=0)
    seen: dict[int, list[int]] = {}
    world = rnd.randrange(1, 5)
    for _ in range(10_000):
        if s.epoch == 3:
            break
        if rnd.random() < 0.2:
            world = rnd.randrange(1, 5)
        epoch = s.epoch
        batches = step_all_ranks(s, world)
        assert all(batches), "no rank may get an empty batch"
        for b in batches:
            seen.setdefault(epoch, []).extend(b)
    assert sorted(seen) == [0, 1, 2]
    for idx in seen.values():
        if len(idx) != n:  # only a resize leaving fewer samples than ranks pads
            assert len(set(idx)) == n
        else:
            assert sorted(idx) == list(range(n))


def test_tail_smaller_than_world_is_merged_into_the_last_step():
    s = ElasticSampler(9, batch_size=4, num_replicas=2, rank=0)
    # 9 = 8 + 1: a last step of one sample would leave a rank empty, so one step takes all 9
    assert s.global_batch_size(0, 2) == 9
    assert [len(s.rank_batch(0, 0, 2, r)) for r in (0, 1)] == [5, 4]
    assert len(s) == 1
    assert ElasticSampler(10, batch_size=4, num_replicas=2, rank=0).global_batch_size(8, 2) == 2


def test_drop_last_skips_the_tail():
    s = ElasticSampler(10, batch_size=4, drop_last=True, num_replicas=2, rank=1)
    assert len(s) == 1
    assert len(list(iter(s))) == 1
    s.advance()
    assert (s.epoch, s.position) == (1, 0)


def test_iterator_does_not_move_the_committed_position():
    s = ElasticSampler(40, batch_size=5, seed=1, num_replicas=1, rank=0)
    first = list(iter(s))
    assert len(first) == 8 and s.position == 0
    s.advance()
    s.advance()
    assert list(iter(s)) == first[2:]


@pytest.mark.e2e
def test_prefetching_dataloader_resumes_from_committed_position():
    data = torch.utils.data.TensorDataset(torch.arange(60))
    s = ElasticSampler(data, batch_size=6, seed=2, num_replicas=1, rank=0)
    loader = torch.utils.data.DataLoader(data, batch_sampler=s, num_workers=2, prefetch_factor=4)
    it = iter(loader)
    got = [next(it)[0].tolist() for _ in range(3)]
    for _ in range(3):
        s.advance()
    del it  # a "crash": batches 4.. were prefetched but never committed
    rest = [b[0].tolist() for b in loader]
    assert len(rest) == 7
    assert sorted(i for b in got + rest for i in b) == list(range(60))
    assert s.epoch == 0  # nothing committed the rest yet


def test_state_dict_round_trip_and_mismatch():
    s = ElasticSampler(50, batch_size=5, seed=4, num_replicas=1, rank=0)
    s.advance()
    t = ElasticSampler(50, batch_size=7, seed=4)
    t.load_state_dict(s.state_dict())
    assert (t.epoch, t.position) == (0, 5)
    with pytest.raises(ValueError, match="seed=4"):
        ElasticSampler(50, batch_size=5, seed=5).load_state_dict(s.state_dict())


def test_bad_input_is_rejected_clearly():
    with pytest.raises(ValueError, match="batch_size"):
        ElasticSampler(10, batch_size=0)
    with pytest.raises(ValueError, match="non-empty"):
        ElasticSampler(0, batch_size=1)
    with pytest.raises(ValueError, match="no full global batch"):
        iter(ElasticSampler(3, batch_size=4, drop_last=True, num_replicas=1, rank=0))
    s = ElasticSampler(4, batch_size=4, num_replicas=1, rank=0)
    s.advance()
    s.epoch = 0  # pretend the epoch did not roll over: one advance too many must be caught
    s.position = 4
    with pytest.raises(RuntimeError, match="more often than batches"):
        s.advance()
