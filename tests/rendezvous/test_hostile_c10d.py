"""A c10d job with a job token keeps running while a stranger writes forged rendezvous values into it."""

from __future__ import annotations

import datetime
import time

import pytest

from elastrun.observe.status_view import read_status
from elastrun.rendezvous.api import RendezvousParameters
from elastrun.rendezvous.auth import JobToken
from tests.harness import free_port, listening, read_steps, wait_until
from tests.rendezvous.hostile import Forger, assert_job_undisturbed, token_job

pytestmark = pytest.mark.e2e

TOKEN = "9b8a7c6d5e4f30112233445566778899aabbccddeeff0011"
STEPS = 40


def test_forged_joins_results_aborts_deaths_and_heartbeats_are_not_acted_on(agents, tmp_path):
    import torch.distributed as dist

    job = token_job(tmp_path, TOKEN, STEPS)
    token_file, steps_dir, log_dir, env = job.token_file, job.steps_dir, job.log_dir, job.env
    port, run_id = free_port(), "hostile"
    flags = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             f"--rdzv-id={run_id}", f"--rdzv-conf=token_file={token_file}", f"--log-dir={log_dir}"]
    nodes = [agents.start(flags, env=env, name="host")]
    wait_until(lambda: listening(port), 30, what="the store host to listen")
    nodes.append(agents.start(flags, env=env, name="other"))
    wait_until(lambda: read_steps(steps_dir), 90, what="the first steps")
    params = RendezvousParameters("c10d", f"127.0.0.1:{port}", run_id, 1, 1, config={"token_file": str(token_file)})
    doc = read_status(params, 3.0)
    members = [n["node_id"] for n in doc["nodes"]]
    assert len(members) == 2, doc

    # The stranger: a plain store client.  It learnt the job's secret namespace (as one reading the
    # traffic would) but not the token.
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    marker = store.get(f"/elastrun/{run_id}/auth").decode()
    namespace = JobToken(TOKEN.encode(), run_id).accept(marker, "test").prefix
    forger = Forger(run_id, marker.split(":")[1], put=store.set, add=store.add, append=store.append)
    for _ in range(3):
        forger.attack(f"/elastrun/{run_id}/", doc["round"], members, tag=False)  # blind: public keys
        forger.attack(namespace, doc["round"], members, tag=False)  # no tag
        forger.attack(namespace, doc["round"], members, tag=True)  # another token's tag
        time.sleep(0.3)
    attacked_at = time.time()

    # While the stranger's values sit in the store, status (with the token) shows the real job (a
    # heartbeat the stranger overwrote reads as missing until its agent writes the next one).
    after = read_status(params, 3.0)
    assert after["round"] == doc["round"] and [n["node_id"] for n in after["nodes"]] == members, after
    wait_until(lambda: {n["state"] for n in read_status(params, 3.0)["nodes"]} == {"alive"}, 5,
               what="both nodes shown alive")

    # Every step ran once per rank, in one world of 2, in the first generation; and after the attack.
    events = assert_job_undisturbed(nodes, job, STEPS, attacked_at)
    assert "stranger" not in str([e for e in events if e["event"] == "round_closed"])
    forged = [e for e in events if e["event"] == "rendezvous_warning" and e.get("kind") == "forged_value"]
    assert forged, sorted({e["event"] for e in events})
    # Reported once per key and node, and only about keys of the job's secret namespace.
    assert len({(e["node"], e["key"]) for e in forged}) == len(forged)
    assert all(e["key"].startswith(namespace) for e in forged)
    print(f"forged writes tried: {forger.tries}; forged values reported: {len(forged)}; acted on: 0")
