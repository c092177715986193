"""``elastrun status`` for the etcd backend: read a job's keys from etcd as a pure client.

The reader never disturbs the job: it takes no lease, registers nothing and writes no key.  It
reads every key under ``/elastrun/<run_id>/`` in one range request (so the picture is one
consistent etcd revision), then asks etcd how long each member's agent lease has left
(``LeaseTimeToLive``, also read-only).  The key layout is the one documented in
:mod:`elastrun.rendezvous.etcd.handler`; the document returned has the fields of the c10d
reader's (:func:`elastrun.rendezvous.c10d.status.read_store_status`, docs/observe.md) plus a few
etcd-only ones:

- ``incarnation`` (top level): the id of the job's live incarnation (``P/epoch``);
- ``revision`` (top level): the etcd revision the keys were read at;
- ``lease_ttl`` and ``lease_ttl_left`` (per node): the agent lease's granted TTL and the whole
  seconds it has left.

A job started with a job token seals its values: the reader needs the same token (``--rdzv-conf
token_file=PATH`` or ``$ELASTRUN_JOB_TOKEN``) and drops every value that does not open.

etcd agents have leases, not heartbeat time stamps, so a node's ``heartbeat_age`` is derived from
its lease: granted TTL minus TTL left, an upper bound (in whole seconds, as etcd counts them) on
the time since the agent last renewed its lease.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import threading
import time
from typing import Any

from elastrun.rendezvous.api import JobNotFoundError, RendezvousConnectionError, RendezvousError, RendezvousParameters
from elastrun.rendezvous.auth import JobToken, load_token
from elastrun.rendezvous.etcd.client import EtcdClient, EtcdSettings, EtcdUnavailable, Shared, prefix_end
from elastrun.rendezvous.etcd.settings import parse_config, parse_endpoints, require_client
from elastrun.rendezvous.rounds import decode_result
from elastrun.rendezvous.status_doc import node_row, status_document

#: What the document shows of a node waiting in the open round (from its NodeInfo).

_clients: dict[tuple, Any] = {}
_clients_lock = threading.Lock()


def _job_not_found(run_id: str, endpoint: str) -> RendezvousError:
    return JobNotFoundError(
        f"no job {run_id!r} at etcd {endpoint} (etcd answers, but holds no keys under /elastrun/{run_id}/: "
        "no agent of that --rdzv-id is running, or the job ended); check --rdzv-id"
    )


def _short_reason(text: str) -> str:
    """The gist of a socket or HTTP error: ``Connection refused`` rather than a urllib3 repr."""
    found = re.findall(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if found:
        return found[-1].strip()
    if "timed out" in text.lower():
        return "timed out"
    return text.strip().splitlines()[0][:160] if text.strip() else "no answer"


def _probe(endpoints: list[tuple[str, int]], timeout: float) -> None:
    """Fail fast, with a short reason per member, when no member accepts a TCP connection."""
    reasons = []
    for host, port in endpoints:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return
        except OSError as exc:
            reasons.append(f"{host}:{port} ({exc.strerror or _short_reason(str(exc))})")
    raise RendezvousConnectionError(
        f"cannot reach etcd at {', '.join(reasons)}; is etcd running there and is --rdzv-endpoint right?"
    )


def _client(params: RendezvousParameters, timeout: float) -> tuple[Any, str]:
    """A cached :class:`EtcdClient` for the job's endpoints and ``--rdzv-conf`` (kept for ``--watch``)."""
    require_client(params)
    endpoints = parse_endpoints(params.endpoint)
    conf = parse_config(params)
    cache_key = (tuple(endpoints), conf["protocol"], conf["ca_cert"], conf["client_cert"], conf["client_key"],
                 conf["username"], conf["password"], timeout)
    text = ",".join(f"{h}:{p}" for h, p in endpoints)
    with _clients_lock:
        client = _clients.get(cache_key)
    if client is not None:
        return client, text
    _probe(endpoints, min(timeout, 1.0))
    settings = EtcdSettings(
        endpoints=endpoints, protocol=conf["protocol"], ca_cert=conf["ca_cert"], client_cert=conf["client_cert"],
        client_key=conf["client_key"], username=conf["username"], password=conf["password"],
        request_timeout=timeout,
    )
    client = EtcdClient(settings, Shared())
    with _clients_lock:
        _clients[cache_key] = client
    return client, text


def _lease_ttl(client: Any, lease: int) -> tuple[int, int]:
    """(TTL left, granted TTL) of ``lease`` in whole seconds; TTL left is -1 once it expired."""
    reply = client.request("/kv/lease/timetolive", {"ID": lease})
    left = int(reply.get("TTL", 0))  # etcd omits a zero TTL
    return left, int(reply.get("grantedTTL", 0))


def read_etcd_status(client: Any, run_id: str, endpoint: str = "", backend: str = "etcd",
                     lease_budget: float = 3.0, token: JobToken | None = None) -> dict[str, Any]:
    """A JSON-able snapshot of job ``run_id`` through ``client`` (an :class:`EtcdClient`).

    Raises :class:`~elastrun.rendezvous.api.JobNotFoundError` when etcd holds no such job.
    ``lease_budget`` bounds the seconds spent asking for members' lease TTLs (a huge job's
    remaining members then show ``heartbeat_age`` null).  ``token`` is this reader's job token
    (None: none); :class:`~elastrun.rendezvous.auth.JobTokenRejected` when it does not match the job's.
    """
    p = f"/elastrun/{run_id}/"
    kvs, _ = client.range(p, prefix_end(p))
    revision = client.revision
    now = time.time()
    keys = {kv.key[len(p):]: kv for kv in kvs}
    epoch = keys.get("epoch")
    if epoch is None:
        raise _job_not_found(run_id, endpoint)
    epoch_doc = json.loads(epoch.value)
    incarnation = str(epoch_doc["id"])
    auth = (token or JobToken(None, run_id)).accept(epoch_doc.get("auth", "none"), endpoint)
    q = f"e/{incarnation}/"
    job = {}
    for k, kv in keys.items():
        if k.startswith(q):
            value = auth.open(kv.key, kv.value)  # a forged value is left out
            if value is not None:
                job[k[len(q):]] = dataclasses.replace(kv, value=value.encode())
    current = job.get("current")
    if current is not None and current.value:
        open_round = int(current.value)
    else:  # missing or forged: the round after the newest authentic result
        closed_rounds = [int(k[1:-len("/result")]) for k in job if re.fullmatch(r"r\d+/result", k)]
        open_round = max(closed_rounds, default=-1) + 1
    finished = "finished" in job
    closed = _latest_result(job, open_round)
    nodes = [] if closed is None else _members(client, job, closed[0], closed[1]["members"], finished,
                                               time.monotonic() + lease_budget)
    join_prefix = f"r{open_round}/join/"
    joiners = sorted((kv for k, kv in job.items() if k.startswith(join_prefix)), key=lambda kv: kv.create_revision)
    doc = status_document(
        run_id=run_id, backend=backend, endpoint=endpoint, read_at=now, open_round=open_round,
        agents=sum(1 for k in keys if k.startswith("agents/")), restarts_used=0, finished=finished,
        aborted=job["abort"].value.decode() if "abort" in job else None, closed=closed, nodes=nodes,
        waiting=[json.loads(kv.value) for kv in joiners],
    )
    doc.update(incarnation=incarnation, revision=revision)
    return doc


def _latest_result(job: dict[str, Any], open_round: int) -> tuple[int, dict[str, Any]] | None:
    """The newest closed round before ``open_round`` whose result is not an abort."""
    rounds = sorted(
        (int(k[1:-len("/result")]) for k in job if re.fullmatch(r"r\d+/result", k)), reverse=True
    )
    for round_ in rounds:
        if round_ >= open_round:
            continue
        result = decode_result(job[f"r{round_}/result"].value)
        if not result.get("abort"):
            return round_, result
    return None


def _members(client: Any, job: dict[str, Any], round_: int, members: list[dict], finished: bool,
             lease_deadline: float) -> list[dict]:
    nodes = []
    ttls: dict[int, tuple[int, int] | None] = {}
    for m in sorted(members, key=lambda m: m["group_rank"]):
        node_id = m["node_id"]
        join = job.get(f"r{round_}/join/{node_id}")
        ttl = None
        if join is not None and join.lease and not finished:
            if join.lease not in ttls and time.monotonic() < lease_deadline:
                ttls[join.lease] = _lease_ttl(client, join.lease)
            ttl = ttls.get(join.lease)
        if f"r{round_}/left/{node_id}" in job:
            state = "left"
        elif finished or f"r{round_}/done/{node_id}" in job:
            state = "finished"
        elif join is None or ttl is not None and ttl[0] < 0:
            state = "lost"  # its lease expired (or was revoked): the other agents count it as lost
        elif ttl is None:
            state = "alive"  # the key is there, so its lease is live; its TTL was not asked for
        else:
            # etcd truncates the TTL left to whole seconds, and a renewal comes every third of the
            # TTL (the default): a healthy lease of 3 s shows 2 or 1 left.  Silent is less than a
            # third left, i.e. two renewals missed.
            state = "silent" if ttl[0] * 3 < ttl[1] else "alive"
        live_ttl = ttl is not None and ttl[0] >= 0
        nodes.append(node_row(m, state, float(ttl[1] - ttl[0]) if live_ttl else None,
                              lease_ttl=ttl[1] if live_ttl else None, lease_ttl_left=ttl[0] if live_ttl else None))
    return nodes


def read_job_status(params: RendezvousParameters, timeout: float = 3.0) -> dict[str, Any]:
    """Status reader of the ``etcd`` backend (``elastrun status --rdzv-backend etcd``).

    ``params.endpoint`` lists the etcd members (``H:P[,H:P...]``); ``params.config`` takes the
    launch's ``--rdzv-conf`` (TLS files, user and password).  Raises
    :class:`RendezvousConnectionError` when no member answers (naming each), and
    :class:`~elastrun.rendezvous.api.JobNotFoundError` when etcd holds no such job.
    """
    token = JobToken(load_token(params.config.get("token_file")), params.run_id)
    client, text = _client(params, timeout)
    try:
        return read_etcd_status(client, params.run_id, text, params.backend, lease_budget=timeout, token=token)
    except EtcdUnavailable as exc:
        raise RendezvousConnectionError(
            f"cannot read etcd at {text}: {_short_reason(str(exc))}; is etcd running there and does it "
            "have a quorum?"
        ) from None
