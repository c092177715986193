"""c10d and static backends end to end; join timeout; the backend registry."""

import sys
import textwrap
import threading
import time

import pytest

from elastrun.rendezvous import registry
from elastrun.rendezvous.api import FailureRecord, NodeInfo, RendezvousConfigError, RendezvousParameters
from elastrun.rendezvous.c10d import create_handler
from tests import warm
from tests.harness import REPO, SCRIPTS, base_env, free_port, read_steps

pytestmark = pytest.mark.e2e


def test_join_timeout_names_what_it_waited_for(agents, tmp_path):
    port = free_port()
    agent = agents.start(
        ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         "--rdzv-id=never", "--rdzv-conf=join_timeout=2"],
        env=base_env(STEPS_LOG=str(tmp_path)),
    )
    assert agent.wait(60) == 1, agent.output()
    out = agent.output()
    assert "did not complete within 2 s" in out
    assert "at least 2 node(s)" in out and "1 joined" in out
    assert "Traceback" not in out


def test_static_backend_two_nodes(agents, tmp_path):
    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    port = free_port()
    env = base_env(STEPS_LOG=str(steps_dir), STEPS="5", STEP_SECONDS="0.01")
    nodes = [
        agents.start(["--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}", "--master-addr=127.0.0.1",
                      f"--master-port={port}"], env=env, name=f"node{rank}")
        for rank in (1, 0)
    ]
    for node in nodes:
        assert node.wait(120) == 0, node.output()
    steps = read_steps(steps_dir)
    assert {s.rank for s in steps} == {0, 1} and {s.world for s in steps} == {2}
    # Node rank 1 got global rank 1 although it started first.
    assert "this node is group rank 1" in nodes[0].output()


@pytest.mark.unit
def test_unknown_backend_lists_known_ones():
    params = RendezvousParameters(backend="nope", endpoint="", run_id="x", min_nodes=1, max_nodes=1)
    with pytest.raises(RendezvousConfigError, match="known backends: .*c10d.*static"):
        registry.create_handler(params)


@pytest.mark.unit
def test_unknown_rdzv_conf_key_is_an_error():
    params = RendezvousParameters(backend="c10d", endpoint="127.0.0.1:0", run_id="x", min_nodes=1, max_nodes=1,
                                  config={"bogus": "1"})
    with pytest.raises(RendezvousConfigError, match="unknown --rdzv-conf key 'bogus'.*join_timeout"):
        registry.create_handler(params)


def test_a_registered_backend_is_used_by_the_launcher(tmp_path):
    """Code can register a backend: here one that wraps c10d and records that it was called."""
    marker = tmp_path / "used"
    code = textwrap.dedent(f"""
        import sys
        from elastrun.rendezvous import registry
        from elastrun.rendezvous.c10d import create_handler as c10d

        def mine(params):
            open({str(marker)!r}, "w").close()
            params.backend = "c10d"
            return c10d(params)

        registry.register("mine", mine)
        from elastrun.cli import main
        sys.exit(main(["--rdzv-backend=mine", "--rdzv-endpoint=localhost:0", "--nproc-per-node=1",
                       {str(SCRIPTS / "env_dump.py")!r}]))
    """)
    out = tmp_path / "out"
    out.mkdir()
    proc = warm.run([sys.executable, "-c", code], cwd=REPO, env=base_env(OUT_DIR=str(out)),
                    capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert marker.exists()
    assert (out / "env_0.json").exists()


@pytest.mark.unit
def test_entry_point_group_is_declared_in_the_package():
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    group = data["project"]["entry-points"][registry.ENTRY_POINT_GROUP]
    assert group["c10d"] == "elastrun.rendezvous.c10d:BACKEND"
    assert group["static"] == "elastrun.rendezvous.c10d.static:BACKEND"
    for name, target in group.items():  # each names a backend object that the registry loads
        assert isinstance(registry._as_backend(registry._load(target)), registry.RendezvousBackend), name


def _hang(node: str, rank: int) -> FailureRecord:
    return FailureRecord(node_id=node, hostname=f"host-{node}", rank=rank, local_rank=0, exitcode=None, signal=None,
                         timestamp=time.time(), message="hang detected: no heartbeat for 2.0 s")


@pytest.mark.contract
def test_the_first_hang_claim_of_a_round_wins():
    """Two members of a round each find a silent worker (one hang and its blocked peer): the first
    claim is the hang, the other is told what came first; the winner asking again keeps it."""
    port = free_port()
    handlers = {node: create_handler(RendezvousParameters(
        "c10d", f"127.0.0.1:{port}", "claims", 2, 2, config={"is_host": str(node == "a").lower()}))
        for node in ("a", "b")}
    try:
        joined: dict[str, object] = {}
        threads = [threading.Thread(target=lambda n=n: joined.update({n: handlers[n].next_round(
            NodeInfo(n, "127.0.0.1", 1))})) for n in handlers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert {r.round for r in joined.values()} == {0}
        assert handlers["b"].claim_hang(_hang("b", 1)) is None
        assert handlers["a"].claim_hang(_hang("a", 0)) == "the hang of rank 1 on host-b"
        assert handlers["b"].claim_hang(_hang("b", 1)) is None
    finally:
        for node in ("b", "a"):  # the store's host last: it waits for the others to leave
            handlers[node].close()
