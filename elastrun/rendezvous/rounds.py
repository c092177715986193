"""Backend-independent rules of a rendezvous round: when it may close, who gets which rank, and
whether the round that ended is charged to the restart budget.

These are pure functions so that every backend (TCPStore, etcd) applies exactly the same rules
and the rules are unit-testable.  docs/rendezvous-protocol.md explains them.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
import zlib
from dataclasses import dataclass
from typing import Any

from elastrun.rendezvous.api import (
    FailureRecord,
    Member,
    NodeInfo,
    RendezvousTimeoutError,
    RoundCause,
    RoundResult,
)


@dataclass
class CloseInputs:
    """What a closer knows when it decides whether round R may close now."""

    joined: int
    min_nodes: int
    max_nodes: int
    #: Members of the previous completed round (None for a job's first round).
    prev_members: int | None
    #: Previous members that joined this round, were declared dead/left, or finished.
    prev_accounted: int
    #: Seconds since ``joined`` first reached ``min_nodes`` (None: not reached yet).
    since_min: float | None
    last_call: float


def close_size(c: CloseInputs) -> int | None:
    """How many joiners (in arrival order) the round admits if it closes now, or None to keep waiting.

    - ``max_nodes`` joined: close at once with ``max_nodes``.
    - After a completed round: close as soon as ``min_nodes`` joined and every member of that
      round is accounted for (rejoined, declared dead, left, or finished).  Closing earlier would
      split the job in two (a newcomer forming a group beside a running one).
    - A job's first round: ``min_nodes`` joined and the last-call window passed since then.
    """
    if c.joined >= c.max_nodes:
        return c.max_nodes
    if c.joined < c.min_nodes:
        return None
    if c.prev_members is not None:
        return c.joined if c.prev_accounted >= c.prev_members else None
    if c.since_min is not None and c.since_min >= c.last_call:
        return c.joined
    return None


def join_interrupts(open_round: int, joined: int, running: dict[str, Any] | None, max_nodes: int) -> bool:
    """Whether a node that joins the open round now makes a training group stand still.

    ``running`` is the result document of the round before the open one (None: absent, or not
    authentic), ``joined`` how many nodes joined the open round so far.  True only when that round
    formed a group (not void, not the job's end) below ``max_nodes``, whose members would stop their
    workers for the joiner, and nobody joined the open round yet.  A round that is forming (after a
    fault, or for another joiner) closes as soon as the members of the last one are back, so a node
    that means to be in it joins it at once: False.  A job's first round: False.
    """
    if open_round <= 0 or joined > 0 or running is None or is_void(running) or running.get("abort"):
        return False
    size = running.get("size")  # a seated round's header; a full document lists its members
    if size is None:
        size = len(running.get("members") or [])
    return 0 < int(size) < max_nodes


def assign_ranks(nodes: list[NodeInfo]) -> list[Member]:
    """Give each node a group rank and the global rank of its first worker.

    Deterministic for a given list.  A node with ``fixed_rank >= 0`` (static backend) gets that
    rank.  Otherwise a node keeps its previous group rank when that rank is still in range and
    no other node claims it (the earlier joiner wins), and the remaining nodes fill the free
    ranks in arrival order.  Global ranks are contiguous: node by node in group-rank order.
    Role ranks count only the workers of the same role, in the same order.
    """
    n = len(nodes)
    rank_of: dict[int, int] = {}
    taken: set[int] = set()
    for i, node in enumerate(nodes):
        wanted = node.fixed_rank if node.fixed_rank >= 0 else node.prev_group_rank
        if 0 <= wanted < n and wanted not in taken:
            rank_of[i] = wanted
            taken.add(wanted)
    free = iter(r for r in range(n) if r not in taken)
    for i in range(n):
        if i not in rank_of:
            rank_of[i] = next(free)
    ordered = sorted(range(n), key=lambda i: rank_of[i])
    members: list[Member] = []
    offset = 0
    role_offsets: dict[str, int] = {}
    for i in ordered:
        node = nodes[i]
        members.append(
            Member(
                node_id=node.node_id,
                addr=node.addr,
                group_rank=rank_of[i],
                nproc=node.nproc,
                rank_offset=offset,
                role=node.role,
                role_rank_offset=role_offsets.get(node.role, 0),
                hostname=node.hostname,
                link_port=node.link_port,
            )
        )
        offset += node.nproc
        role_offsets[node.role] = role_offsets.get(node.role, 0) + node.nproc
    return members


def member_view(round_: int, doc: dict, members: list[Member], me: Member, store_addr: str,
                store_port: int) -> RoundResult:
    """One member's :class:`RoundResult` of a closed round, from the round's result document."""
    role_members = [m for m in members if m.role == me.role]
    return RoundResult(
        round=round_,
        generation=doc["generation"],
        group_rank=me.group_rank,
        group_world_size=len(members),
        rank_offset=me.rank_offset,
        world_size=sum(m.nproc for m in members),
        role_rank_offset=me.role_rank_offset,
        role_world_size=sum(m.nproc for m in role_members),
        store_addr=store_addr,
        store_port=int(store_port),
        members=members,
        restarts_used=min(int(doc["restarts_used"]), int(doc["max_restarts"])),
        max_restarts=int(doc["max_restarts"]),
        lost_nodes=list(doc.get("lost", [])),
        lost_causes=dict(doc.get("lost_causes", {})),
        cause=RoundCause.from_dict(doc.get("cause")),
    )


#: The fields of a member, in order: a member's dict is built from them directly, because
#: ``dataclasses.asdict`` (recursive, deep-copying) took a third of a 1,024-node close.
_MEMBER_FIELDS = tuple(f.name for f in dataclasses.fields(Member))


def result_document(
    members: list[Member], generation: int, restarts_used: int, max_restarts: int, abort: str | None,
    abort_code: int, lost: list[str], **extra: Any,
) -> dict[str, Any]:
    """The result of a closed round as a dict; :func:`encode_result` turns it into the stored text."""
    return {
        "members": [{name: getattr(m, name) for name in _MEMBER_FIELDS} for m in members], "generation": generation,
        "restarts_used": restarts_used, "max_restarts": max_restarts, "abort": abort, "abort_code": abort_code,
        "lost": lost, "closed_at": time.time(), **extra,
    }  # fmt: skip


def void_result(why: str) -> str:
    """The stored text of a round that closed but never formed (its closer went silent before its
    result): whoever writes ``result`` first decides the round for everyone (compare-and-set), so a
    closer and its followers never disagree on whether it formed."""
    return json.dumps({"void": why, "members": []}, separators=(",", ":"))


def is_void(doc: dict[str, Any]) -> bool:
    """Whether a decoded result is :func:`void_result`'s: the round has no members, nobody runs in it."""
    return bool(doc.get("void"))


#: Marks an encoded result document (see :func:`encode_result`); plain JSON starts with ``{``.
RESULT_CODEC = "z1:"
#: Longest decoded result accepted (a forged value must not make a reader inflate gigabytes).
_MAX_RESULT_BYTES = 64 << 20


def encode_result(doc: dict[str, Any]) -> str:
    """The stored text of a result document: its members as rows, compressed.

    Every member reads the whole document, so its size is paid n times per round.  A member is
    stored as the row ``[node_id, addr, nproc, role index, hostname, link_port]`` in group-rank
    order: the group rank is the row's position, and the global and role rank offsets follow from
    the rows before it (:func:`assign_ranks` makes them so).  The JSON is zlib-compressed and
    base64-encoded behind ``z1:`` (values are text).  A member list that does not follow those
    rules is stored as plain JSON instead; :func:`decode_result` reads both.
    """
    members = doc.get("members")
    if members is None:  # a seated round's header (:mod:`elastrun.rendezvous.c10d.seats`): small, no member rows
        return json.dumps(doc, separators=(",", ":"))
    if not _derivable(members):
        return json.dumps(doc)
    roles = list(dict.fromkeys(m["role"] for m in members))
    index = {role: i for i, role in enumerate(roles)}
    body = {k: v for k, v in doc.items() if k != "members"}
    body["roles"] = roles
    body["rows"] = [[m["node_id"], m["addr"], m["nproc"], index[m["role"]], m["hostname"], m["link_port"]]
                    for m in members]
    packed = zlib.compress(json.dumps(body, separators=(",", ":")).encode(), 6)
    return RESULT_CODEC + base64.b64encode(packed).decode("ascii")


def _derivable(members: list[dict[str, Any]]) -> bool:
    """Whether each member's ranks are what its row position gives (see :func:`encode_result`)."""
    offset = 0
    role_offsets: dict[str, int] = {}
    for rank, m in enumerate(members):
        role = m["role"]
        if (m["group_rank"], m["rank_offset"], m["role_rank_offset"]) != (rank, offset, role_offsets.get(role, 0)):
            return False
        offset += m["nproc"]
        role_offsets[role] = role_offsets.get(role, 0) + m["nproc"]
    return True


def decode_result(text: str | bytes) -> dict[str, Any]:
    """The result document stored as ``text`` (either form :func:`encode_result` writes).

    Raises ``ValueError`` for a value that is neither.
    """
    if isinstance(text, bytes):
        text = text.decode()
    if not text.startswith(RESULT_CODEC):
        return json.loads(text)
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(base64.b64decode(text[len(RESULT_CODEC):], validate=True), _MAX_RESULT_BYTES)
    except (zlib.error, ValueError) as exc:
        raise ValueError(f"result document cannot be decoded: {exc}") from None
    if inflate.unconsumed_tail:
        raise ValueError(f"result document larger than {_MAX_RESULT_BYTES} bytes")
    body = json.loads(raw)
    roles = body.pop("roles")
    members = []
    offset = 0
    role_offsets: dict[str, int] = {}
    for rank, (node_id, addr, nproc, role_index, hostname, link_port) in enumerate(body.pop("rows")):
        role = roles[role_index]
        members.append({
            "node_id": node_id, "addr": addr, "group_rank": rank, "nproc": nproc, "rank_offset": offset,
            "role": role, "role_rank_offset": role_offsets.get(role, 0), "hostname": hostname,
            "link_port": link_port,
        })  # fmt: skip
        offset += nproc
        role_offsets[role] = role_offsets.get(role, 0) + nproc
    body["members"] = members
    return body


def timeout_error(
    run_id: str, join_timeout: float, round_: int, min_nodes: int, max_nodes: int, joined: int
) -> RendezvousTimeoutError:
    """The error of a round that did not close within ``join_timeout``: what it waited for, and who came."""
    return RendezvousTimeoutError(
        f"rendezvous of job {run_id!r} did not complete within {join_timeout:g} s (join_timeout): "
        f"round {round_} waited for at least {min_nodes} node(s) (at most {max_nodes}) and "
        f"{joined} joined; start the other agents or lower --nnodes"
    )


def is_charged(failures: int, nodes_gone: int) -> bool:
    """Whether the end of a round spends one restart of the job's budget.

    A round that ended with worker failures and no lost or departed node is charged once, however
    many ranks failed.  A round in which a node was lost or left is a membership change: the
    failures of the survivors' workers are its consequence, so nothing is charged.  The caller
    leaves out failures recorded after a member stopped for a joining node (``after_growth``).
    """
    return failures > 0 and nodes_gone == 0


def next_no_progress_streak(streak: int, failures: list[FailureRecord], charged: bool) -> int:
    """Failed attempts in a row that made no progress, after the round that just ended.

    A charged round in which no failed node made progress extends the streak; any progress, or
    a round that was not a failure, resets it.
    """
    if not charged:
        return 0
    return 0 if any(f.progress for f in failures) else streak + 1


def is_crash_loop(streak: int, limit: int) -> bool:
    """Whether ``streak`` failed attempts without progress mean the job should stop (``limit`` 0: never)."""
    return limit > 0 and streak >= limit


@dataclass
class Verdict:
    """What the closer of round R+1 decides about round R's end."""

    restarts_used: int
    no_progress_streak: int
    #: The text every agent prints when the job is ended, or None to carry on.
    abort: str | None = None
    #: Exit code for an abort: 1, or ``EXIT_NO_REQUEUE`` for a crash loop.
    abort_code: int = 1


def judge_round_end(
    run_id: str,
    failures: list[FailureRecord],
    nodes_gone: int,
    restarts_used: int,
    streak: int,
    max_restarts: int,
    crash_loop_limit: int,
) -> Verdict:
    """Charge the budget for the round that ended and decide whether the job goes on.

    ``restarts_used`` and ``streak`` are the job's values before this round.  A crash loop is
    reported before a spent budget: it is the more precise diagnosis (and means: do not requeue).
    """
    from elastrun.config import EXIT_NO_REQUEUE

    charged = is_charged(sum(1 for f in failures if not f.after_growth), nodes_gone)
    used = restarts_used + (1 if charged else 0)
    streak = next_no_progress_streak(streak, failures, charged)
    verdict = Verdict(restarts_used=used, no_progress_streak=streak)
    if is_crash_loop(streak, crash_loop_limit):
        verdict.abort_code = EXIT_NO_REQUEUE
        verdict.abort = (
            f"job {run_id!r} stopped: a crash loop ({streak} failed attempts in a row without progress; "
            f"--crash-loop-limit). Retrying will not help: fix the cause below "
            f"(exit code {EXIT_NO_REQUEUE}: do not requeue)"
        )
    elif used > max_restarts:
        verdict.abort = (
            f"job {run_id!r} failed: its restart budget (--max-restarts={max_restarts}) is spent ({used} failure(s))"
        )
    cause = root_cause(failures)
    if verdict.abort is not None and cause is not None:
        verdict.abort += "\n" + format_failure(cause)
    return verdict


def root_cause(failures: list[FailureRecord]) -> FailureRecord | None:
    """The failure to blame: the earliest one whose error is the worker's own, else the earliest.

    A peer's death closes the connections of the ranks waiting on it: their errors (``peer_error``)
    are its consequences, and the agents may see them first (a worker's death and its peer's error
    found in the same look, or on another node's quicker agent).  Among the rest, consequential
    failures of peers come later.
    """
    if not failures:
        return None
    return min(failures, key=lambda f: (f.peer_error, f.timestamp, f.rank))


def round_cause(failures: list[FailureRecord], lost: list[str]) -> RoundCause | None:
    """The culprit of a round's end that every member of the next round is told (docs/failures.md).

    A failure whose error is the worker's own comes first (its root cause); else a lost node, whose
    closed connections make its peers' errors (its host name is left to the members, who knew it);
    else the earliest failure.
    """
    cause = root_cause(failures)
    if lost and (cause is None or cause.peer_error):
        return RoundCause(lost[0], "", None, "lost")
    if cause is None:
        return None
    if cause.message.startswith("hang detected"):
        what = "hung"
    else:
        what = f"killed by {cause.signal}" if cause.signal else f"exit code {cause.exitcode}"
    return RoundCause(cause.node_id, cause.hostname, cause.rank, what)


def fault_line(failure: FailureRecord) -> str:
    """How another node's fault is named to an agent whose silent worker waits on it
    (:meth:`~elastrun.rendezvous.api.RendezvousHandler.claim_hang`)."""
    what = "hang" if failure.message.startswith("hang detected") else "failure"
    return f"the {what} of rank {failure.rank} on {failure.hostname or failure.node_id}"


def format_failure(failure: FailureRecord, max_lines: int = 40) -> str:
    """Human-readable root cause: rank, node, exit code or signal, time, and the traceback."""
    import datetime

    when = datetime.datetime.fromtimestamp(failure.timestamp).isoformat(sep=" ", timespec="milliseconds")
    how = f"killed by {failure.signal}" if failure.signal else f"exit code {failure.exitcode}"
    head = (
        f"root cause: rank {failure.rank} (local rank {failure.local_rank}) on node "
        f"{failure.hostname or failure.node_id} [{failure.node_id}] failed at {when}: {how}"
    )
    body = failure.message.strip()
    if body:
        lines = body.splitlines()[-max_lines:]
        body = "\n".join("    " + line for line in lines)
        return f"{head}\n{body}"
    return head
