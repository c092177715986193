"""The ``elastrun status`` document, built the same way from any backend's raw facts.

A backend's status reader gathers what its store holds (the open round, the latest completed
round's result, each member's state, the nodes waiting to join) and hands it here, so that the
fields and the job-state rules of docs/observe.md exist once for every backend.
"""

from __future__ import annotations

from typing import Any

#: The fields of a waiting node's info that the document shows.
WAITING_FIELDS = ("node_id", "hostname", "addr", "nproc", "role", "pid")


def node_row(member: dict[str, Any], state: str, heartbeat_age: float | None, lost_by: str | None = None,
             **extra: Any) -> dict[str, Any]:
    """One member's entry in ``nodes``: its round-result fields, and what the backend found out
    about it (``state`` as docs/observe.md lists them; ``extra``: backend-specific fields)."""
    first = int(member["rank_offset"])
    return {
        "node_id": member["node_id"],
        "hostname": member.get("hostname", ""),
        "addr": member.get("addr", ""),
        "role": member.get("role", "default"),
        "group_rank": member["group_rank"],
        "nproc": member["nproc"],
        "ranks": [first, first + int(member["nproc"]) - 1],
        "state": state,
        "heartbeat_age": heartbeat_age,
        "lost_by": lost_by,
        **extra,
    }


def status_document(
    *,
    run_id: str,
    backend: str,
    endpoint: str,
    read_at: float,
    open_round: int,
    agents: int,
    restarts_used: int,
    finished: bool,
    aborted: str | None,
    closed: tuple[int, dict[str, Any]] | None,
    nodes: list[dict[str, Any]],
    waiting: list[dict[str, Any]],
) -> dict[str, Any]:
    """The status document of one job.

    ``closed`` is (round, result document) of the newest completed round, or None while the
    job forms; ``nodes`` are its members' entries; ``restarts_used`` is the job's own counter where
    the backend keeps one (0 otherwise: the round result's count is used when larger).
    """
    doc: dict[str, Any] = {
        "run_id": run_id,
        "backend": backend,
        "endpoint": endpoint,
        "read_at": round(read_at, 3),
        "state": "forming",
        "round": None,
        "generation": None,
        "closed_at": None,
        "open_round": open_round,
        "agents": agents,
        "world_size": 0,
        "restarts_used": restarts_used,
        "max_restarts": None,
        "restarts_left": None,
        "finished": finished,
        "aborted": aborted,
        "nodes": nodes,
        "waiting": [{k: info.get(k) for k in WAITING_FIELDS} for info in waiting],
    }
    if closed is not None:
        round_, result = closed
        doc.update(round=round_, generation=result.get("generation"), closed_at=result.get("closed_at"),
                   max_restarts=result.get("max_restarts"))
        doc["restarts_used"] = max(restarts_used, int(result.get("restarts_used") or 0))
        doc["world_size"] = sum(int(m.get("nproc", 0)) for m in result["members"])
    if doc["max_restarts"] is not None:
        doc["restarts_left"] = max(0, int(doc["max_restarts"]) - int(doc["restarts_used"]))
    if aborted:
        doc["state"] = "failed"
    elif finished:
        doc["state"] = "finished"
    elif closed is not None and not doc["waiting"] and all(n["state"] == "alive" for n in nodes):
        doc["state"] = "running"
    elif closed is not None:
        doc["state"] = "restarting" if doc["waiting"] else "degraded"
    return doc
