"""The snapshot pipeline's ordering rules on a GPU, checked against a stand-in device that runs
nothing until told (``fake_device.py``): what the training stream waits for, what the host waits
for, when a slot is published, and when a snapshot is put off.  In-process, no child processes."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from elastrun.train import spacing
from elastrun.train.blob import flatten, make_header
from elastrun.train.pipeline import SnapshotPipeline
from elastrun.train.snapshot import MemorySnapshots
from tests.train.fake_device import FakeDevice

pytestmark = pytest.mark.unit


def _bounded(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


def _run_all(dev: FakeDevice) -> None:
    """Run both streams until neither can go on (what a real device does by itself)."""
    for _ in range(100):
        if dev.run(dev.train) & dev.run(dev.side):
            return


def _setup(tmp_path, pinnable: bool = True, room: int = 1 << 30):
    dev = FakeDevice(pinnable=pinnable, room=room)
    param = dev.adopt(torch.arange(1024, dtype=torch.float32))  # what optimizer.step() changes
    buffer = dev.adopt(torch.full((16,), 7.0))  # what forward may change (cloned at the commit)
    host = torch.arange(8, dtype=torch.int64)  # a tensor of the state in host memory
    pipe = SnapshotPipeline(None)
    pipe.device = dev
    pipe.meter = spacing.Meter(dev.seconds, dev.done)
    mem = MemorySnapshots(tmp_path, "job")
    mem.count = 3
    return dev, param, buffer, host, pipe, mem


def _write(pipe, mem, tree, stable, step=1, force=False):
    flat = flatten(tree)
    header = make_header(flat, step=step, world_size=1)
    published: list[int] = []
    ok = pipe.write(mem, flat, header, stable, lambda slot, crc: published.append(slot), force=force)
    return ok, published, flat


def _snapshot_bytes(mem, step: int) -> dict[str, torch.Tensor]:
    from elastrun.train.blob import materialize

    info = next(i for i in mem.scan() if i.step == step)
    return materialize(info.header, mem.read(info))


@pytest.mark.e2e
def test_the_optimizer_waits_on_the_device_for_the_staging_copy_only_and_the_host_for_nothing(tmp_path):
    dev, param, buffer, host, pipe, mem = _setup(tmp_path)
    tree = {"param": param, "buffer": buffer, "host": host}
    ok, published, _ = _write(pipe, mem, tree, {param.data_ptr()}, force=True)  # a slot made now
    assert ok and not published  # queued: nothing ran, nothing published
    pipe.before_step()  # optimizer.step()'s pre-hook: returns at once, the device waits
    dev.enqueue("optimizer.step", lambda: param.add_(1000))
    dev.enqueue("buffer update", lambda: buffer.add_(1))
    assert not dev.run(dev.train)  # the training stream stops at its wait for the staging copy
    assert param[0].item() == 0, "optimizer.step() ran before the snapshot had copied the parameters"
    dev.run(dev.side, until=pipe._device_copy.staged)  # the device-to-device copy, not the bus copy
    assert dev.run(dev.train) and param[0].item() == 1000  # training goes on while the slot fills
    assert not published
    dev.run(dev.side)
    assert _bounded(lambda: published), "the slot was not published after its copy landed"
    pipe.drain()
    got = _snapshot_bytes(mem, 1)
    assert torch.equal(got["param"], torch.arange(1024, dtype=torch.float32))  # the step's values
    assert torch.equal(got["buffer"], torch.full((16,), 7.0)) and torch.equal(got["host"], host)


def test_without_room_for_staging_the_optimizer_waits_for_the_whole_copy(tmp_path):
    dev, param, buffer, host, pipe, mem = _setup(tmp_path, room=0)
    with pytest.warns(UserWarning, match="without a staging buffer"):
        ok, published, _ = _write(pipe, mem, {"param": param}, {param.data_ptr()}, force=True)
    pipe.before_step()
    dev.enqueue("optimizer.step", lambda: param.add_(1000))
    assert not dev.run(dev.train)
    dev.run(dev.side)  # the one copy, straight from the parameters into the slot
    assert dev.run(dev.train)
    assert _bounded(lambda: published)
    pipe.drain()
    assert torch.equal(_snapshot_bytes(mem, 1)["param"], torch.arange(1024, dtype=torch.float32))


@pytest.mark.e2e
def test_pageable_slots_copy_over_the_bus_on_the_helper_thread(tmp_path):
    """Slots that could not be page-locked: the device-to-host half runs on the helper thread (a
    pageable copy holds its caller), never on the training thread; one warning says why."""
    dev, param, _, _, pipe, mem = _setup(tmp_path, pinnable=False)
    nbytes = flatten({"param": param}).nbytes
    mem.on_unpinned = pipe._say_unpinned  # what the pipeline's first write sets
    with pytest.warns(UserWarning, match="not page-locked.*refuses"):
        mem.prepare(nbytes, dev)
        assert _bounded(lambda: mem.ready_slot(nbytes))
        ok, published, _ = _write(pipe, mem, {"param": param}, {param.data_ptr()}, step=2)
    assert ok
    assert dev.queued(dev.side)[-1].startswith("record")  # only the staging copy was queued by commit()
    assert _bounded(lambda: any(q == "copy" for q in dev.queued(dev.side)[3:]))  # the helper queued the rest
    _run_all(dev)
    assert _bounded(lambda: published)
    pipe.drain()


def test_a_gpu_snapshot_is_put_off_until_a_slot_is_ready_unless_forced(tmp_path):
    dev, param, _, _, pipe, mem = _setup(tmp_path)
    gate = threading.Event()
    real_pin = dev.pin
    dev.pin = lambda address, nbytes: gate.wait(10) and real_pin(address, nbytes)  # slots made slowly
    ok, published, _ = _write(pipe, mem, {"param": param}, {param.data_ptr()})
    assert not ok and pipe.deferred == 1 and dev.queued(dev.side) == []  # nothing claimed, nothing queued
    unready, _ = pipe.propose()
    assert unready  # every rank learns it at the commit's all-reduce: none starts this step's snapshot
    gate.set()
    assert _bounded(lambda: not pipe.propose()[0])
    ok, _, _ = _write(pipe, mem, {"param": param}, {param.data_ptr()}, step=2)
    assert ok
    _run_all(dev)
    pipe.drain()


def test_at_most_one_copy_is_in_flight(tmp_path):
    """A snapshot due while the last one's copy is still running waits for it (the slots keep the
    two newest complete snapshots); at the default spacing the pipeline says it is not ready instead."""
    dev, param, _, _, pipe, mem = _setup(tmp_path)
    tree = {"param": param}
    assert _write(pipe, mem, tree, {param.data_ptr()}, force=True)[0]
    assert pipe.propose()[0], "the first copy is in flight: not ready for the next"
    started = threading.Event()

    def second() -> None:
        _write(pipe, mem, tree, {param.data_ptr()}, step=2, force=True)
        started.set()

    t = threading.Thread(target=second)
    t.start()
    assert not started.wait(0.3), "a second copy started while the first was in flight"
    _run_all(dev)
    assert started.wait(10)
    t.join()
    _run_all(dev)
    pipe.drain()
    assert sorted(i.step for i in mem.scan()) == [1, 2]


def test_the_spacing_rule():
    # 15 ms per snapshot against a 58 ms step: 5 % of a step is 2.9 ms, so one in six
    assert spacing.choose_every(0.058, 0.015, 0.16, staged=True) == 6
    # the copy over the bus (0.4 s) must end before the next: more steps than the cost needs
    assert spacing.choose_every(0.058, 0.005, 0.4, staged=True) == 7
    # direct: the copy's length is already in its cost (the optimizer waits for it)
    assert spacing.choose_every(0.058, 0.12, 0.16, staged=False) == 42
    assert spacing.choose_every(0.1, 0.0, 0.0, staged=True) == 1
    line = spacing.describe(42, 4_000_000_000, 0.058, 0.12, 0.16, staged=False)
    assert "every 42 step(s)" in line and "redoes at most 2.38 s" in line and "budget" in line


def test_the_meter_charges_a_snapshot_what_its_steps_took_beyond_a_clean_step(tmp_path):
    dev = FakeDevice()
    meter = spacing.Meter(dev.seconds, dev.done)

    class Job:  # a snapshot's copy as the meter sees it
        done = None

        @staticmethod
        def timings():
            return {"copy": 3.0, "stage": 0.5, "stall": 0.2}

    def step(tick: float) -> None:
        e = dev.record()
        dev.run(dev.train, tick=tick)
        meter.step(e)

    for _ in range(5):
        step(1.0)  # clean steps of 1 s
    for extra in (5.0, 0.75, 0.5, 0.75, 0.75):  # the first snapshot (warming up) is not counted
        job = Job()
        meter.started(job, nbytes=4000, staged=True)
        step(1.0 + extra * 2 / 3)
        step(1.0 + extra / 3)  # the two steps beside the copy: ``extra`` s more than clean ones
        job.done = dev.record(dev.side)
        dev.run(dev.side, tick=0.0)  # the copy lands as the second step ends
        step(1.0)
        step(60.0)  # a pause of the program between two commits: not a step, not charged
        for _ in range(3):
            step(1.0)
    assert meter.samples == 4 and meter.step_s == pytest.approx(1.0)
    assert meter.cost_s == pytest.approx(0.75) and meter.copy_s == pytest.approx(3.0)
    assert meter.every() == spacing.choose_every(1.0, 0.75, 3.0, staged=True) == 15


def test_while_slots_are_being_made_a_snapshot_never_overwrites_the_newest_complete_one(tmp_path):
    """The first slot is ready, the others are still being made: the next snapshot is put off (at the
    default spacing) instead of taking the slot that holds the only complete snapshot."""
    dev, param, _, _, pipe, mem = _setup(tmp_path)
    gate, calls = threading.Event(), []
    real_pin = dev.pin

    def pin(address: int, nbytes: int) -> bool:
        calls.append(address)
        return (len(calls) == 1 or gate.wait(10)) and real_pin(address, nbytes)

    dev.pin = pin
    tree = {"param": param}
    mem.prepare(flatten(tree).nbytes, dev)
    assert _bounded(lambda: mem.ready_slot(flatten(tree).nbytes))  # one slot made, the others wait
    ok, published, _ = _write(pipe, mem, tree, {param.data_ptr()}, step=1)
    assert ok
    _run_all(dev)
    assert _bounded(lambda: published)
    pipe.drain()
    assert not _write(pipe, mem, tree, {param.data_ptr()}, step=2)[0], "the only complete snapshot was taken"
    assert [i.step for i in mem.scan()] == [1]
    gate.set()
    assert _bounded(lambda: not pipe.propose()[0])
    assert _write(pipe, mem, tree, {param.data_ptr()}, step=3)[0]
    _run_all(dev)
    pipe.drain()
    assert sorted(i.step for i in mem.scan()) == [1, 3]


def test_slots_the_node_cannot_hold_are_refused_with_one_clear_line(tmp_path):
    """At the first snapshot of a size: a clear error naming what is needed and what there is, instead
    of an out-of-memory kill (or a SIGBUS on a full /dev/shm) in the middle of a run."""
    mem = MemorySnapshots(tmp_path, "job")
    mem.count = 3
    mem.check_room(1 << 20)  # a megabyte fits
    import os

    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(RuntimeError, match=r"cannot hold the memory snapshots: 8 writer\(s\) x 3 slots") as e:
        mem.check_room(free, writers=8)
    assert "--shm-size" in str(e.value) and "snapshot_dir" in str(e.value)
    assert not list(tmp_path.glob("shared.*.data")), "nothing was allocated"


def test_with_two_slots_ready_snapshots_alternate_and_keep_the_newest(tmp_path):
    """Two slots made, the third still being made: snapshots go on, alternating between the two, and
    the newest complete one is never the one overwritten."""
    dev, param, _, _, pipe, mem = _setup(tmp_path)
    gate, calls = threading.Event(), []
    real_pin = dev.pin

    def pin(address: int, nbytes: int) -> bool:
        calls.append(address)
        return (len(calls) <= 2 or gate.wait(10)) and real_pin(address, nbytes)

    dev.pin = pin
    tree = {"param": param}
    mem.prepare(flatten(tree).nbytes, dev)
    assert _bounded(lambda: len(mem._free_ready(flatten(tree).nbytes)) == 2)
    for step in (1, 2, 3):
        assert _write(pipe, mem, tree, {param.data_ptr()}, step=step)[0], step
        _run_all(dev)
        pipe.drain()
        assert max(i.step for i in mem.scan()) == step
    assert sorted(i.step for i in mem.scan()) == [2, 3]
    gate.set()
    mem.wait_ready(flatten(tree).nbytes)


def test_which_commits_are_snapshotted():
    """The chosen spacing: the first commit at once (it starts making the slots), then every k after
    the last, never while a rank cannot start one, and at once after a roll-back; an explicit k: the
    multiples of k."""
    pipe = SnapshotPipeline(None)
    pipe.every_now = 4
    assert [s for s in range(1, 14) if pipe.due(s, 4, unready=False)] == [1, 5, 9, 13]
    assert not pipe.due(17, 4, unready=True) and pipe.due(18, 4, unready=False)
    assert pipe.due(10, 4, unready=False), "after a roll-back to step 9, the next commit is snapshotted"
    assert not pipe.due(11, 4, unready=False)
    explicit = SnapshotPipeline(3)
    assert [s for s in range(1, 10) if explicit.due(s, 3, unready=True)] == [3, 6, 9]


def test_a_first_commit_on_a_hundredth_step_prunes_before_any_snapshot_of_its_own(tmp_path, monkeypatch):
    """A worker that starts at step 99 (a joiner, a restarted rank) commits step 100 before it has a
    snapshot of its own, and step 100 prunes the node's old RNG files: with no snapshot kept that
    raised TypeError (``min`` of a lone int) and killed the worker (seen as a fifth fault in the
    goodput test)."""
    import elastrun.train as et

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = et.State(model=model, optimizer=opt, snapshot_dir=tmp_path, handle_signals=False)
    try:
        state.step = 99
        state.commit()
        assert state.step == 100
    finally:
        state.close()


def test_slots_are_page_locked_piece_by_piece_and_copies_are_cut_the_same_way(tmp_path, monkeypatch):
    """A slot registered whole held the driver's lock for seconds (one training step stalled 3-4 s
    while three 4 GB slots were made on an H100): it is registered in pieces ending at absolute
    multiples of ``PIN_CHUNK``, and a copy to or from it is cut at the same addresses, so that no
    copy spans two registrations.  A refusal part way leaves nothing locked."""
    from elastrun.train import slotmem
    from elastrun.train.gpu import device as gdev

    monkeypatch.setattr(gdev, "PIN_CHUNK", 1 << 16)
    monkeypatch.setattr(slotmem, "PIN_PAUSE_MAX_S", 0.0)
    chunk = gdev.PIN_CHUNK
    base = 3 * chunk - 4096
    assert gdev.pin_pieces(base, chunk + 8192) == [(base, 4096), (3 * chunk, chunk), (4 * chunk, 4096)]
    assert gdev.pin_pieces(2 * chunk, chunk) == [(2 * chunk, chunk)]

    dev = FakeDevice()
    mem = slotmem.SlotMemory.make(tmp_path / "slot", 5 * chunk + 100, dev)
    start = slotmem.address(mem.mm)
    pieces = sorted(dev.pinned.items())
    assert mem.pinned and len(pieces) >= 6 and pieces[0][0] == start
    assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:], strict=False))  # no gap, no overlap
    assert pieces[-1][0] + pieces[-1][1] == start + 5 * chunk + 100
    assert all(a // chunk == (a + n - 1) // chunk for a, n in pieces)  # each inside one chunk
    mem.close()
    assert dev.pinned == {}

    class RefusesTheThird(FakeDevice):
        def pin(self, address: int, nbytes: int) -> bool:
            if len(self.pinned) == 2:
                self.why_not = "refused by the test"
                return False
            return super().pin(address, nbytes)

    dev = RefusesTheThird()
    mem = slotmem.SlotMemory.make(tmp_path / "refused", 5 * chunk, dev)
    assert not mem.pinned and dev.pinned == {} and dev.why_not == "refused by the test"
    mem.close()

    host = torch.zeros(3 * chunk, dtype=torch.uint8)
    src = torch.arange(3 * chunk, dtype=torch.int64).remainder(251).to(torch.uint8)
    cut = gdev._host_pieces(host[100:], src[100:])
    assert len(cut) >= 3 and sum(d.numel() for d, _ in cut) == 3 * chunk - 100
    for d, s in cut:
        assert d.data_ptr() // chunk == (d.data_ptr() + d.numel() - 1) // chunk
        d.copy_(s)
    assert torch.equal(host[100:], src[100:])
    assert len(gdev._host_pieces(host.view(torch.int16), src.view(torch.int16))) == 1  # not bytes: one copy


def test_slots_are_made_at_once_and_registered_one_after_another(tmp_path, monkeypatch):
    """Every slot is allocated and mapped on its own thread, but their registrations go in slot order
    (piece by piece, one piece at a time in the process): the first slot is ready first, so that
    snapshots can begin before the last one is page-locked."""
    from elastrun.train import slotmem
    from elastrun.train.gpu import device as gdev

    monkeypatch.setattr(gdev, "PIN_CHUNK", 1 << 16)
    monkeypatch.setattr(slotmem, "PIN_PAUSE_MAX_S", 0.0)
    order: list[int] = []

    class Recording(FakeDevice):
        def pin(self, address: int, nbytes: int) -> bool:
            order.append(address)
            time.sleep(0.001)  # long enough for another slot's thread to cut in, were it allowed to
            return super().pin(address, nbytes)

    dev = Recording()
    mem = MemorySnapshots(tmp_path, "job")
    mem.count = 3
    mem.prepare(4 * gdev.PIN_CHUNK, dev, background=False)
    starts = {slot: slotmem.address(mem._maps[slot].mm) for slot in range(3)}
    assert all(mem.pinned_memory(slot) for slot in range(3))
    owner = [next(s for s, a in starts.items() if a <= x < a + 4 * gdev.PIN_CHUNK) for x in order]
    assert owner == sorted(owner) and set(owner) == {0, 1, 2}, owner
    mem.close()
    assert dev.pinned == {}
