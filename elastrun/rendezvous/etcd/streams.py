"""The long-lived streams an agent holds to etcd: its watches and its lease keep-alives, each on one
WebSocket to the JSON gateway.

etcd's gateway serves its streaming calls (``/v3/watch``, ``/v3/lease/keepalive``) over WebSocket
as well as over one HTTP request per stream: each text message sent is one request of the gRPC
stream behind it, each message received one response.  So an agent holds:

- **one watch stream** (:class:`WatchSet`) for every key range it watches: a range is added with a
  ``create_request`` naming its ``watch_id`` and dropped with a ``cancel_request``, on the same
  connection (with one HTTP request per range, an agent held two streams, and a round's closer
  four, each reconnected every 10 s while idle);
- **one keep-alive stream** (:class:`~elastrun.rendezvous.etcd.lease_keeper.KeepAliveStream`, in
  :mod:`.keepalive` with the cadence that drives it): a renewal is one message, where it was one
  HTTP request (and a new gRPC stream inside the member) per renewal.

A stream reconnects to the member the agent's other requests use, and a watch resumes each range
from the revision after the last event it delivered, so nothing is missed.  An idle watch stream
asks for a progress report every ``idle`` / 2 s: a member that does not answer within ``idle`` is
given up and the stream reconnects, the next member first when this one keeps failing.  Where a
WebSocket cannot be opened (an HTTP proxy in the way, say), keep-alives go as HTTP requests
(:meth:`EtcdClient.keepalive`) and watches keep retrying, with back-off.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from elastrun.rendezvous.etcd.backoff import Backoff
from elastrun.rendezvous.etcd.client import EtcdClient, EtcdUnavailable, b64, unb64


def open_stream(client: EtcdClient, index: int, path: str, timeout: float):
    """A WebSocket to ``/v3/<path>`` on member ``index`` (TLS and user as the client's); raises
    :class:`EtcdUnavailable` when it cannot be opened."""
    import websocket

    settings = client.settings
    host, port = settings.endpoints[index]
    scheme = "wss" if settings.protocol == "https" else "ws"
    header = []
    token = client.auth_header(index)
    if token:
        header.append(f"Authorization: {token}")
    sslopt: dict[str, Any] = {}
    if scheme == "wss":
        import ssl

        sslopt = {"cert_reqs": ssl.CERT_REQUIRED}
        if settings.ca_cert:
            sslopt["ca_certs"] = settings.ca_cert
        if settings.client_cert:
            sslopt.update(certfile=settings.client_cert, keyfile=settings.client_key)
    try:
        return websocket.create_connection(f"{scheme}://{host}:{port}/v3/{path}", timeout=timeout, header=header,
                                           sslopt=sslopt, http_no_proxy=[host], enable_multithread=True)
    except Exception as exc:  # refused, reset, TLS, a gateway without WebSocket: the caller falls back or retries
        raise EtcdUnavailable(f"{host}:{port}: stream {path} could not be opened: {exc}") from None


def recv_json(ws) -> dict[str, Any]:
    text = ws.recv()
    if not text:
        raise EtcdUnavailable("stream closed by etcd")
    doc = json.loads(text)
    if "error" in doc:
        raise EtcdUnavailable(str(doc["error"])[:200])
    return doc.get("result") or {}


# ---------------------------------------------------------------------- watch
@dataclass
class Event:
    seq: int
    kind: str  # "PUT" or "DELETE"
    key: str
    value: bytes


@dataclass
class _Range:
    key: str
    end: str
    #: The revision the next (re)creation of this range starts from: one after the last event delivered.
    next_revision: int
    watch_id: int
    #: The connection (its number) this range was last created on; 0: none yet.
    created_on: int = 0


class WatchSet:
    """The events of a few watched key ranges, merged into one buffer that waiters read with a cursor.

    Every range is watched on one stream (:class:`_WatchStream`).  An agent watches only the ranges
    it must act on (see docs/etcd.md, "What each agent watches"), so the events of a round grow with
    the number of nodes, not with its square.  Ranges are named; :meth:`watch` replaces a name's
    range, :meth:`unwatch` drops it.
    """

    def __init__(self, client_factory, capacity: int = 100_000) -> None:
        self.seq = 0
        self._events: deque[Event] = deque(maxlen=capacity)
        self._cond = threading.Condition()
        self._lock = threading.Lock()
        self._ranges: dict[str, _Range] = {}
        self._ids = iter(range(1, 1 << 62))
        #: Set when events may have been missed (compaction, buffer overflow): waiters must re-read state.
        self.gap = False
        self._stream = _WatchStream(client_factory(), self)
        self._started = False

    @property
    def connected(self) -> bool:
        return self._stream.connected

    def watch(self, name: str, key: str, end: str, start_revision: int) -> None:
        """Watch ``[key, end)`` from ``start_revision`` on, under ``name`` (replacing what it watched)."""
        with self._lock:
            old = self._ranges.get(name)
            if old is not None and (old.key, old.end) == (key, end):
                return
            new = _Range(key, end, start_revision, next(self._ids))
            self._ranges[name] = new
            if not self._started:
                self._started = True
                self._stream.start()
        if old is not None:
            self._stream.cancel(old)
        self._stream.create(new)

    def unwatch(self, name: str) -> None:
        with self._lock:
            old = self._ranges.pop(name, None)
        if old is not None:
            self._stream.cancel(old)

    def clear(self) -> None:
        """Stop watching every range (the stream stays open); waiters keep their cursors."""
        with self._lock:
            old, self._ranges = list(self._ranges.values()), {}
        for r in old:
            self._stream.cancel(r)

    def ranges(self) -> dict[str, tuple[str, str]]:
        """What is watched now: name -> (key, range end)."""
        with self._lock:
            return {name: (r.key, r.end) for name, r in self._ranges.items()}

    def active(self) -> list[_Range]:
        with self._lock:
            return list(self._ranges.values())

    def range_of(self, watch_id: int) -> _Range | None:
        with self._lock:
            return next((r for r in self._ranges.values() if r.watch_id == watch_id), None)

    def since(self, seq: int) -> list[Event] | None:
        """Events after cursor ``seq``; None when some were dropped (re-read the state instead)."""
        with self._cond:
            if self._events and self._events[0].seq > seq + 1 or self.gap and seq < self.seq:
                return None
            return [e for e in self._events if e.seq > seq]

    def wait(self, seq: int, timeout: float) -> None:
        """Block until an event after cursor ``seq`` arrives or ``timeout`` passes."""
        with self._cond:
            if self.seq <= seq and timeout > 0:
                self._cond.wait(timeout)

    def reconnect(self) -> None:
        """Open the stream again (to the member the other requests now use)."""
        self._stream.close_stream()

    def stop(self) -> None:
        with self._lock:
            self._ranges = {}
        self._stream.stop()
        with self._cond:
            self._cond.notify_all()

    def _lost_history(self) -> None:
        with self._cond:
            self.gap = True
            self.seq += 1
            self._cond.notify_all()

    def _add(self, items: list[tuple[str, str, bytes]]) -> None:
        with self._cond:
            for kind, key, value in items:
                self.seq += 1
                if len(self._events) == self._events.maxlen:
                    self.gap = True
                self._events.append(Event(self.seq, kind, key, value))
            self._cond.notify_all()


class _WatchStream(threading.Thread):
    """The one WebSocket of a :class:`WatchSet`: (re)creates every range on connecting, routes each
    response to its range by ``watch_id``, and reconnects when the stream breaks or stays silent."""

    def __init__(self, client: EtcdClient, sink: WatchSet, idle: float = 10.0) -> None:
        super().__init__(daemon=True, name="elastrun-etcd-watch")
        self.client = client
        self.idle = idle
        self.connected = False
        self._sink = sink
        self._stop_event = threading.Event()
        self._ws = None
        self._conn = 0
        self._send_lock = threading.Lock()

    def create(self, r: _Range, again: bool = False) -> None:
        """Create range ``r`` on the open stream, once per connection (``again``: after a compaction)."""
        with self._send_lock:
            if self._ws is None or r.created_on == self._conn and not again:
                return  # no stream: the next connection creates every active range
            r.created_on = self._conn
            self._send_locked({"create_request": {"key": b64(r.key), "range_end": b64(r.end),
                                                  "start_revision": str(r.next_revision),
                                                  "watch_id": str(r.watch_id)}})

    def cancel(self, r: _Range) -> None:
        with self._send_lock:
            if self._ws is not None and r.created_on == self._conn:
                self._send_locked({"cancel_request": {"watch_id": str(r.watch_id)}})

    def _send(self, doc: dict[str, Any]) -> None:
        with self._send_lock:
            self._send_locked(doc)

    def _send_locked(self, doc: dict[str, Any]) -> None:
        ws = self._ws
        if ws is None:
            return
        try:
            ws.send(json.dumps(doc))
        except Exception:
            self.close_stream()

    def stop(self) -> None:
        self._stop_event.set()
        self.close_stream()

    def close_stream(self) -> None:
        ws = self._ws
        if ws is not None:
            try:
                ws.abort()  # wakes the reader blocked in recv
            except Exception:
                pass

    def run(self) -> None:
        backoff = Backoff(0.05, 1.0)
        failures = 0
        while not self._stop_event.is_set():
            with self.client.shared.lock:
                index = self.client.shared.preferred
            try:
                self._serve(index)
                backoff.reset()
                failures = 0
            except Exception:
                self.connected = False
                if self._stop_event.is_set():
                    break
                failures += 1
                with self.client.shared.lock:  # try the next member if this one keeps failing
                    if self.client.shared.preferred == index and failures >= 3:
                        self.client.shared.preferred = (index + 1) % len(self.client.settings.endpoints)
                self._stop_event.wait(backoff.delay() * (1 + random.random()))

    def _serve(self, index: int) -> None:
        ws = open_stream(self.client, index, "watch", self.client.shared.read_timeout(
            self.client.settings.request_timeout))
        with self._send_lock:
            self._ws = ws
            self._conn += 1
        try:
            for r in self._sink.active():
                self.create(r)
            asked: float | None = None  # when a progress report was asked for and not yet answered
            while not self._stop_event.is_set():
                ws.settimeout(self.idle / 2)
                try:
                    result = recv_json(ws)
                except Exception as exc:
                    if type(exc).__name__ != "WebSocketTimeoutException" or self._stop_event.is_set():
                        raise
                    if asked is not None:
                        raise EtcdUnavailable("watch stream silent") from None
                    asked = time.monotonic()
                    self._send({"progress_request": {}})
                    continue
                asked = None
                self._handle(result)
        finally:
            self.connected = False
            with self._send_lock:
                self._ws = None
            try:
                ws.abort()
            except Exception:
                pass

    def _handle(self, result: dict[str, Any]) -> None:
        if result.get("created"):
            self.connected = True
        r = self._sink.range_of(int(result.get("watch_id", -1) or 0))
        compacted = int(result.get("compact_revision", 0) or 0)
        if compacted and r is not None:
            r.next_revision = compacted
            self._sink._lost_history()
            self.create(r, again=True)
            return
        if result.get("canceled") and r is not None:
            raise EtcdUnavailable(f"watch canceled by etcd: {result.get('cancel_reason', '')}")
        events = result.get("events") or []
        if not events or r is None or self._stop_event.is_set():
            return
        items = []
        for item in events:
            kv = item.get("kv") or {}
            items.append((item.get("type", "PUT"), unb64(kv.get("key", "")).decode(), unb64(kv.get("value", ""))))
            r.next_revision = max(r.next_revision, int(kv.get("mod_revision", 0)) + 1)
        self._sink._add(items)
