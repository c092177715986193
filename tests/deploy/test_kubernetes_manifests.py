"""The Kubernetes manifests in deploy/kubernetes/ are valid objects and agree with one another.

Every built-in object is validated offline against the Kubernetes OpenAPI schemas that
``kubernetes-validate`` ships, for the oldest Kubernetes version the manifests claim (1.27) and the newest
the package knows. The PyTorchJob is validated against our own schema of its CRD
(tests/deploy/schemas/), and its pod template against Kubernetes' PodTemplate schema. Then the
cross-object facts no schema can see: selectors that select, grace periods that cover elastrun's stop
timeout, endpoints that name the etcd members that exist.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastrun.config import DEFAULT_STOP_TIMEOUT
from tests.deploy.podenv import K8S_DIR, container, find, launch, load_docs, operator_env, pod_template

pytestmark = pytest.mark.unit

kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")
jsonschema = pytest.importorskip("jsonschema")

MANIFESTS = sorted(K8S_DIR.glob("*.yaml"))
OLDEST_K8S = "1.27"
SCHEMA_PATH = Path(__file__).parent / "schemas" / "pytorchjob-kubeflow-v1.schema.yaml"
#: Seconds of grace, beyond elastrun's stop timeout, for the agent to leave the rendezvous and exit.
AGENT_EXIT_MARGIN = 15.0


def _objects() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in MANIFESTS for doc in load_docs(path)]


def _id(item: tuple[str, dict[str, Any]]) -> str:
    return f"{item[0]}:{item[1]['kind']}/{item[1]['metadata']['name']}"


BUILTIN = [item for item in _objects() if item[1]["kind"] != "PyTorchJob"]


def test_manifest_directory_has_the_expected_files() -> None:
    names = {path.name for path in MANIFESTS}
    assert {"etcd.yaml", "pytorchjob.yaml", "job.yaml", "checkpoints-pvc.yaml"} <= names


@pytest.mark.parametrize("version", [OLDEST_K8S, "latest"])
@pytest.mark.parametrize("item", BUILTIN, ids=_id)
def test_builtin_objects_match_kubernetes_schema(item: tuple[str, dict[str, Any]], version: str) -> None:
    _, obj = item
    target = kv.latest_version() if version == "latest" else version
    # strict: unknown fields are errors (the API server would drop or reject them).
    kv.validate(obj, target, strict=True)


def test_validator_rejects_a_misspelt_field() -> None:
    """The offline validator really checks: a typo in a pod spec field is an error."""
    job = find(load_docs(K8S_DIR / "job.yaml"), "Job")
    broken = copy.deepcopy(job)
    spec = broken["spec"]["template"]["spec"]
    spec["terminationGracePeriodSecond"] = spec.pop("terminationGracePeriodSeconds")
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, OLDEST_K8S, strict=True)


def _pytorchjob() -> dict[str, Any]:
    return find(load_docs(K8S_DIR / "pytorchjob.yaml"), "PyTorchJob")


def _crd_validator() -> Any:
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_pytorchjob_matches_crd_schema() -> None:
    errors = sorted(_crd_validator().iter_errors(_pytorchjob()), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


@pytest.mark.parametrize(
    "breakage",
    [
        "typo in elasticPolicy",
        "two masters",
        "no pytorch container",
        "unknown restart policy",
        "deprecated nProcPerNode",
        "uppercase job name",
    ],
)
def test_crd_schema_rejects_mistakes(breakage: str) -> None:
    """Each rule of our CRD schema catches the mistake it is there for."""
    job = copy.deepcopy(_pytorchjob())
    spec = job["spec"]
    if breakage == "typo in elasticPolicy":
        spec["elasticPolicy"]["minReplica"] = spec["elasticPolicy"].pop("minReplicas")
    elif breakage == "two masters":
        spec["pytorchReplicaSpecs"]["Master"] = copy.deepcopy(spec["pytorchReplicaSpecs"]["Worker"])
        spec["pytorchReplicaSpecs"]["Master"]["replicas"] = 2
    elif breakage == "no pytorch container":
        pod_template(job)["spec"]["containers"][0]["name"] = "trainer"
    elif breakage == "unknown restart policy":
        spec["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "OnExitCode"
    elif breakage == "deprecated nProcPerNode":
        spec["elasticPolicy"]["nProcPerNode"] = 2
    elif breakage == "uppercase job name":
        job["metadata"]["name"] = "Elastic-ImageNet"
    assert list(_crd_validator().iter_errors(job)), f"schema accepted: {breakage}"


@pytest.mark.parametrize("version", [OLDEST_K8S, "latest"])
def test_pytorchjob_pod_template_matches_kubernetes_schema(version: str) -> None:
    """The operator copies the Worker template into real pods: it must be a valid PodTemplateSpec."""
    job = _pytorchjob()
    wrapper = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "elastic-imagenet-worker"},
        "template": pod_template(job),
    }
    target = kv.latest_version() if version == "latest" else version
    kv.validate(wrapper, target, strict=True)


def test_pytorchjob_env_does_not_shadow_operator_variables() -> None:
    """A PET_* name the operator also sets would be silently overridden by the operator's value."""
    job = _pytorchjob()
    own = {entry["name"] for entry in container(job, "pytorch").get("env", [])}
    generated = {entry["name"] for entry in operator_env(job)}
    assert not own & generated, f"set these through elasticPolicy instead: {sorted(own & generated)}"


def _etcd_members() -> list[str]:
    """``host:port`` of every member of the etcd StatefulSet, as clients in the namespace name them."""
    docs = load_docs(K8S_DIR / "etcd.yaml")
    sts, svc = find(docs, "StatefulSet"), find(docs, "Service")
    assert svc["spec"]["clusterIP"] == "None", "member DNS names need a headless Service"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "client")
    name, service = sts["metadata"]["name"], svc["metadata"]["name"]
    return [f"{name}-{i}.{service}:{port}" for i in range(sts["spec"]["replicas"])]


def test_etcd_cluster_is_three_members_with_matching_initial_cluster() -> None:
    docs = load_docs(K8S_DIR / "etcd.yaml")
    sts, svc = find(docs, "StatefulSet"), find(docs, "Service")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    args = dict(a.split("=", 1) for a in container(sts, "etcd")["args"])
    peer_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "peer")
    expected = ",".join(f"etcd-{i}=http://etcd-{i}.{svc['metadata']['name']}:{peer_port}" for i in range(3))
    assert args["--initial-cluster"] == expected
    image = container(sts, "etcd")["image"]
    major, minor = (int(x) for x in image.rsplit(":v", 1)[1].split(".")[:2])
    assert (major, minor) >= (3, 4), f"elastrun speaks etcd's v3 API; {image} is too old"
    pdb = find(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1, "more than one member down loses quorum"


@pytest.mark.parametrize(
    ("path", "kind", "name"),
    [
        ("pytorchjob.yaml", "PyTorchJob", "pytorch"),
        ("job.yaml", "Job", "elastrun"),
    ],
)
def test_job_points_at_every_etcd_member(path: str, kind: str, name: str) -> None:
    obj = find(load_docs(K8S_DIR / path), kind)
    _, env = launch(obj, name)
    assert env["PET_RDZV_BACKEND"] == "etcd"
    assert env["PET_RDZV_ENDPOINT"].split(",") == _etcd_members()


@pytest.mark.parametrize(
    ("path", "kind", "name"),
    [
        ("pytorchjob.yaml", "PyTorchJob", "pytorch"),
        ("job.yaml", "Job", "elastrun"),
    ],
)
def test_grace_period_covers_elastrun_stop_timeout(path: str, kind: str, name: str) -> None:
    """SIGKILL must not arrive before the workers' checkpoint and the agent's exit."""
    obj = find(load_docs(K8S_DIR / path), kind)
    _, env = launch(obj, name)
    stop_timeout = float(env.get("PET_STOP_TIMEOUT", DEFAULT_STOP_TIMEOUT))
    grace = pod_template(obj)["spec"]["terminationGracePeriodSeconds"]
    assert grace >= stop_timeout + AGENT_EXIT_MARGIN, (grace, stop_timeout)


@pytest.mark.parametrize(("path", "kind"), [("pytorchjob.yaml", "PyTorchJob"), ("job.yaml", "Job")])
def test_disruption_budget_selects_the_job_pods_and_keeps_the_minimum(path: str, kind: str) -> None:
    docs = load_docs(K8S_DIR / path)
    obj, pdb = find(docs, kind), find(docs, "PodDisruptionBudget")
    labels = pod_template(obj)["metadata"]["labels"]
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items(), "the budget would guard no pod"
    if kind == "PyTorchJob":
        minimum = obj["spec"]["elasticPolicy"]["minReplicas"]
    else:
        minimum = int(
            next(e["value"] for e in container(obj, "elastrun")["env"] if e["name"] == "PET_NNODES").split(
                ":"
            )[0]
        )
    assert pdb["spec"]["minAvailable"] == minimum


@pytest.mark.parametrize(("path", "kind"), [("pytorchjob.yaml", "PyTorchJob"), ("job.yaml", "Job")])
def test_pods_get_shared_checkpoints_and_a_large_dev_shm(path: str, kind: str) -> None:
    obj = find(load_docs(K8S_DIR / path), kind)
    spec = pod_template(obj)["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    claim = volumes[mounts["/checkpoints"]]["persistentVolumeClaim"]["claimName"]
    pvc = find(load_docs(K8S_DIR / "checkpoints-pvc.yaml"), "PersistentVolumeClaim")
    assert claim == pvc["metadata"]["name"]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"], "pods on different nodes share it"


def test_plain_job_ignores_disruptions_and_fails_fast_on_elastrun_verdicts() -> None:
    job = find(load_docs(K8S_DIR / "job.yaml"), "Job")
    assert "completions" not in job["spec"], "work-queue mode: done when training is done"
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    rules = job["spec"]["podFailurePolicy"]["rules"]
    ignore = [r for r in rules if r["action"] == "Ignore"]
    assert any(c["type"] == "DisruptionTarget" for r in ignore for c in r["onPodConditions"])
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert len(fail) == 1 and fail[0]["onExitCodes"]["containerName"] == "elastrun"
    signal_codes = set(fail[0]["onExitCodes"]["values"])
    assert fail[0]["onExitCodes"]["operator"] == "NotIn"
    assert {137, 143} <= signal_codes, "SIGKILL and SIGTERM deaths must stay retryable"
    assert 2 not in signal_codes and 1 not in signal_codes
