"""``elastrun.cli.parse``: flags in both spellings, PET_ variables, defaults, --standalone, redirects.

These call the parser in-process with an explicit environment mapping, so the real environment of
the test run cannot leak in.  Bad input run through the real command is in test_bad_input.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from elastrun.cli import FLAGS, help_text, parse, parse_with_warnings
from elastrun.config import DEFAULT_MASTER_PORT, Std
from elastrun.errors import UsageError
from elastrun.hostprobe import count_gpus, cpu_count, torch_has_cuda

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return str(path)


def test_defaults_are_torchruns(script: str) -> None:
    config = parse([script], {})
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 1, 1)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("static", "", "none")
    # The one default that differs on purpose: workers fork from the warm pool (README, "Warm pool").
    assert (config.max_restarts, config.monitor_interval, config.start_method) == (0, 0.1, "fork")
    assert (config.role, config.node_rank, config.master_addr) == ("default", 0, "127.0.0.1")
    assert config.redirects == {} and config.tee == {} and config.local_ranks_filter is None
    assert config.rdzv_configs == {} and not config.standalone
    assert not (config.module or config.no_python or config.run_path)
    assert (config.stop_timeout, config.exit_barrier_timeout) == (20.0, 300.0)
    assert config.log_dir is None and config.hang_timeout is None and config.startup_timeout is None
    assert config.entrypoint == script and config.args == []


def test_one_node_without_backend_leaves_master_port_to_the_agent(script: str) -> None:
    assert parse([script], {}).master_port is None
    assert parse(["--nnodes=1:1", script], {}).master_port is None
    # torchrun's default wherever the user asked for static explicitly or runs several nodes.
    assert parse(["--rdzv-backend=static", script], {}).master_port == DEFAULT_MASTER_PORT
    assert parse(["--nnodes=2", script], {}).master_port == DEFAULT_MASTER_PORT
    assert parse(["--master-port=1234", script], {}).master_port == 1234
    assert parse(["--rdzv-backend=c10d", "--nnodes=2", script], {}).master_port is None


# (flag, value on the command line, LaunchConfig field, expected value)
VALUE_FLAGS = [
    ("--nnodes", "2:4", "min_nodes", 2),
    ("--nproc-per-node", "3", "nproc_per_node", 3),
    ("--rdzv-backend", "c10d", "rdzv_backend", "c10d"),
    ("--rdzv-endpoint", "node7:1234", "rdzv_endpoint", "node7:1234"),
    ("--rdzv-id", "job42", "run_id", "job42"),
    ("--rdzv-conf", "join_timeout=5,x=2", "rdzv_configs", {"join_timeout": "5", "x": "2"}),
    ("--max-restarts", "3", "max_restarts", 3),
    ("--monitor-interval", "0.5", "monitor_interval", 0.5),
    ("--start-method", "forkserver", "start_method", "forkserver"),
    ("--role", "trainer", "role", "trainer"),
    ("--node-rank", "0", "node_rank", 0),
    ("--master-addr", "10.1.2.3", "master_addr", "10.1.2.3"),
    ("--master-port", "23456", "master_port", 23456),
    ("--local-addr", "node7.example", "local_addr", "node7.example"),
    ("--log-dir", "/tmp/elastrun-logs-not-created", "log_dir", "/tmp/elastrun-logs-not-created"),
    ("--redirects", "3", "redirects", {-1: Std.ALL}),
    ("--tee", "0:1,1:2", "tee", {0: Std.OUT, 1: Std.ERR}),
    ("--local-ranks-filter", "0,2", "local_ranks_filter", {0, 2}),
    ("--stop-timeout", "7.5", "stop_timeout", 7.5),
    ("--exit-barrier-timeout", "60", "exit_barrier_timeout", 60.0),
    ("--preload", "torch,numpy.linalg", "preload", ["torch", "numpy.linalg"]),
    ("--metrics-port", "9100", "metrics_port", 9100),
    ("--hang-timeout", "30", "hang_timeout", 30.0),
    ("--startup-timeout", "90", "startup_timeout", 90.0),
    ("--reform-timeout", "2.5", "reform_timeout", 2.5),
]
SWITCHES = [
    ("--standalone", "standalone"),
    ("--event-log-stdout", "event_log_stdout"),
    ("--quiet", "quiet"),
    ("--verbose", "verbose"),
]


def _extra_args(flag: str) -> list[str]:
    """Companion flags a value needs to be valid (e.g. a MIN:MAX node range needs an elastic backend)."""
    if flag in ("--nnodes", "--rdzv-endpoint", "--rdzv-conf"):
        return ["--rdzv-backend=c10d"]
    if flag in ("--master-addr", "--master-port", "--node-rank"):
        return ["--nnodes=2"]
    return []


@pytest.mark.parametrize(("flag", "value", "field", "expected"), VALUE_FLAGS, ids=[v[0] for v in VALUE_FLAGS])
def test_value_flag_spellings_and_env(
    script: str, flag: str, value: str, field: str, expected: object
) -> None:
    underscore = "--" + flag[2:].replace("-", "_")
    env_name = "PET_" + flag[2:].replace("-", "_").upper()
    extra = _extra_args(flag)
    for argv in ([flag, value], [f"{flag}={value}"], [underscore, value], [f"{underscore}={value}"]):
        assert getattr(parse([*extra, *argv, script], {}), field) == expected, argv
    assert getattr(parse([*extra, script], {env_name: value}), field) == expected, env_name


@pytest.mark.parametrize(("flag", "field"), SWITCHES, ids=[s[0] for s in SWITCHES])
def test_switch_spellings_and_boolean_env_words(script: str, flag: str, field: str) -> None:
    underscore = "--" + flag[2:].replace("-", "_")
    env_name = "PET_" + flag[2:].replace("-", "_").upper()
    assert getattr(parse([flag, script], {}), field) is True
    assert getattr(parse([underscore, script], {}), field) is True
    assert getattr(parse([script], {}), field) is False
    for word in ("1", "true", "yes", "TRUE", "Yes"):
        assert getattr(parse([script], {env_name: word}), field) is True, word
    for word in ("0", "false", "no", "NO"):
        assert getattr(parse([script], {env_name: word}), field) is False, word
    with pytest.raises(UsageError, match=env_name):
        parse([script], {env_name: "maybe"})


def test_every_torchrun_flag_is_accepted_in_both_spellings() -> None:
    torchrun_flags = {
        "--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf",
        "--standalone", "--max-restarts", "--monitor-interval", "--start-method", "--event-log-handler",
        "--role", "--module", "--no-python", "--run-path", "--log-dir", "--redirects", "--tee",
        "--local-ranks-filter", "--duplicate-stdout-filters", "--duplicate-stderr-filters", "--node-rank",
        "--master-addr", "--master-port", "--local-addr", "--logs-specs", "--numa-binding",
        "--signals-to-handle", "--shutdown-timeout", "--virtual-local-rank",
    }  # fmt: skip
    accepted = {name for flag in FLAGS for name in flag.spellings}
    for name in torchrun_flags:
        assert name in accepted and "--" + name[2:].replace("-", "_") in accepted, name
    assert {"-m", "-r", "-t"} <= accepted


def test_command_line_wins_over_env(script: str) -> None:
    env = {"PET_NPROC_PER_NODE": "4", "PET_MAX_RESTARTS": "9", "PET_STANDALONE": "1"}
    config = parse(["--nproc-per-node=2", "--max-restarts", "1", script], env)
    assert (config.nproc_per_node, config.max_restarts, config.standalone) == (2, 1, True)
    assert parse([script], env).nproc_per_node == 4
    # An empty variable counts as unset.
    assert parse([script], {"PET_NPROC_PER_NODE": ""}).nproc_per_node == 1


def test_kubeflow_style_environment(script: str) -> None:
    env = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "2",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "trainer-master-0",
        "PET_MASTER_PORT": "23456",
    }
    config = parse([script, "--epochs", "3"], env)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 2)
    assert (config.node_rank, config.master_addr, config.master_port) == (1, "trainer-master-0", 23456)
    assert config.args == ["--epochs", "3"]


def test_module_and_no_python_from_env(script: str) -> None:
    config = parse(["json.tool", "--sort-keys"], {"PET_MODULE": "1"})
    assert config.module and config.entrypoint == "json.tool" and config.args == ["--sort-keys"]
    config = parse(["true", "x"], {"PET_NO_PYTHON": "yes"})
    assert config.no_python and config.worker_argv("python") == ["true", "x"]
    assert parse([script], {"PET_RUN_PATH": "true"}).run_path


def test_everything_after_the_script_belongs_to_the_script(script: str) -> None:
    config = parse(["--nproc-per-node=2", script, "--nnodes", "5", "-m", "--help", "--", "x"], {})
    assert config.args == ["--nnodes", "5", "-m", "--help", "--", "x"]
    assert (config.nproc_per_node, config.min_nodes, config.module) == (2, 1, False)
    config = parse(["--", script, "--nproc-per-node=3"], {})
    assert config.entrypoint == script and config.args == ["--nproc-per-node=3"]


def test_short_options(script: str) -> None:
    config = parse(["-r3", "-t=2", "-qm", "pkg.train", "--lr", "0.1"], {})
    assert config.redirects == {-1: Std.ALL} and config.tee == {-1: Std.ERR}
    assert config.quiet and config.module and config.entrypoint == "pkg.train"
    assert parse(["-r", "0:3", script], {}).redirects == {0: Std.ALL}


def test_redirect_specs(script: str) -> None:
    cases = {
        "0": {},
        "1": {-1: Std.OUT},
        "3": {-1: Std.ALL},
        "0:1,1:2": {0: Std.OUT, 1: Std.ERR},
        "0:3,1:0,2:1,12:2": {0: Std.ALL, 1: Std.NONE, 2: Std.OUT, 12: Std.ERR},
    }
    for spec, expected in cases.items():
        assert parse([f"--redirects={spec}", f"--tee={spec}", script], {}).redirects == expected, spec
    for bad in ("4", "x", "0:4", "0:1,", "0:1;1:2", "0:1,0:2", ":1", "-1:2"):
        with pytest.raises(UsageError, match="--redirects"):
            parse([f"--redirects={bad}", script], {})


def test_standalone(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    first = parse(["--standalone", "--nproc-per-node=2", script], {})
    second = parse(["--standalone", script], {})
    assert (first.rdzv_backend, first.rdzv_endpoint, first.standalone) == ("c10d", "localhost:0", True)
    assert (first.min_nodes, first.max_nodes, first.master_port) == (1, 1, None)
    assert uuid.UUID(first.run_id) and first.run_id != second.run_id
    assert capsys.readouterr().err == ""
    # Explicit rendezvous settings are ignored, as torchrun does, with one warning line.
    config = parse(["--standalone", "--rdzv-endpoint=node1:29400", "--rdzv-id=x", script], {})
    assert (config.rdzv_endpoint, config.run_id != "x") == ("localhost:0", True)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("elastrun: warning: --standalone ignores")
    assert "--rdzv-endpoint=node1:29400" in err[0] and "--rdzv-id=x" in err[0]
    with pytest.raises(UsageError, match="--standalone runs one node"):
        parse(["--standalone", "--nnodes=1:2", script], {})


def test_endpoints(script: str) -> None:
    def endpoint(value: str, backend: str = "c10d") -> str:
        argv = [f"--rdzv-backend={backend}", "--nnodes=1:2", f"--rdzv-endpoint={value}", script]
        return parse(argv, {}).rdzv_endpoint

    assert endpoint("node1") == "node1:29400"
    assert endpoint("node1:1") == "node1:1"
    assert endpoint("10.0.0.1:65535") == "10.0.0.1:65535"
    assert endpoint("[::1]:5000") == "[::1]:5000"
    assert endpoint("[fe80::1]") == "[fe80::1]:29400"
    assert endpoint("::1") == "[::1]:29400"
    assert endpoint("localhost:0") == "localhost:0"
    assert endpoint("e1:2379,e2,[::1]:12", "etcd") == "e1:2379,e2:2379,[::1]:12"
    assert parse(["--rdzv-backend=c10d", "--nnodes=2", script], {}).rdzv_endpoint == "localhost:29400"
    for bad in ("host:1:x", "host:99999", "host:port", "[nope]:1", "host:", ":29400", "h1:1,h2:2", "a b"):
        with pytest.raises(UsageError, match="--rdzv-endpoint"):
            endpoint(bad)


def test_rdzv_conf(script: str) -> None:
    conf = parse(["--rdzv-conf", "join_timeout=30, last_call_timeout=0.5,url=http://x/y?a=b", script], {})
    assert conf.rdzv_configs == {"join_timeout": "30", "last_call_timeout": "0.5", "url": "http://x/y?a=b"}
    for bad in ("join_timeout", "=3", "a=", "a=1,", "a=1,a=2", "join_timeout=-1", "join_timeout=soon"):
        with pytest.raises(UsageError, match="--rdzv-conf"):
            parse([f"--rdzv-conf={bad}", script], {})


def test_static_backend_checks_node_rank_against_nnodes(script: str) -> None:
    assert parse(["--nnodes=3", "--node-rank=2", script], {}).node_rank == 2
    with pytest.raises(UsageError, match=r"--node-rank=3 .*\[0, 3\)"):
        parse(["--nnodes=3", "--node-rank=3", script], {})
    with pytest.raises(UsageError, match="static backend needs a fixed node count"):
        parse(["--rdzv-backend=static", "--nnodes=2:3", script], {})


def test_static_only_flags_warn_with_other_backends(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = parse(["--rdzv-backend=c10d", "--node-rank=1", "--master-port=1234", script], {})
    assert config.master_port is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--node-rank=1" in err and "only used by the static backend" in err
    # Kubeflow sets these variables for every job: no warning for them.
    parse(["--rdzv-backend=c10d", script], {"PET_NODE_RANK": "1", "PET_MASTER_PORT": "1"})
    assert capsys.readouterr().err == ""


def test_ignored_torchrun_flags_warn(script: str) -> None:
    _, warnings = parse_with_warnings(["--numa-binding=node", "--signals-to-handle=SIGTERM", script], {})
    assert warnings == ["--numa-binding=node is accepted for torchrun compatibility and ignored by elastrun"]
    _, warnings = parse_with_warnings(["--signals-to-handle=SIGTERM,SIGALRM", script], {})
    assert len(warnings) == 1 and "SIGUSR2" in warnings[0]
    with pytest.raises(UsageError, match="unknown signal SIGNOPE"):
        parse(["--signals-to-handle=SIGNOPE", script], {})
    # torchrun's --shutdown-timeout and its variable set elastrun's stop timeout.
    assert parse(["--shutdown-timeout=5", script], {}).stop_timeout == 5.0
    assert parse([script], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "8"}).stop_timeout == 8.0


def test_quiet_silences_warnings(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    parse(["-q", "--standalone", "--rdzv-id=x", script], {})
    assert capsys.readouterr().err == ""


def test_nproc_words(script: str) -> None:
    assert parse(["--nproc-per-node=cpu", script], {}).nproc_per_node == len(os.sched_getaffinity(0))
    expected_auto = count_gpus(os.environ) if torch_has_cuda() and count_gpus(os.environ) else cpu_count()
    assert parse(["--nproc-per-node=auto", script], dict(os.environ)).nproc_per_node == expected_auto
    # CUDA_VISIBLE_DEVICES hides GPUs the way CUDA does.
    assert count_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert count_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == 0
    if count_gpus(os.environ) == 0:
        with pytest.raises(UsageError, match="no GPU"):
            parse(["--nproc-per-node=gpu", script], dict(os.environ))


@pytest.mark.e2e
def test_torch_build_is_read_without_importing_torch() -> None:
    code = (
        "import sys; from elastrun.hostprobe import torch_has_cuda; has = torch_has_cuda(); "
        "assert 'torch' not in sys.modules; import torch; print(has == (torch.version.cuda is not None))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


@pytest.mark.e2e
def test_cli_and_parse_do_not_import_torch(script: str) -> None:
    code = (
        "import sys; from elastrun.cli import parse; "
        f"parse(['--rdzv-backend=etcd-v3', '--rdzv-endpoint=h', '--nproc-per-node=auto', {script!r}], {{}}); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_unknown_option_suggests_the_closest_flag(script: str) -> None:
    with pytest.raises(UsageError, match="did you mean --nproc-per-node"):
        parse(["--nprocs", "2", script], {})
    with pytest.raises(UsageError, match="needs a value"):
        parse(["--nnodes"], {})
    with pytest.raises(UsageError, match="takes no value"):
        parse(["--standalone=1", script], {})
    with pytest.raises(UsageError, match="unknown option -x"):
        parse(["-qx", script], {})
    # No prefix matching: an abbreviation is not taken for the flag it starts.
    with pytest.raises(UsageError, match="unknown option --nproc;"):
        parse(["--nproc=2", script], {})


def test_help_documents_every_flag_default_and_variable() -> None:
    text = help_text()
    for flag in FLAGS:
        assert flag.names[-1] in text, flag.names
        if flag.default:
            assert f"Default: {flag.default}." in text.replace("\n        ", " "), flag.names
        if flag.dest not in ("help", "version"):
            assert f"PET_{flag.dest.upper()}" in text, flag.dest
