"""The seams between State, et.run and the sampler, in-process (no process group, no agent)."""

from __future__ import annotations

import pytest
import torch

from elastrun.train import ElasticSampler, State
from elastrun.train.reformable import Reformable

pytestmark = pytest.mark.unit


@pytest.fixture
def state(work, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    net = torch.nn.Linear(2, 2)
    s = State(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), snapshot_dir=work / "snap",
              handle_signals=False)
    yield s
    s.close()


def test_state_is_what_run_needs(state, monkeypatch):
    assert isinstance(state, Reformable)
    assert state.live_step() is None  # outside et.run nothing is remembered live
    state.commit()
    assert state.live_step() is None and state.step == 1
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    state.rebind()
    assert (state._rank, state._world_size) == (3, 4)


@pytest.mark.parametrize("name", ["live_step", "rebind"])
def test_the_seams_cannot_be_shadowed_by_extras(name, work):
    with pytest.raises(ValueError, match="cannot be named"):
        State(snapshot_dir=work / "snap", handle_signals=False, **{name: 1})


def test_before_first_batch_runs_once_before_the_next_iterators_first_batch():
    sampler = ElasticSampler(16, batch_size=2, seed=0, num_replicas=1, rank=0)
    calls: list[int] = []
    sampler.before_first_batch(lambda: calls.append(1))
    assert calls == []
    it = iter(sampler)
    next(it)
    assert calls == [1]
    next(it)
    next(iter(sampler))
    assert calls == [1]
