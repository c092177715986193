"""A DDP joiner's restore through the holder's snapshot server (real gloo ranks, a real server).

The joiner's bytes land straight in its model's own parameters.  Checked here: they are the
holder's bytes exactly; a transfer cut part-way falls back to the next copy (here the disk
checkpoint) and still ends with exact bytes; with no other copy the restore refuses on every rank
rather than start from a half-written model.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from elastrun.agent.snapserver import SnapshotServer
from tests import warm
from tests.harness import REPO, free_port

pytestmark = pytest.mark.e2e

WORKER = Path(__file__).with_name("joiner_worker.py")
RUN_ID = "joiner-wire-test"


def run_ranks(mode: str, nodes: list[tuple[Path, Path | None, str | None]], timeout: float = 120) -> list[dict]:
    """One worker per ``(snapshot dir, checkpoint dir, snapshot server)``; their JSON lines."""
    port = free_port()
    procs = []
    for rank, (snap, ckpt, server) in enumerate(nodes):
        env = dict(os.environ, PYTHONPATH=str(REPO), RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(len(nodes)),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   TORCHELASTIC_RUN_ID=RUN_ID)  # fmt: skip
        env.pop("ELASTRUN_SNAPSHOT_SERVER", None)
        if server:
            env["ELASTRUN_SNAPSHOT_SERVER"] = server
        argv = [sys.executable, str(WORKER), mode, str(snap), str(ckpt or "")]
        procs.append(warm.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for p, (out, err) in zip(procs, outs, strict=True):
        lines = out.strip().splitlines()
        assert lines, f"rank exited {p.returncode} without a result:\n{err[-3000:]}"
        results.append({**json.loads(lines[-1]), "rc": p.returncode, "stderr": err})
    return results


class CuttingProxy:
    """Forwards connections to a snapshot server, but closes each one after ``limit`` bytes of answers
    (a network that breaks in the middle of a transfer)."""

    def __init__(self, target: str, limit: int) -> None:
        host, _, port = target.rpartition(":")
        self.target, self.limit = (host, int(port)), limit
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.cuts = 0
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self.socks += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self.limit), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while limit is None or sent < limit:
                data = src.recv(1 << 16 if limit is None else min(1 << 16, limit - sent))
                if not data:
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        if limit is not None and sent >= limit:
            self.cuts += 1
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            s.close()


@pytest.fixture(scope="module")
def holder(tmp_path_factory):
    """Node 0's memory holds steps 4-6 (step 3 also in the checkpoint); node 1's is empty; node 0 has a
    snapshot server, as its agent would run.  Restores only read them: one for every test."""
    tmp_path = tmp_path_factory.mktemp("joiner")
    snaps = [tmp_path / "node0", tmp_path / "node1"]
    for d in snaps:
        d.mkdir()
    [trained] = run_ranks("train", [(snaps[0], tmp_path / "ck", None)])
    assert trained["rc"] == 0 and trained["step"] == 6, trained
    server = SnapshotServer(snaps[0], None, ("127.0.0.1", 0), "127.0.0.1")
    server.start()
    yield snaps, tmp_path / "ck", server, trained
    server.close()


def test_a_ddp_joiner_receives_the_holders_bytes_into_its_own_parameters(holder):
    snaps, _, server, trained = holder
    res = run_ranks("restore", [(snaps[0], None, server.address), (snaps[1], None, server.address)])
    assert [r["rc"] for r in res] == [0, 0], [r["stderr"][-2000:] for r in res]
    assert [r["source"] for r in res] == ["peer", "peer"] and res[1]["step"] == 6, res
    assert res[1]["transfer"]["via"] == "server", res[1]
    assert res[0]["digest"] == res[1]["digest"] == trained["digest"]
    # the weights (3 × 4 MiB) were received straight into the joiner's parameters, not into fresh pages
    assert res[1]["transfer"]["in_place"] == 3 * 4 << 20, res[1]["transfer"]
    assert res[1]["in_place"] and res[0]["in_place"]


def test_a_transfer_cut_part_way_falls_back_and_still_restores_exact_bytes(holder):
    snaps, ck, server, _ = holder
    proxy = CuttingProxy(server.address, 3 << 20)  # each connection dies after 3 MiB of a 24 MiB state
    try:
        res = run_ranks("restore", [(snaps[0], ck, proxy.address), (snaps[1], ck, proxy.address)])
    finally:
        proxy.close()
    assert proxy.cuts, "the proxy never cut a transfer: the test did not test the failure"
    assert [r["rc"] for r in res] == [0, 0], [r["stderr"][-2000:] for r in res]
    # every memory step was tried through the broken link and left out; the checkpoint (step 3) is next
    assert [r["source"] for r in res] == ["disk", "disk"] and res[1]["step"] == 3, res
    assert res[0]["digest"] == res[1]["digest"]
    assert "unreadable from rank 0's node" in res[1]["stderr"], res[1]["stderr"][-2000:]


def test_with_no_other_copy_a_torn_transfer_stops_every_rank(holder):
    snaps, _, server, _ = holder
    proxy = CuttingProxy(server.address, 3 << 20)
    try:
        res = run_ranks("restore", [(snaps[0], None, proxy.address), (snaps[1], None, proxy.address)])
    finally:
        proxy.close()
    assert [r["rc"] for r in res] == [3, 3], res  # neither rank starts fresh beside a half-written model
    assert all("neither fresh nor restored" in r["error"] for r in res), res
