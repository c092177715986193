"""Read a c10d (or static) job's state from its TCPStore, as a pure client that changes nothing.

``elastrun status`` must never disturb the job it looks at: it does not host the store, does
not join a round and does not write a key.  It only uses the store's read operations
(``check``, ``get``, ``multi_get`` on keys known to exist, so no read ever blocks waiting for a
key), on the keys the c10d and static backends write under ``/elastrun/<run_id>/`` (see
elastrun/rendezvous/c10d/handler.py, closing.py and docs/rendezvous-protocol.md).  A job started with a job token
keeps its keys under a secret namespace and seals its values: the reader needs the same token
(``--rdzv-conf token_file=PATH`` or ``$ELASTRUN_JOB_TOKEN``) and shows only authentic values.

:func:`read_store_status` works on any store object with those methods (a handler's own store
as well as a fresh client); :func:`read_job_status` is what the c10d and static backends'
``read_status`` call.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from typing import Any

from elastrun.rendezvous.api import JobNotFoundError, RendezvousConnectionError, RendezvousError, RendezvousParameters
from elastrun.rendezvous.auth import JobAuth, JobToken, NoAuth, load_token
from elastrun.rendezvous.c10d.seats import all_members
from elastrun.rendezvous.endpoint import split_endpoint
from elastrun.rendezvous.rounds import decode_result, is_void
from elastrun.rendezvous.status_doc import node_row, status_document
from elastrun.shared.imports import import_quickly

#: A member whose heartbeat is older than this is shown as ``silent`` (the default heartbeat
#: interval is 0.5 s; agents declare a node lost after ``heartbeat_timeout``, 2.5 s by default).
SILENT_AFTER = 5.0
#: How many closed rounds back the reader looks for the latest round with a published result.
ROUNDS_BACK = 32
#: How many rounds the reader walks from round 0 when ``current`` cannot be trusted.
MAX_ROUNDS_WALKED = 10_000

DEFAULT_PORTS = {"c10d": 29400, "static": 29500}

_clients: dict[tuple[str, int], Any] = {}
_clients_lock = threading.Lock()


class _Reader:
    """Read-only views of the job's keys (the key layout mirrors the c10d handler's)."""

    def __init__(self, store: Any, auth: JobAuth | NoAuth) -> None:
        self.store = store
        self.auth = auth
        self.prefix = auth.prefix

    def key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def exists(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def raw(self, key: str) -> bytes | None:
        if not self.exists(key):
            return None
        try:
            return self.store.get(key)
        except Exception:  # deleted between check and get (a heartbeat key at agent exit)
            return None

    def text(self, key: str) -> str | None:
        """The authentic value under ``key`` (None: absent or not authentic)."""
        return self.auth.open(key, self.raw(key))

    def number(self, key: str) -> int:
        """A counter (written with ``add``, so it carries no MAC)."""
        raw = self.raw(key)
        return int(raw) if raw not in (None, b"") else 0

    def texts(self, keys: list[str]) -> list[str | None]:
        present = [k for k in keys if self.exists(k)]
        values = dict(zip(present, self.store.multi_get(present), strict=True)) if present else {}
        return [self.auth.open(k, values.get(k)) for k in keys]


def read_store_status(store: Any, run_id: str, endpoint: str = "", backend: str = "c10d",
                      auth: JobAuth | NoAuth | None = None) -> dict[str, Any]:
    """A JSON-able snapshot of job ``run_id`` from ``store``; :class:`JobNotFoundError` if it has none.

    ``auth`` is the job's sealer (None: a job without a token).  The document's fields are listed
    in docs/observe.md (``elastrun status --json``).
    """
    r = _Reader(store, auth or NoAuth(run_id))
    if not (r.exists(r.key("current")) or r.exists(r.key("agents"))):
        raise JobNotFoundError(
            f"no job {run_id!r} at {endpoint or 'the store'} (the store answers, but no agent of that "
            "--rdzv-id has joined it); check --rdzv-id"
        )
    now = time.time()
    open_round = _open_round(r)
    finished = r.text(r.key("finished")) is not None
    closed = _latest_result(r, open_round)
    nodes = [] if closed is None else _members(r, closed[0], closed[1]["members"], now, finished)
    joined = r.number(r.key(f"r{open_round}", "joined"))
    infos = r.texts([r.key(f"r{open_round}", "node", i) for i in range(1, joined + 1)])
    return status_document(
        run_id=run_id, backend=backend, endpoint=endpoint, read_at=now, open_round=open_round,
        agents=r.number(r.key("agents")), restarts_used=r.number(r.key("restarts_used")), finished=finished,
        aborted=r.text(r.key("abort")), closed=closed, nodes=nodes,
        waiting=[json.loads(raw) for raw in infos if raw],
    )


def _open_round(r: _Reader) -> int:
    """``current``; when it is missing or not authentic, the first round without a result."""
    current = r.text(r.key("current"))
    if current is not None:
        return int(current)
    round_ = 0
    while round_ < MAX_ROUNDS_WALKED and r.exists(r.key(f"r{round_}", "result")):
        round_ += 1
    return round_


def _latest_result(r: _Reader, open_round: int) -> tuple[int, dict[str, Any]] | None:
    for round_ in range(open_round - 1, max(-1, open_round - 1 - ROUNDS_BACK), -1):
        raw = r.text(r.key(f"r{round_}", "result"))
        if raw is None:
            continue
        result = decode_result(raw)
        if result.get("abort") or is_void(result):
            continue
        # A seated round's result holds no member list: read it from its parts (seats.py).
        members = all_members(result, lambda count, r_=round_: r.texts([r.key(f"r{r_}", "part", k)
                                                                        for k in range(count)]))
        if members is None:
            continue
        return round_, {**result, "members": members}
    return None


def _members(r: _Reader, round_: int, members: list[dict], now: float, finished: bool) -> list[dict]:
    beats = r.texts([r.key("hb", m["node_id"]) for m in members])
    marks = r.texts([r.key(f"r{round_}", "dead", m["node_id"]) for m in members])
    nodes = []
    for m, beat, mark in sorted(zip(members, beats, marks, strict=True), key=lambda t: t[0]["group_rank"]):
        age = None
        if beat and ":" in beat:
            age = round(max(0.0, now - float(beat.split(":", 1)[1])), 3)
        if mark and mark.startswith("left:"):
            state = "left"
        elif mark and mark.startswith("done:"):
            state = "finished"
        elif mark:
            state = "lost"
        elif finished:
            state = "finished"
        elif age is None:
            state = "gone"
        else:
            state = "alive" if age < SILENT_AFTER else "silent"
        nodes.append(node_row(m, state, age, mark.split(":", 1)[1] if mark and ":" in mark else None))
    return nodes


def _probe(host: str, port: int, timeout: float) -> None:
    """Fail fast (without importing torch) when nothing listens at the endpoint."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise RendezvousConnectionError(
            f"cannot reach the rendezvous store at {host}:{port} ({exc.strerror or exc}); "
            "is the job running and is --rdzv-endpoint right?"
        ) from None


def _client(host: str, port: int, timeout: float) -> Any:
    with _clients_lock:
        store = _clients.get((host, port))
    if store is not None:
        return store
    _probe(host, port, min(timeout, 2.0))
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    dist = import_quickly("torch.distributed")

    try:
        store = dist.TCPStore(
            host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout)
        )
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RendezvousConnectionError(
            f"cannot read the rendezvous store at {host}:{port}: {first}"
        ) from None
    with _clients_lock:
        _clients[(host, port)] = store
    return store


def read_job_status(params: RendezvousParameters, timeout: float = 3.0) -> dict[str, Any]:
    """Status reader of the ``c10d`` and ``static`` backends (``elastrun status``).

    Connects to ``params.endpoint`` as a store client (kept open for ``--watch``), reads, and
    returns :func:`read_store_status`'s document.  Raises :class:`RendezvousConnectionError` when
    the store cannot be reached and :class:`JobNotFoundError` when it holds no such job.
    """
    host, port = split_endpoint(params.endpoint or "127.0.0.1", DEFAULT_PORTS.get(params.backend, 29400))
    token = JobToken(load_token(params.config.get("token_file")), params.run_id)
    store = _client(host, port, timeout)
    try:
        marker_key = token.marker_key()
        if not store.check([marker_key]):
            raise JobNotFoundError(
                f"no job {params.run_id!r} at {host}:{port} (the store answers, but no agent of that "
                "--rdzv-id has joined it); check --rdzv-id"
            )
        auth = token.accept(store.get(marker_key), f"{host}:{port}")
        return read_store_status(store, params.run_id, f"{host}:{port}", params.backend, auth)
    except RendezvousError:
        raise
    except Exception as exc:
        with _clients_lock:
            _clients.pop((host, port), None)
        raise RendezvousConnectionError(f"lost the rendezvous store at {host}:{port} ({exc})") from None
