"""The long-lived streams an agent holds to etcd: its watches and its lease keep-alives, each on one
WebSocket to the JSON gateway.

etcd's gateway serves its streaming calls (``/v3/watch``, ``/v3/lease/keepalive``) over WebSocket
as well as over one HTTP request per stream: each text message sent is one request of the gRPC
stream behind it, each message received one response.  So an agent holds:

- **one watch stream** (:class:`WatchSet`) for every key range it watches: a range is added with a
  ``create_request`` naming its ``watch_id`` and dropped with a ``cancel_request``, on the same
  connection (with one HTTP request per range, an agent held two streams, and a round's closer
  four, each reconnected every 10 s while idle);
- **one keep-alive stream** (:class:`KeepAliveStream`): a renewal is one message, where it was one
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


def _recv_json(ws) -> dict[str, Any]:
    text = ws.recv()
    if not text:
        raise EtcdUnavailable("stream closed by etcd")
    doc = json.loads(text)
    if "error" in doc:
        raise EtcdUnavailable(str(doc["error"])[:200])
    return doc.get("result") or {}


# ---------------------------------------------------------------------- keep-alive
class KeepAliveStream:
    """Renews leases over one WebSocket to ``/v3/lease/keepalive`` (used by one thread only)."""

    def __init__(self, client: EtcdClient) -> None:
        self.client = client
        self._ws = None
        self._index = -1
        #: Monotonic time before which no new stream is tried (after one could not be opened).
        self._retry_at = 0.0

    def renew(self, lease: int, timeout: float) -> int:
        """Renew ``lease``: its new TTL, or -1 when it expired.  Over the stream when one can be held,
        else as one HTTP request; raises :class:`EtcdUnavailable` when no member answers in ``timeout``."""
        ws = self._stream(timeout)
        if ws is None:
            return self.client.keepalive(lease, timeout)
        deadline = time.monotonic() + timeout
        try:
            ws.settimeout(timeout)
            ws.send(json.dumps({"ID": str(lease)}))
            while True:
                ws.settimeout(max(0.01, deadline - time.monotonic()))
                result = _recv_json(ws)
                if int(result.get("ID", 0) or 0) == lease:  # a late answer to an earlier renewal is skipped
                    return int(result.get("TTL", -1) or -1)
        except Exception as exc:
            self.close()
            raise EtcdUnavailable(f"keep-alive stream: {exc}") from None

    def _stream(self, timeout: float):
        with self.client.shared.lock:
            index = self.client.shared.preferred
        if self._ws is not None and index == self._index:
            return self._ws
        self.close()  # the other requests moved to another member: follow them
        if time.monotonic() < self._retry_at:
            return None
        try:
            self._ws = open_stream(self.client, index, "lease/keepalive", timeout)
            self._index = index
        except EtcdUnavailable:
            self._retry_at = time.monotonic() + 10.0
            return None
        return self._ws

    def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.close(timeout=0.1)
            except Exception:
                pass


class LeaseKeeper(threading.Thread):
    """Renews this agent's lease (and, less often, the job's) and reports etcd outages once each.

    ``lost`` is set when etcd says the agent lease expired (e.g. after a network partition longer
    than its TTL); the handler then registers again with a new lease.  ``outage_since`` is the
    monotonic time of the first failed renewal of a running outage, None while etcd answers.

    **Deadlines.**  A renewal may take as long as the lease has left (``ttl`` after the last renewal
    that got through), never less than 0.25 s: a later answer could not save it, and giving up
    earlier on a member that is merely slow would only add another renewal to its load.  While
    renewals fail, the next one is tried after a jittered 0.25-1 s (not ``interval``), so the lease
    may still be saved and a job's agents do not retry in step.
    """

    def __init__(self, client: EtcdClient, interval: float, job_interval: float, warn, ttl: float = 0.0) -> None:
        super().__init__(daemon=True, name="elastrun-etcd-keepalive")
        self.client = client
        self.interval = interval
        self.job_interval = job_interval
        self.ttl = ttl or 3 * interval
        self.lease = 0
        self.job_lease = 0
        self.lost = False
        self.job_lost = False
        self.outage_since: float | None = None
        self.last_error = ""
        self._warn = warn
        self._stop_event = threading.Event()
        self._next_job = 0.0
        self._renewed_at = time.monotonic()
        self._stream = KeepAliveStream(client)
        self.on_failover = None

    def set_leases(self, lease: int, job_lease: int) -> None:
        """Renew ``lease`` and ``job_lease`` from now on.

        A job lease new to this keeper is first renewed one ``job_interval`` from now, not at once:
        it was just granted (full TTL), or adopted from a running incarnation whose live agents
        renew it every ``job_interval`` themselves.  Renewing it at once cost every agent of a
        round one keep-alive for nothing.
        """
        if job_lease != self.job_lease:
            self._next_job = time.monotonic() + self.job_interval
        if lease != self.lease:
            self._renewed_at = time.monotonic()  # just granted
        self.lease, self.job_lease, self.lost, self.job_lost = lease, job_lease, False, False

    def run(self) -> None:
        cap = min(1.0, self.interval)
        retry = Backoff(cap / 2, cap)
        while not self._stop_event.is_set():
            preferred = self.client.shared.preferred
            wait = self.interval
            try:
                self._renew()
                if self.outage_since is not None:
                    took = time.monotonic() - self.outage_since
                    self._warn(f"etcd is reachable again after {took:.1f} s; the rendezvous carries on")
                    self.outage_since = None
                retry.reset()
            except EtcdUnavailable as exc:
                self.last_error = str(exc)
                if self.outage_since is None:
                    self.outage_since = time.monotonic()
                    self._warn(
                        f"etcd unreachable ({exc}); running workers keep training, retrying with back-off"
                    )
                wait = retry.delay()
            except Exception as exc:  # credentials revoked, etc.: keep trying, report once
                self.last_error = str(exc)
                if self.outage_since is None:
                    self.outage_since = time.monotonic()
                    self._warn(f"etcd keep-alive failed: {exc}; retrying")
                wait = retry.delay()
            if self.client.shared.preferred != preferred and self.on_failover is not None:
                self.on_failover()
            self._stop_event.wait(wait)
        self._stream.close()

    def _deadline(self) -> float:
        """How long this renewal may take: what the lease has left, at least 0.25 s."""
        return max(0.25, self.ttl - (time.monotonic() - self._renewed_at))

    def _renew(self) -> None:
        lease = self.lease
        if lease and not self.lost:
            ttl = self._stream.renew(lease, self._deadline())
            if ttl <= 0 and lease == self.lease:
                self.lost = True
            elif lease == self.lease:
                self._renewed_at = time.monotonic()
        now = time.monotonic()
        if self.job_lease and now >= self._next_job:
            job_lease = self.job_lease
            if self._stream.renew(job_lease, max(1.0, self._deadline())) <= 0 and job_lease == self.job_lease:
                self.job_lost = True
            self._next_job = now + self.job_interval

    def stop(self) -> None:
        self._stop_event.set()


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
                    result = _recv_json(ws)
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
