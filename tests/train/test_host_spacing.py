"""Snapshots of a state in host memory are spaced by what they cost the step.

A snapshot's copy runs on an idle-priority helper beside the step after its commit; what the helper
has not copied when ``optimizer.step()`` is about to change the parameters is copied by the training
thread.  That step's time beyond a clean step's is the snapshot's cost (``spacing.HostMeter``), and
by default snapshots are spaced to keep it within 5 % of the steps.  In-process, real slots in a
temporary directory, no child processes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from elastrun.train import spacing
from elastrun.train.blob import flatten, make_header
from elastrun.train.copier import HELPER_MIN_BYTES
from elastrun.train.pipeline import SnapshotPipeline
from elastrun.train.snapshot import MemorySnapshots

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_host_meter_charges_a_snapshot_what_its_step_took_beyond_a_clean_one():
    clock = Clock()
    meter = spacing.HostMeter(clock)

    def step(seconds: float, stall: float = 0.0, copy_s: float | None = None) -> None:
        """A step of ``seconds`` (the training thread's waits for the last snapshot among them); with
        ``copy_s``, its commit hands a snapshot's copy of that duration to the background."""
        clock.now += seconds
        meter.stalled(stall)
        meter.step()
        if copy_s is not None:
            meter.started(SimpleNamespace(seconds=copy_s), 4_000_000)

    for _ in range(5):
        step(0.05)  # steps of 50 ms, no snapshot
    assert meter.every() is None and not meter.measuring
    # the step after a snapshot pays for it; the first four fault fresh slot pages in (not counted)
    for seconds in (0.4, 0.3, 0.3, 0.3, 0.06, 0.062, 0.061, 0.063):
        step(0.05, copy_s=0.1)
        step(seconds)
    step(30.0)  # a pause of the program (an evaluation) is not a step
    step(0.05, copy_s=0.1)
    step(5.0)  # a pause where a snapshot was copied: it cost at most the copy's 100 ms
    meter.reset()  # a re-form: the interval across it is not a step
    step(10.0, copy_s=0.1)
    step(0.05, stall=0.02)  # the training thread waited 20 ms: more than the step lost (noise)
    assert meter.measuring and meter.samples == 6 and meter.step_s == pytest.approx(0.05)
    # the last five: 12, 11, 13, 100 and 20 ms
    assert meter.cost_s == pytest.approx(0.013) and meter.copy_s == pytest.approx(0.1)
    # 13 ms against 5 % of 50 ms (2.5 ms): one step in six
    assert meter.every() == spacing.choose_every(0.05, 0.013, 0.0, staged=False) == 6
    line = spacing.describe(6, meter.nbytes, meter.step_s, meter.cost_s, meter.copy_s, False, host=True)
    assert "every 6 step(s): 0.00 GB copied in host memory in 100 ms beside the step, costing it 13.0 ms" in line
    assert "= 4.3 % of a 50.0 ms step; a crash redoes at most 0.25 s" in line


def _commits(tmp_path, nbytes: int, count: int) -> tuple[SnapshotPipeline, list[int]]:
    """``count`` commits of a state of ``nbytes`` whose steps take almost no time: a snapshot's copy,
    finished by the optimizer's pre-hook right after its commit, is nearly all of its step."""
    param = torch.zeros(nbytes // 4)
    pipe = SnapshotPipeline(None)
    pipe.use([param])
    mem = MemorySnapshots(tmp_path, "job")
    mem.count = 2
    snapped = []
    for step in range(1, count + 1):
        pipe.settle()
        pipe.mark_step()
        unready, every = pipe.propose()
        if pipe.due(step, every, unready):
            flat = flatten({"param": param})
            pipe.write(mem, flat, make_header(flat, step=step, world_size=1), {param.data_ptr()}, lambda s, c: None)
            snapped.append(step)
        pipe.before_step()
        param[0] += 1  # optimizer.step(), as cheap as it gets
    pipe.drain()
    pipe.close(timeout=10)
    return pipe, snapped


def test_a_snapshot_that_costs_the_step_is_spaced_out(tmp_path):
    """The copy of 32 MiB is nearly all of a snapshot step's time.  Snapshots are 2 commits apart
    until a spacing is chosen (the steps between are the clean ones): the first four warm the slots
    up, the next are measured until three clean steps are in (a clean step of microseconds that
    runs long is left out as a pause: one or two more), and the spacing then is far beyond the run's
    40 commits."""
    pipe, snapped = _commits(tmp_path, 32 << 20, 40)
    assert isinstance(pipe.meter, spacing.HostMeter) and pipe.meter.samples >= 2
    assert snapped == list(range(1, 2 * len(snapped), 2)) and 6 <= len(snapped) <= 10, snapped
    assert pipe.every_now > 40, (snapped, pipe.meter.step_s, pipe.meter.cost_s)


def test_a_snapshot_too_small_for_the_background_copy_is_taken_at_every_commit(tmp_path):
    pipe, snapped = _commits(tmp_path, HELPER_MIN_BYTES // 2, 24)
    assert snapped == list(range(1, 25)) and pipe.every_now == 1
    assert not pipe.meter.measuring and pipe.meter.samples == 0


def test_an_explicit_spacing_is_kept_whatever_the_cost(tmp_path):
    param = torch.zeros(8 << 20)
    pipe = SnapshotPipeline(1)
    pipe.use([param])
    assert [s for s in range(1, 6) if pipe.due(s, 1, False)] == [1, 2, 3, 4, 5]
    pipe.meter.cost_s, pipe.meter.step_s = 1.0, 0.001  # what a measurement would say
    pipe.mark_step()
    assert pipe.every_now == 1
