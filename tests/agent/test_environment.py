"""The worker environment contract (torchrun's, plus elastrun's own variables)."""

import json

import pytest

from tests.harness import SCRIPTS, base_env

pytestmark = pytest.mark.e2e


def test_workers_get_torchruns_environment(agents, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    agent = agents.start(
        ["--standalone", "--nproc-per-node=2", "--max-restarts=1", "--role=trainer"],
        script=[str(SCRIPTS / "env_dump.py"), "--flag", "value"],
        env=base_env(OUT_DIR=str(out)),
    )
    assert agent.wait(120) == 0, agent.output()
    facts = [json.loads((out / f"env_{r}.json").read_text()) for r in (0, 1)]
    for rank, fact in enumerate(facts):
        env = fact["env"]
        assert fact["torchelastic_launched"] is True
        assert fact["rank"] == rank and fact["world_size"] == 2
        assert fact["argv"][1:] == ["--flag", "value"]
        assert fact["argv"][0].endswith("env_dump.py")
        expected = {
            "LOCAL_RANK": str(rank),
            "RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_NAME": "trainer",
            "LOCAL_WORLD_SIZE": "2",
            "WORLD_SIZE": "2",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": "2",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "1",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "OMP_NUM_THREADS": "1",
        }
        for key, value in expected.items():
            assert env.get(key) == value, (key, env.get(key))
        for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
                    "ELASTRUN_NODE_ID", "ELASTRUN_SNAPSHOT_DIR"):
            assert env.get(key), key
        assert int(env["MASTER_PORT"]) > 0
    # Both ranks bootstrap from the same store, and the error files are per rank.
    assert facts[0]["env"]["MASTER_PORT"] == facts[1]["env"]["MASTER_PORT"]
    assert facts[0]["env"]["TORCHELASTIC_ERROR_FILE"] != facts[1]["env"]["TORCHELASTIC_ERROR_FILE"]
    # --standalone picks a random run id.
    assert facts[0]["env"]["TORCHELASTIC_RUN_ID"] not in ("", "none")


def test_user_omp_num_threads_is_kept(agents, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    agent = agents.start(
        ["--standalone", "--nproc-per-node=2"],
        script=[str(SCRIPTS / "env_dump.py")],
        env=base_env(OUT_DIR=str(out), OMP_NUM_THREADS="3"),
    )
    assert agent.wait(120) == 0, agent.output()
    env = json.loads((out / "env_0.json").read_text())["env"]
    assert env["OMP_NUM_THREADS"] == "3"
