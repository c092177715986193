"""A large round's result in pieces, so that the bytes a round costs grow with n, not n².

Every member of a closed round needs its own assignment (group rank, the global and role rank of
its first worker), the sizes its workers see (world, group and role world size), the workers'
store, and its ring successor (whose heartbeat and liveness link it watches).  It does not need
the other n − 1 members.  Yet a result document that lists every member, read by every member,
makes a round cost O(n²) bytes: 420 MB at 4,096 nodes with realistic ids.

So a round of more than :data:`FULL_LIST_MAX` members is published as:

- ``r<R>/result``: the *header*, a small document (generation, restarts, abort, lost nodes, the
  workers' store, ``size``, ``world_size``, ``role_sizes``, ``parts``) that every member reads;
- ``r<R>/seat/<node_id>``: one *seat* per member, its own member record and its ring successor's;
- ``r<R>/part/<k>``: the member list in *parts* of :data:`PART_ROWS` members in group-rank order,
  for the few readers that need every member (``elastrun status``, the closer of the next round
  with a job token, the store host before it exits).

A member reads the header and its seat: a constant number of bytes whatever n.  A round of at
most :data:`FULL_LIST_MAX` members keeps every member in its result document (every member then
knows the whole group, and its console line and ``round_closed`` event name them all): what
that costs is bounded by the threshold.

A :class:`Roster` is what one member knows of its round: the whole member list, or its own seat
and whatever seats it read since (its ring walks on past dead successors seat by seat).

Example (a closer, then a member)::

    header, seats, parts = split_result(doc)          # doc from rounds.result_document
    store.multi_set(seat and part keys, values); store.set(result key, encode_result(header))
    ...
    roster = SeatedRoster(header["size"], *read_seat(my seat's text))
    nxt = roster.successor(my_id, fetch)          # a Member, or None; fetch: node id -> its seat's text
"""

from __future__ import annotations

import abc
import json
import zlib
from collections.abc import Callable, Iterable
from typing import Any

from elastrun.rendezvous.api import Member, RoundCause, RoundResult
from elastrun.rendezvous.rounds import member_view

#: Rounds of up to this many members keep every member in the result document.
FULL_LIST_MAX = 64
#: Members per part of a seated round's member list.
PART_ROWS = 512

_FIELDS = ("node_id", "addr", "group_rank", "nproc", "rank_offset", "role", "role_rank_offset", "hostname",
           "link_port")


def is_seated(doc: dict[str, Any]) -> bool:
    """Whether result document ``doc`` is a seated round's header (no member list of its own)."""
    return "members" not in doc and "parts" in doc


def split_result(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """(header, seat text by node id, part texts) of result document ``doc`` (from
    :func:`elastrun.rendezvous.rounds.result_document`), for a round larger than :data:`FULL_LIST_MAX`."""
    members = doc["members"]
    n = len(members)
    header = {k: v for k, v in doc.items() if k != "members"}
    role_sizes: dict[str, int] = {}
    for m in members:
        role_sizes[m["role"]] = role_sizes.get(m["role"], 0) + int(m["nproc"])
    ordered = sorted(members, key=lambda m: m["group_rank"])
    header.update(size=n, world_size=sum(role_sizes.values()), role_sizes=role_sizes,
                  parts=(n + PART_ROWS - 1) // PART_ROWS, rank0=ordered[0]["node_id"])
    seats = {}
    for i, m in enumerate(ordered):
        after = ordered[(i + 1) % n]
        seats[m["node_id"]] = json.dumps([_row(m), _row(after)], separators=(",", ":"))
    parts = [_pack([_row(m) for m in ordered[k:k + PART_ROWS]]) for k in range(0, n, PART_ROWS)]
    return header, seats, parts


def member_result(round_: int, doc: dict[str, Any], me: Member, roster: Roster, store_addr: str,
                  store_port: int) -> RoundResult:
    """Member ``me``'s :class:`RoundResult` of closed round ``round_`` from its result document or
    header ``doc``; ``members`` is what ``roster`` knows (every member, or this one and its successor)."""
    if not is_seated(doc):
        return member_view(round_, doc, roster.known(), me, store_addr, store_port)
    return RoundResult(
        round=round_,
        generation=doc["generation"],
        group_rank=me.group_rank,
        group_world_size=int(doc["size"]),
        rank_offset=me.rank_offset,
        world_size=int(doc["world_size"]),
        role_rank_offset=me.role_rank_offset,
        role_world_size=int(doc["role_sizes"][me.role]),
        store_addr=store_addr,
        store_port=int(store_port),
        members=roster.known(),
        restarts_used=min(int(doc["restarts_used"]), int(doc["max_restarts"])),
        max_restarts=int(doc["max_restarts"]),
        lost_nodes=list(doc.get("lost", [])),
        lost_causes=dict(doc.get("lost_causes", {})),
        cause=RoundCause.from_dict(doc.get("cause")),
    )


def _row(m: dict[str, Any]) -> list[Any]:
    return [m[f] for f in _FIELDS]


def _member(row: list[Any]) -> Member:
    return Member(**dict(zip(_FIELDS, row, strict=True)))


def _pack(rows: list[list[Any]]) -> str:
    import base64

    return base64.b64encode(zlib.compress(json.dumps(rows, separators=(",", ":")).encode(), 6)).decode("ascii")


def read_seat(text: str | bytes) -> tuple[Member, Member]:
    """(the member, its ring successor) from a seat's text; ``ValueError`` for a malformed one."""
    try:
        me, after = json.loads(text)
        return _member(me), _member(after)
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"malformed seat: {exc}") from None


def read_part(text: str | bytes) -> list[dict[str, Any]]:
    """The member dicts of one part's text (as in a full result document's ``members``)."""
    import base64

    inflate = zlib.decompressobj()
    raw = inflate.decompress(base64.b64decode(text, validate=True), 16 << 20)
    if inflate.unconsumed_tail:
        raise ValueError("member list part too large")
    return [dict(zip(_FIELDS, row, strict=True)) for row in json.loads(raw)]


def all_members(doc: dict[str, Any], fetch_parts: Callable[[int], list[str | None]]) -> list[dict[str, Any]] | None:
    """Every member dict of a round's result ``doc``: its own list, or for a seated round the
    parts that ``fetch_parts(count)`` returns (texts in order; None: a part missing, then None)."""
    if not is_seated(doc):
        return list(doc["members"])
    texts = fetch_parts(int(doc["parts"]))
    if any(t is None for t in texts):
        return None
    return [m for t in texts for m in read_part(t)]  # type: ignore[arg-type]


#: Reads the authentic seat text of a node id (None: it has none, so it is not a member).
SeatFetch = Callable[[str], "str | None"]


class Roster(abc.ABC):
    """What one member knows of its round's members.  ``size`` is the round's member count.

    ``fetch`` reads a seat (only a seated roster uses it): each caller passes its own, because the
    heartbeat thread and the agent's thread each read over their own store connection.
    """

    size: int

    @abc.abstractmethod
    def known(self) -> list[Member]:
        """The members this node knows now, in group-rank order (all of them in a full roster)."""

    @abc.abstractmethod
    def successor(self, node_id: str, fetch: SeatFetch) -> Member | None:
        """The member after ``node_id`` in the ring of group ranks (None: not a member, or alone)."""

    @abc.abstractmethod
    def is_member(self, node_id: str, fetch: SeatFetch) -> bool:
        """Whether ``node_id`` is a member of the round."""

    def ring_walk(self, start: str, skip: Callable[[str], bool], fetch: SeatFetch) -> Member | None:
        """The first member after ``start`` in the ring for which ``skip`` is false (None: none).

        At most ``size`` - 1 steps: two dead neighbours are both passed over.
        """
        current = start
        for _ in range(max(0, self.size - 1)):
            after = self.successor(current, fetch)
            if after is None or after.node_id == start:
                return None
            if not skip(after.node_id):
                return after
            current = after.node_id
        return None


class FullRoster(Roster):
    """A round whose member list this node holds whole."""

    def __init__(self, members: Iterable[Member]) -> None:
        self._ordered = sorted(members, key=lambda m: m.group_rank)
        self.size = len(self._ordered)
        self._pos = {m.node_id: i for i, m in enumerate(self._ordered)}

    def known(self) -> list[Member]:
        return list(self._ordered)

    def successor(self, node_id: str, fetch: SeatFetch | None = None) -> Member | None:
        pos = self._pos.get(node_id)
        if pos is None or self.size < 2:
            return None
        return self._ordered[(pos + 1) % self.size]

    def is_member(self, node_id: str, fetch: SeatFetch | None = None) -> bool:
        return node_id in self._pos


class SeatedRoster(Roster):
    """A seated round: this node's own seat, and the seats it read since (each once)."""

    def __init__(self, size: int, me: Member, after: Member) -> None:
        self.size = size
        self.me = me
        self._next: dict[str, Member] = {me.node_id: after}
        self._members: dict[str, Member] = {me.node_id: me, after.node_id: after}
        self._absent: set[str] = set()

    def known(self) -> list[Member]:
        return sorted(list(self._members.values()), key=lambda m: m.group_rank)  # a copy: the beat thread adds

    def successor(self, node_id: str, fetch: SeatFetch) -> Member | None:
        if self.size < 2 or not self.is_member(node_id, fetch):
            return None
        return self._next.get(node_id)

    def is_member(self, node_id: str, fetch: SeatFetch) -> bool:
        if node_id in self._next:
            return True
        if node_id in self._absent:
            return False
        text = fetch(node_id)
        try:
            member, after = read_seat(text) if text is not None else (None, None)
        except ValueError:
            member = after = None
        if member is None or after is None or member.node_id != node_id:
            self._absent.add(node_id)
            return False
        self._next[node_id] = after
        self._members[node_id] = member
        self._members.setdefault(after.node_id, after)
        return True
