"""elastrun's own argument parsing, run on the environment and command line a pod of our manifests gets.

For every PET_* variable a pod sees (the manifest's env plus, for the PyTorchJob, the operator's), the
same value given as the matching ``--flag`` must produce the same LaunchConfig: that proves elastrun reads
the variable, under exactly that name. Then the parsed LaunchConfig must say what the manifest means.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from elastrun import cli, errors
from tests.deploy.podenv import FAKE_POD_FIELDS, K8S_DIR, REPO, find, launch, load_docs

pytestmark = pytest.mark.unit


EXAMPLE = REPO / "examples" / "train_imagenet_style.py"
ETCD_MEMBERS = "etcd-0.etcd:2379,etcd-1.etcd:2379,etcd-2.etcd:2379"

CASES = {
    "pytorchjob": ("pytorchjob.yaml", "PyTorchJob", "pytorch", {"run_id": "elastic-imagenet"}),
    "job": (
        "job.yaml",
        "Job",
        "elastrun",
        {"run_id": FAKE_POD_FIELDS["metadata.labels['batch.kubernetes.io/job-name']"]},
    ),
}


@pytest.fixture
def in_image_workdir(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse where the image's WORKDIR would be: /workspace holds examples/ as the repository does."""
    if not EXAMPLE.exists():
        pytest.skip(f"{EXAMPLE.relative_to(REPO)} is not in the tree yet")
    monkeypatch.chdir(REPO)


def _pod(case: str) -> tuple[list[str], dict[str, str]]:
    path, kind, name, _ = CASES[case]
    return launch(find(load_docs(K8S_DIR / path), kind), name)


def _flag(var: str) -> str:
    return "--" + var.removeprefix("PET_").lower().replace("_", "-")


@pytest.mark.parametrize("case", CASES)
def test_every_pet_variable_is_a_flag_elastrun_reads(case: str, in_image_workdir: None) -> None:
    argv, env = _pod(case)
    from_env = cli.parse(argv, env)
    pet = sorted(name for name in env if name.startswith("PET_"))
    assert pet, "the pod sets no PET_* variable at all"
    for var in pet:
        rest = {k: v for k, v in env.items() if k != var}
        flag = _flag(var) if env[var] == "" else f"{_flag(var)}={env[var]}"
        try:
            from_flag = cli.parse([flag, *argv], rest)
        except errors.UsageError as exc:
            pytest.fail(f"{var} is set, but elastrun has no {_flag(var)} flag: {exc}")
        assert dataclasses.asdict(from_flag) == dataclasses.asdict(from_env), (
            f"{var}={env[var]!r} does not act like {flag}: elastrun does not read {var}"
        )


def test_a_variable_elastrun_does_not_read_is_caught(in_image_workdir: None) -> None:
    """The check above can fail: a made-up PET_ name maps to a flag the parser rejects."""
    argv, env = _pod("job")
    with pytest.raises(errors.UsageError):
        cli.parse([f"{_flag('PET_RDZV_TIMEOUT_TYPO')}=5", *argv], env)


@pytest.mark.parametrize("case", CASES)
def test_pod_launch_config_is_the_intended_one(case: str, in_image_workdir: None) -> None:
    argv, env = _pod(case)
    cfg = cli.parse(argv, env)
    expected: dict[str, Any] = {
        "rdzv_backend": "etcd",
        "rdzv_endpoint": ETCD_MEMBERS,
        "min_nodes": 2,
        "max_nodes": 4,
        "nproc_per_node": 2,
        "max_restarts": 10,
        "stop_timeout": 45.0,
        "local_addr": FAKE_POD_FIELDS["status.podIP"],
        "rdzv_configs": {"join_timeout": "900"},
        "standalone": False,
        "entrypoint": "examples/train_imagenet_style.py",
        **CASES[case][3],
    }
    actual = {field: getattr(cfg, field) for field in expected}
    assert actual == expected
    assert cfg.args[:1] == ["--checkpoint-dir"] and cfg.args[1].startswith("/checkpoints/")


def test_example_accepts_the_arguments_the_manifests_pass() -> None:
    """The manifests and the sbatch script pass --checkpoint-dir to the example; it must know it."""
    if not EXAMPLE.exists():
        pytest.skip(f"{EXAMPLE.relative_to(REPO)} is not in the tree yet")
    source = EXAMPLE.read_text()
    for case in CASES:
        argv, _ = _pod(case)
        for word in argv[1:]:
            if word.startswith("--"):
                assert word.split("=", 1)[0] in source, f"{EXAMPLE.name} has no {word} option"
