"""What the elastrun process in a pod of our manifests sees: its environment and its command line.

Between ``kubectl apply`` and the process start, two things change a container's environment, and a test
that read the manifest's ``env`` as written would check the wrong thing:

1. for a PyTorchJob with an ``elasticPolicy``, the Kubeflow training-operator appends PET_* variables of
   its own after the container's ``env`` (PYTHONUNBUFFERED first, then PET_RDZV_ENDPOINT, PET_RDZV_BACKEND,
   PET_NNODES and the optional ones, in that order);
2. the kubelet resolves the list: downward-API fields become values, ``$(NAME)`` refers to a variable
   defined earlier, and when a name appears twice the later entry wins.

This module reproduces both for the fields our manifests use (our own code, written from reading the
operator's env generator and the kubelet's documented rules), with a fixed fake pod for the fields only a
running pod has (its IP, its labels).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "deploy" / "kubernetes"

#: Values of the downward-API fields our manifests read, for a made-up pod.
FAKE_POD_FIELDS: dict[str, str] = {
    "status.podIP": "10.42.0.17",
    "metadata.name": "elastic-imagenet-worker-3",
    "metadata.namespace": "training",
    "metadata.labels['batch.kubernetes.io/job-name']": "elastic-imagenet-job",
}


def load_docs(path: Path) -> list[dict[str, Any]]:
    """All non-empty YAML documents of a manifest file."""
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def find(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The one object of ``kind`` in ``docs``; fails the test if there is not exactly one."""
    found = [doc for doc in docs if doc.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_template(obj: dict[str, Any]) -> dict[str, Any]:
    """The pod template of a Job, StatefulSet or PyTorchJob (its Worker replicas)."""
    if obj["kind"] == "PyTorchJob":
        return obj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    return obj["spec"]["template"]


def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    """The container called ``name`` in the pod template of ``obj``."""
    for c in pod_template(obj)["spec"]["containers"]:
        if c["name"] == name:
            return c
    raise AssertionError(f"{obj['kind']} {obj['metadata']['name']} has no container {name!r}")


def operator_env(job: dict[str, Any]) -> list[dict[str, str]]:
    """The env entries the training-operator appends to each container of an elastic PyTorchJob."""
    spec = job["spec"]
    assert "Master" not in spec["pytorchReplicaSpecs"], "Master replicas get more operator env; not modelled"
    policy = spec.get("elasticPolicy")
    entries = [{"name": "PYTHONUNBUFFERED", "value": "0"}]
    if policy is None:
        return entries
    host = policy.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    port = policy.get("rdzvPort")
    if port is None:
        ports = container(job, "pytorch").get("ports", [])
        named = [p["containerPort"] for p in ports if p.get("name") == "pytorchjob-port"]
        assert named, "without rdzvPort the operator needs a port named pytorchjob-port, or it errors"
        port = named[0]
    entries.append({"name": "PET_RDZV_ENDPOINT", "value": f"{host}:{port}"})
    entries.append({"name": "PET_RDZV_BACKEND", "value": policy.get("rdzvBackend", "c10d")})
    has_min, has_max = "minReplicas" in policy, "maxReplicas" in policy
    # The operator dereferences both when either is set: one without the other crashes its reconcile loop.
    assert has_min == has_max, "elasticPolicy needs both minReplicas and maxReplicas, or neither"
    if has_min:
        nnodes = f"{policy['minReplicas']}:{policy['maxReplicas']}"
    else:
        nnodes = str(spec["pytorchReplicaSpecs"]["Worker"]["replicas"])
    entries.append({"name": "PET_NNODES", "value": nnodes})
    if "maxRestarts" in policy:
        entries.append({"name": "PET_MAX_RESTARTS", "value": str(policy["maxRestarts"])})
    if "rdzvId" in policy:
        entries.append({"name": "PET_RDZV_ID", "value": policy["rdzvId"]})
    if policy.get("rdzvConf"):
        joined = ",".join(f"{kv['key']}={kv['value']}" for kv in policy["rdzvConf"])
        entries.append({"name": "PET_RDZV_CONF", "value": joined})
    if policy.get("standalone"):
        entries.append({"name": "PET_STANDALONE", "value": ""})
    return entries


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's ``$(NAME)`` expansion: defined names are replaced, ``$$`` is a literal ``$``."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _REF.sub(one, text)


def resolve_env(
    entries: list[dict[str, Any]], pod_fields: Mapping[str, str] = FAKE_POD_FIELDS
) -> dict[str, str]:
    """The environment the container's process gets from an ordered env list (later entries win)."""
    env: dict[str, str] = {}
    for entry in entries:
        if "valueFrom" in entry:
            source = entry["valueFrom"]
            assert set(source) == {"fieldRef"}, f"{entry['name']}: only fieldRef is modelled, got {source}"
            path = source["fieldRef"]["fieldPath"]
            assert path in pod_fields, f"{entry['name']}: no fake value for field {path!r}"
            env[entry["name"]] = pod_fields[path]
        else:
            env[entry["name"]] = expand(str(entry.get("value", "")), env)
    return env


def launch(obj: dict[str, Any], container_name: str) -> tuple[list[str], dict[str, str]]:
    """elastrun's argv (what follows ``elastrun`` in the image's entrypoint) and environment in a pod."""
    c = container(obj, container_name)
    assert "command" not in c, "the container must keep the image's entrypoint (tini -- elastrun)"
    entries = list(c.get("env", []))
    if obj["kind"] == "PyTorchJob":
        entries += operator_env(obj)
    env = resolve_env(entries)
    argv = [expand(str(a), env) for a in c.get("args", [])]
    return argv, env
