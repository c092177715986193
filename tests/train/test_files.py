"""State blobs, memory-snapshot slots, checkpoint files, the restore plan, and a one-process
State round trip (in-process: no process group is needed for these)."""

from __future__ import annotations

import json
import shutil
import threading
import time
import warnings

import pytest
import torch

from elastrun.train import ElasticSampler, State
from elastrun.train.blob import copy_into, flatten, make_header, materialize
from elastrun.train.checkpoint import CheckpointCorrupt, CheckpointDir
from elastrun.train.copier import SnapshotCopy
from elastrun.train.plan import Report, make_plan
from elastrun.train.snapshot import MemorySnapshots

pytestmark = pytest.mark.unit


def sample_state():
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "nested": [torch.tensor([True, False]), (torch.zeros(0), 5)],
        "half": torch.ones(3, dtype=torch.bfloat16),
        "plain": {"lr": 0.1},
    }


def roundtrip_equal(a, b):
    assert torch.equal(a["w"], b["w"]) and torch.equal(a["half"], b["half"])
    assert torch.equal(a["nested"][0], b["nested"][0]) and b["nested"][1][1] == 5
    assert b["plain"] == {"lr": 0.1}


def test_blob_round_trip():
    flat = flatten(sample_state())
    buf = torch.zeros(flat.nbytes, dtype=torch.uint8)
    copy_into(flat, buf)
    roundtrip_equal(sample_state(), materialize(make_header(flat, step=1), buf))


def test_memory_slot_is_whole_or_ignored(tmp_path):
    mem = MemorySnapshots(tmp_path, "job")
    flat = flatten(sample_state())
    slot, buf, view = mem.begin(flat.nbytes)
    copy_into(flat, buf)
    del buf
    view.release()
    mem.publish(slot, make_header(flat, step=7, world_size=2))
    # a second copy cut in the middle: its meta is never published
    slot2, buf2, view2 = mem.begin(flat.nbytes)
    assert slot2 != slot
    buf2[:5].fill_(0xAB)
    del buf2
    view2.release()
    found = MemorySnapshots(tmp_path, "job").scan()
    assert [(i.step, i.slot) for i in found] == [(7, slot)]
    roundtrip_equal(sample_state(), materialize(found[0].header, mem.read(found[0])))
    assert MemorySnapshots(tmp_path, "another-job").scan() == []  # a stale job's snapshot is ignored
    mem.close()


def write_ckpt(ck: CheckpointDir, step: int, world: int = 2):
    flat = flatten(sample_state())
    buf = torch.zeros(flat.nbytes, dtype=torch.uint8)
    copy_into(flat, buf)
    for r in range(world):
        ck.write_rng(step, r, f"rng{r}".encode())
    shared = ck.write_shared(step, make_header(flat, step=step, world_size=world), memoryview(buf.numpy()))
    assert ck.write_manifest(step, world, shared, wait_s=5)


def test_checkpoints_keep_last_k_and_load(tmp_path):
    ck = CheckpointDir(tmp_path, keep=2)
    for step in (5, 10, 15):
        write_ckpt(ck, step)
    (tmp_path / "step-000000000003").mkdir()  # abandoned, incomplete
    write_ckpt(ck, 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000000015", "step-000000000020"]
    cand = ck.scan()[0]
    assert (cand.step, cand.world_size, cand.rng_ranks) == (20, 2, [0, 1])
    header, data = ck.load_shared(cand)
    roundtrip_equal(sample_state(), materialize(header, data))
    assert ck.load_rng(cand, 1) == b"rng1"


def test_corrupt_truncated_and_garbled_checkpoints_are_named(tmp_path):
    ck = CheckpointDir(tmp_path, keep=5)
    for step in (5, 10, 15):
        write_ckpt(ck, step)
    flipped = tmp_path / "step-000000000015" / "shared.bin"
    raw = bytearray(flipped.read_bytes())
    raw[-1] ^= 1
    flipped.write_bytes(bytes(raw))
    truncated = tmp_path / "step-000000000010" / "rng.r1.pkl"
    truncated.write_bytes(b"rng")
    (tmp_path / "step-000000000005" / "manifest.json").write_text("{not json")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cands = ck.scan()
    text = "\n".join(str(x.message) for x in w)
    assert [c.step for c in cands] == [15]
    assert str(truncated) in text and "truncated" in text
    assert str(tmp_path / "step-000000000005" / "manifest.json") in text
    with pytest.raises(CheckpointCorrupt, match=str(flipped)):
        ck.load_shared(cands[0])


def test_incomplete_checkpoint_without_manifest_is_invisible(tmp_path):
    ck = CheckpointDir(tmp_path)
    ck.write_rng(5, 0, b"x")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert not ck.write_manifest(5, 2, (0, 0), wait_s=0.2)  # rank 1 never wrote its file
    assert "never arrived" in str(w[0].message)
    assert ck.scan() == []


def test_a_reform_abandons_a_manifest_waiting_for_a_gone_rank(tmp_path):
    """A restore after a re-form must not wait the manifest's 120 s for a rank that died."""
    ck = CheckpointDir(tmp_path)
    ck.write_rng(5, 0, b"x")
    gone = threading.Event()
    threading.Timer(0.2, gone.set).start()
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert not ck.write_manifest(5, 2, (0, 0), wait_s=60, abandon=gone)
    assert time.monotonic() - started < 10
    assert "did not arrive before the group re-formed" in str(w[0].message)
    assert ck.scan() == []


def test_plan_rules():
    full = {0: [6, 7], 1: [6, 7]}
    # every rank's node has step 7: memory
    p = make_plan([Report(0, mem={6: 2, 7: 2}, mem_rng=full), Report(1, mem={6: 2, 7: 2}, mem_rng=full)])
    assert (p.step, p.source) == (7, "memory")
    # rank 1 died before committing step 7: step 6 keeps the run deterministic
    lag = {0: [6, 7], 1: [6]}
    p = make_plan([Report(0, mem={6: 2, 7: 2}, mem_rng=lag), Report(1, mem={6: 2, 7: 2}, mem_rng=lag)])
    assert p.step == 6
    # a joining node has nothing: peer, from the rank that has it
    p = make_plan([Report(0, mem={7: 1}, mem_rng={0: [7]}), Report(1)])
    assert (p.step, p.source, p.src_rank, p.rng_holders) == (7, "peer", 0, {0: 0})
    # disk newer than memory wins; an excluded (corrupt) disk step falls back
    reports = [Report(0, mem={4: 1}, mem_rng={0: [4]}, disk={9: 1}, disk_rng={9: [0]})]
    assert (make_plan(reports).source, make_plan(reports).step) == ("disk", 9)
    assert make_plan(reports, {("disk", 9)}).step == 4
    assert make_plan([Report(0), Report(1)]) is None


def test_plan_live_source():
    """After an in-process re-form: a survivor's own objects count as holding their step."""
    # the survivor (rank 0) holds step 7 live; the restarted rank 1 has it in its node's memory
    p = make_plan([Report(0, live={7: 2}, mem_rng={0: [7]}), Report(1, mem={6: 2, 7: 2}, mem_rng={1: [6, 7]})])
    assert (p.step, p.source, p.rng_holders) == (7, "live", {0: 0, 1: 1})
    # a node joins: the live survivor sends the state
    p = make_plan([Report(0, live={7: 1}, mem_rng={0: [7]}), Report(1)])
    assert (p.step, p.source, p.src_rank) == (7, "peer", 0)
    # a survivor one commit ahead of a rank whose RNG of that step is missing goes back to memory
    p = make_plan([Report(0, live={8: 2}, mem={7: 2}, mem_rng={0: [7, 8], 1: [7]}),
                   Report(1, mem={7: 2}, mem_rng={0: [7, 8], 1: [7]})])
    assert (p.step, p.source) == (7, "memory")


def make_job(tmp_path, seed=0, **options):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sampler = ElasticSampler(64, batch_size=8, seed=1, num_replicas=1, rank=0)
    state = State(
        model=model,
        optimizer=opt,
        sampler=sampler,
        checkpoint_dir=tmp_path / "ck",
        checkpoint_every=3,
        snapshot_dir=tmp_path / "shm",
        handle_signals=False,
        best=1.0,
        **options,
    )
    return model, opt, sampler, state


def train(model, opt, sampler, state, steps, settle=True):
    """``settle`` waits for each commit's background writes, so no checkpoint is skipped."""
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(5))
    for _ in range(steps):
        idx = next(iter(sampler))
        loss = model(data[idx]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.best = min(state.best, loss.item())
        state.commit()
        if settle:
            state.flush()


def test_state_restores_from_memory_then_disk(tmp_path):
    model, opt, sampler, state = make_job(tmp_path)
    assert state.restore() is None
    train(model, opt, sampler, state, 10)
    state.flush()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    best = state.best

    m2, o2, s2, st2 = make_job(tmp_path, seed=1)
    assert st2.restore() == "memory"
    assert st2.step == 10 and (s2.epoch, s2.position) == (1, 16) and st2.best == best
    for k, v in m2.state_dict().items():
        assert torch.equal(v, expected[k]), k
    # checkpoints every 3 steps, each one waited for: the newest is step 9
    newest = CheckpointDir(tmp_path / "ck").scan()[0].step
    assert newest == 9
    assert json.loads((tmp_path / "ck" / f"step-{newest:012d}" / "manifest.json").read_text())["step"] == newest
    st2.close()
    state.close()

    shutil.rmtree(tmp_path / "shm")
    m3, o3, s3, st3 = make_job(tmp_path, seed=2)
    assert st3.restore() == "disk"
    assert st3.step == newest and len(o3.state_dict()["state"]) == 6
    st3.close()


def test_checkpoint_is_skipped_while_the_previous_is_still_written(tmp_path):
    """A slow disk must not stall training: a due checkpoint is skipped (with one warning) while
    the previous one is still being written, and the next due one is written again."""
    import threading

    model, opt, sampler, state = make_job(tmp_path)
    state.restore()
    train(model, opt, sampler, state, 3)  # step 3: written
    release = threading.Event()
    state._persister.submit(lambda: release.wait(30))  # stands for a slow disk write
    with pytest.warns(UserWarning, match="checkpoint of step 6 skipped"):
        train(model, opt, sampler, state, 3, settle=False)
        state._pipe.wait()
    release.set()
    state._persister.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is shown once only, and step 9 is not skipped
        train(model, opt, sampler, state, 3)
    assert [c.step for c in CheckpointDir(tmp_path / "ck").scan()] == [9, 3]
    state.close()


def test_snapshot_every_k_commits_restores_the_last_snapshotted_step(tmp_path):
    """With ``snapshot_every=4`` and checkpoints every 3, steps 3, 4, 6, 8 and 9 are snapshotted
    (the four slots keep the newest four); a restart after step 10 gets step 9 back exactly, and
    ``checkpoint()`` at step 10 (not snapshotted) copies it first."""
    model, opt, sampler, state = make_job(tmp_path, snapshot_every=4)
    state.restore()
    after = {}
    for step in range(1, 11):
        train(model, opt, sampler, state, 1)
        after[step] = {k: v.clone() for k, v in model.state_dict().items()}
    assert sorted(i.step for i in MemorySnapshots(tmp_path / "shm", "local").scan()) == [4, 6, 8, 9]
    m2, o2, s2, st2 = make_job(tmp_path, seed=1, snapshot_every=4)
    assert st2.restore() == "memory" and st2.step == 9 and s2.position == 9 * 8 % 64
    for k, v in m2.state_dict().items():
        assert torch.equal(v, after[9][k]), k
    st2.close()
    state.checkpoint()  # step 10 was not snapshotted: checkpoint() copies it first
    assert CheckpointDir(tmp_path / "ck").scan()[0].step == 10
    state.close()
    with pytest.raises(ValueError, match="snapshot_every"):
        State(snapshot_dir=tmp_path, handle_signals=False, snapshot_every=0)


def test_snapshot_copy_in_chunks_shared_by_the_idle_thread_and_the_caller():
    """Chunks smaller than the tensors, taken by the idle helper and by ``finish()`` on this
    thread, give the same bytes as a plain copy; a non-contiguous tensor is copied by value."""
    state = {"a": torch.randn(1000, 37), "t": torch.randn(64, 48).t(), "b": torch.arange(5), "empty": torch.zeros(0)}
    flat = flatten(state)
    expected = torch.full((flat.nbytes,), 7, dtype=torch.uint8)  # alignment padding stays as it was
    copy_into(flat, expected)
    for _ in range(20):  # different interleavings of the two workers
        buf = torch.full((flat.nbytes,), 7, dtype=torch.uint8)
        copy = SnapshotCopy(flat, buf, chunk_bytes=4096)
        copy.start()
        copy.finish()
        assert copy.finished and torch.equal(buf, expected)
    roundtrip = materialize(make_header(flat, step=1), buf)
    assert torch.equal(roundtrip["t"], state["t"]) and torch.equal(roundtrip["a"], state["a"])


def test_state_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_dir"):
        State(checkpoint_every=5, snapshot_dir=tmp_path, handle_signals=False)
    with pytest.raises(ValueError, match="commit"):
        State(snapshot_dir=tmp_path, handle_signals=False, commit=1)


def test_rng_states_round_trip_and_payloads_of_the_tensor_form_still_apply():
    """A commit's RNG states (generator states kept as raw bytes) bring back the same draws; a
    payload written before, with the states as tensors, applies too (snapshots and checkpoints
    of an earlier version)."""
    import pickle
    import random

    from elastrun.train import rng

    torch.manual_seed(3)
    random.seed(4)
    payload = rng.capture()
    assert isinstance(pickle.loads(payload)["torch"], bytes)
    drawn = (torch.rand(4), random.random())
    torch.manual_seed(9)
    random.seed(9)
    rng.apply(payload)
    assert torch.equal(torch.rand(4), drawn[0]) and random.random() == drawn[1]

    earlier = pickle.dumps({"torch": torch.get_rng_state(), "random": random.getstate()})
    drawn = (torch.rand(4), random.random())
    rng.apply(earlier)
    assert torch.equal(torch.rand(4), drawn[0]) and random.random() == drawn[1]
