"""The job token on the etcd backend: a real job admits only nodes with its token and ignores forged values."""

from __future__ import annotations

import json
import time

import pytest

from elastrun.observe.status_view import read_status
from elastrun.rendezvous.api import RendezvousParameters
from elastrun.rendezvous.auth import TOKEN_ENV, JobTokenRejected
from elastrun.rendezvous.etcd.client import EtcdClient, EtcdSettings, Shared
from tests.harness import read_steps, wait_until
from tests.rendezvous.etcd_cluster import EtcdCluster, etcd_available
from tests.rendezvous.hostile import Forger, assert_job_undisturbed, token_job

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.etcd,
    pytest.mark.skipif(not etcd_available(), reason="no etcd binary (apt-get install etcd-server)"),
]

TOKEN = "0f1e2d3c4b5a69788796a5b4c3d2e1f00112233445566778"
STEPS = 40


def test_etcd_job_with_a_token_rejects_other_tokens_and_ignores_forged_values(agents, tmp_path):
    job = token_job(tmp_path, TOKEN, STEPS)
    token_file, steps_dir, log_dir, env = job.token_file, job.steps_dir, job.log_dir, job.env
    run_id = "etcd-token"
    with EtcdCluster(1) as etcd:
        bare = ["--nproc-per-node=1", "--rdzv-backend=etcd", f"--rdzv-endpoint={etcd.endpoints}",
                f"--rdzv-id={run_id}", "--monitor-interval=0.1"]
        flags = ["--nnodes=2", *bare, f"--rdzv-conf=token_file={token_file}", f"--log-dir={log_dir}"]
        nodes = [agents.start(flags, env=env, name=f"node{i}") for i in range(2)]
        wait_until(lambda: read_steps(steps_dir), 90, what="the first steps")

        # Another token, and none: one line, exit 2, before anything starts.
        for name, extra in (("wrong", {TOKEN_ENV: "a different token of some length"}), ("none", {})):
            stranger = agents.start(["--nnodes=1:3", *bare], env={**env, **extra}, name=name)
            assert stranger.wait(60) == 2, stranger.output()
            lines = stranger.output().strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("elastrun: error: job token rejected"), lines

        # Status needs the token.
        params = RendezvousParameters("etcd", etcd.endpoints, run_id, 1, 1)
        with pytest.raises(JobTokenRejected, match="requires a job token"):
            read_status(params, 3.0)
        params.config = {"token_file": str(token_file)}
        doc = read_status(params, 3.0)
        members = [n["node_id"] for n in doc["nodes"]]
        assert len(members) == 2 and doc["world_size"] == 2, doc

        # The stranger: an etcd client without the token writes forged values into the job's keys.
        client = EtcdClient(EtcdSettings(endpoints=[("127.0.0.1", int(etcd.endpoints.rsplit(":", 1)[1]))]), Shared())
        epoch = json.loads(client.get(f"/elastrun/{run_id}/epoch").value)
        q = f"/elastrun/{run_id}/e/{epoch['id']}/"
        forger = Forger(run_id, epoch["auth"].split(":")[1], put=client.put)
        for _ in range(2):
            forger.attack_etcd(q, doc["round"], members, tag=False)
            forger.attack_etcd(q, doc["round"], members, tag=True)
            time.sleep(0.3)
        attacked_at = time.time()
        after = read_status(params, 3.0)
        assert [n["node_id"] for n in after["nodes"]] == members and after["aborted"] is None, after
        assert after["round"] == doc["round"] and after["waiting"] == [], after

        events = assert_job_undisturbed(nodes, job, STEPS, attacked_at)
        forged = [e for e in events if e["event"] == "rendezvous_warning" and e.get("kind") == "forged_value"]
        seen = sorted({e["event"] for e in events})
        assert forged and len({(e["node"], e["key"]) for e in forged}) == len(forged), seen
        assert etcd.list_keys() == [], "the last agent out removes the job's keys, forged ones too"
        print(f"etcd: forged writes tried: {forger.tries}; forged values reported: {len(forged)}; acted on: 0")
