"""Talking to an etcd cluster through its v3 JSON gateway (``etcd3gw``): fail-over, TLS, users, watches, leases.

Every thread of the rendezvous (main, keep-alive, watch) owns its own :class:`EtcdClient` (one
HTTP session per member), so no ``requests.Session`` is shared between threads.  The clients of
one handler share a :class:`Shared` hint of which member answered last, so after one thread
fails over the others start with the healthy member too.

Errors are sorted into three kinds, because the rendezvous reacts to them differently:

- :class:`EtcdUnavailable`: no member answered (down, partitioned, electing a leader).  Transient:
  callers retry with back-off until their own deadline.
- :class:`EtcdAuthError` / :class:`EtcdTLSError`: wrong user, password or certificate.  These
  never heal by waiting, so they surface at once as configuration errors.
- :class:`LeaseNotFound`: a key was written with a lease that expired.
"""

from __future__ import annotations

import base64
import json
import os
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from elastrun.rendezvous.api import RendezvousConfigError, RendezvousError
from elastrun.rendezvous.etcd.backoff import Backoff


class EtcdUnavailable(RendezvousError):
    """No etcd member answered; the message lists each endpoint tried and its error."""


class EtcdAuthError(RendezvousConfigError):
    """etcd refused the user name, password or permissions."""


class EtcdTLSError(RendezvousConfigError):
    """The TLS handshake with etcd failed (certificate, key or CA), or http/https do not match."""


class LeaseNotFound(RendezvousError):
    """etcd does not know the lease a write used (it expired)."""


class EtcdRequestError(RendezvousError):
    """etcd rejected a request for another reason (a bug or an incompatible etcd)."""


def b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: str) -> str:
    """The first key after every key that starts with ``prefix`` (etcd's range end for a prefix)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return raw.decode()


@dataclass
class EtcdSettings:
    """How to reach the cluster: members, protocol, TLS files, credentials and request timeout."""

    endpoints: list[tuple[str, int]]
    protocol: str = "http"
    ca_cert: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    username: str | None = None
    password: str | None = None
    request_timeout: float = 3.0

    def describe(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    @property
    def timeout(self) -> tuple[float, float]:
        """(connect, read) seconds for one HTTP request."""
        return (min(1.0, self.request_timeout), self.request_timeout)


@dataclass
class Shared:
    """State shared by the clients of one handler: the member to try first."""

    preferred: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


def _grpc_message(exc: Exception) -> tuple[str, int]:
    """The etcd error text and gRPC code of a gateway error response."""
    detail = getattr(exc, "detail_text", None) or ""
    try:
        doc = json.loads(detail)
        return str(doc.get("message") or doc.get("error") or detail), int(doc.get("code", -1))
    except (ValueError, TypeError):
        return detail or str(exc), -1


_AUTH_WORDS = ("authentication failed", "user name is empty", "permission denied", "user name not found",
               "invalid user id or password")
_TLS_WORDS = ("ssl", "certificate", "tls", "http request to an https server", "wrong version number")


class EtcdClient:
    """One thread's connection to the cluster: retries a request on each member in turn."""

    def __init__(self, settings: EtcdSettings, shared: Shared) -> None:
        import etcd3gw

        self.settings = settings
        self.shared = shared
        self._clients = [
            etcd3gw.client(
                host=host, port=port, protocol=settings.protocol, ca_cert=settings.ca_cert,
                cert_cert=settings.client_cert, cert_key=settings.client_key,
                timeout=settings.timeout, api_path="/v3/",  # type: ignore[arg-type]
            )
            for host, port in settings.endpoints
        ]
        for c in self._clients:
            _read_environment_once(c.session, c.get_url(""), settings.ca_cert)
        self._authed: set[int] = set()
        self.revision = 0

    # ------------------------------------------------------------------ transport
    def _authenticate(self, index: int) -> None:
        client = self._clients[index]
        client.session.headers.pop("Authorization", None)
        if self.settings.username is None:
            self._authed.add(index)
            return
        body = {"name": self.settings.username, "password": self.settings.password or ""}
        try:
            token = client.post(client.get_url("/auth/authenticate"), json=body)["token"]
        except Exception as exc:
            message, _ = _grpc_message(exc)
            if "authentication is not enabled" in message:
                self._authed.add(index)
                return
            raise
        client.session.headers["Authorization"] = token
        self._authed.add(index)

    def request(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first member that answers; see the module docstring."""
        import etcd3gw.exceptions as ex

        n = len(self._clients)
        with self.shared.lock:
            start = self.shared.preferred
        errors: list[str] = []
        for step in range(n):
            index = (start + step) % n
            client = self._clients[index]
            host, port = self.settings.endpoints[index]
            for attempt in range(2):
                try:
                    if index not in self._authed:
                        self._authenticate(index)
                    reply = client.post(client.get_url(path), json=body)
                except (ex.ConnectionFailedError, ex.ConnectionTimeoutError, ex.InternalServerError) as exc:
                    text = _grpc_message(exc)[0] or repr(exc)
                    if any(word in text.lower() for word in _TLS_WORDS):
                        raise EtcdTLSError(
                            f"TLS with etcd at {host}:{port} failed: {text[:300]}; check --rdzv-conf "
                            "ca_cert, client_cert, client_key and protocol"
                        ) from None
                    if self.settings.protocol == "http" and "closed connection" in text and speaks_tls(host, port):
                        raise EtcdTLSError(
                            f"etcd at {host}:{port} speaks TLS (it closed a plain HTTP request); use --rdzv-conf "
                            "protocol=https with ca_cert (and client_cert, client_key if it requires them)"
                        ) from None
                    errors.append(f"{host}:{port}: {text[:200]}")
                    break
                except ex.Etcd3Exception as exc:
                    message, code = _grpc_message(exc)
                    low = message.lower()
                    if "invalid auth token" in low or "auth token" in low and attempt == 0:
                        self._authed.discard(index)
                        continue
                    if "requested lease not found" in low:
                        raise LeaseNotFound(message) from None
                    if any(word in low for word in _AUTH_WORDS) or code in (7, 16):
                        raise EtcdAuthError(
                            f"etcd at {host}:{port} refused the credentials: {message}; check --rdzv-conf "
                            "username and password (and that the user's role may read and write /elastrun/)"
                        ) from None
                    if any(word in low for word in _TLS_WORDS):
                        raise EtcdTLSError(f"etcd at {host}:{port}: {message}; use protocol=https") from None
                    if code in (4, 14) or "leader" in low or "timed out" in low or "unavailable" in low:
                        errors.append(f"{host}:{port}: {message[:200]}")
                        break
                    raise EtcdRequestError(f"etcd at {host}:{port} rejected {path}: {message}") from None
                with self.shared.lock:
                    self.shared.preferred = index
                header = reply.get("header") or {}
                if "revision" in header:
                    self.revision = max(self.revision, int(header["revision"]))
                return reply
        raise EtcdUnavailable("no etcd member answered: " + "; ".join(errors))

    # ------------------------------------------------------------------ key-value operations
    def range(self, key: str, end: str | None = None, *, count_only: bool = False, keys_only: bool = False,
              by_create: bool = False, limit: int = 0) -> tuple[list[KV], int]:
        """Keys in ``[key, end)`` (or ``key`` alone): (kvs, count).  ``by_create`` sorts oldest first."""
        body = _range_body(key, end, count_only=count_only, keys_only=keys_only, by_create=by_create, limit=limit)
        return self._range_reply(self.request("/kv/range", body))

    def _range_reply(self, reply: dict[str, Any]) -> tuple[list[KV], int]:
        kvs = [self._kv(item) for item in reply.get("kvs", [])]
        return kvs, int(reply.get("count", 0))

    @staticmethod
    def _kv(item: dict[str, Any]) -> KV:
        return KV(
            key=unb64(item["key"]).decode(),
            value=unb64(item.get("value", "")),
            create_revision=int(item.get("create_revision", 0)),
            mod_revision=int(item.get("mod_revision", 0)),
            lease=int(item.get("lease", 0)),
        )

    def get(self, key: str) -> KV | None:
        kvs, _ = self.range(key)
        return kvs[0] if kvs else None

    def count(self, prefix: str) -> int:
        return self.range(prefix, prefix_end(prefix), count_only=True)[1]

    def put(self, key: str, value: str | bytes, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = lease
        self.request("/kv/put", body)

    def delete(self, key: str, end: str | None = None) -> None:
        body = {"key": b64(key)}
        if end is not None:
            body["range_end"] = b64(end)
        self.request("/kv/deleterange", body)

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
            failure: list[dict[str, Any]] | None = None) -> bool:
        reply = self.request("/kv/txn", {"compare": compare, "success": success, "failure": failure or []})
        return bool(reply.get("succeeded", False))

    def txn_reads(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
                  failure: list[dict[str, Any]] | None = None) -> tuple[bool, list[tuple[list[KV], int] | None]]:
        """Like :meth:`txn`, and what each op of the branch taken read: (kvs, count) for an
        :func:`op_range`, None for a write.  Several reads (and writes) cost one request this way."""
        reply = self.request("/kv/txn", {"compare": compare, "success": success, "failure": failure or []})
        reads: list[tuple[list[KV], int] | None] = []
        for response in reply.get("responses") or []:
            ranged = response.get("response_range")
            reads.append(None if ranged is None else self._range_reply(ranged))
        return bool(reply.get("succeeded", False)), reads

    def read_many(self, ops: list[dict[str, Any]]) -> list[tuple[list[KV], int]]:
        """The results of several :func:`op_range` reads, consistent with one another, in one request."""
        _, reads = self.txn_reads([], ops)
        return [r if r is not None else ([], 0) for r in reads]

    # ------------------------------------------------------------------ leases
    def grant(self, ttl: int) -> int:
        return int(self.request("/lease/grant", {"TTL": ttl, "ID": 0})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; its new TTL, or -1 when it already expired."""
        reply = self.request("/lease/keepalive", {"ID": lease})
        return int((reply.get("result") or {}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        try:
            self.request("/kv/lease/revoke", {"ID": lease})
        except LeaseNotFound:
            pass

    def new_session(self, index: int):
        """A fresh HTTP session configured like member ``index``'s (TLS, token) for a long-lived stream."""
        import requests

        source = self._clients[index].session
        session = requests.Session()
        session.verify = source.verify
        session.cert = source.cert
        session.trust_env = source.trust_env
        session.proxies.update(source.proxies)
        session.headers.update(source.headers)
        return session

    def url(self, index: int, path: str) -> str:
        return self._clients[index].get_url(path)


def _read_environment_once(session, url: str, ca_cert: str | None) -> None:
    """Take from the environment, once, what ``requests`` would read from it at every request.

    With ``trust_env`` a session scans all of ``os.environ`` for proxies on each request: a third
    of an agent's CPU per etcd request (profiled at 32 agents).  The proxies for ``url`` (``NO_PROXY``
    honoured) and, without ``ca_cert``, ``REQUESTS_CA_BUNDLE`` / ``CURL_CA_BUNDLE`` are read here
    instead.  With ``ca_cert`` those bundles are ignored on purpose: they would silently replace it
    (requests#3829).
    """
    import requests.utils

    session.proxies.update(requests.utils.get_environ_proxies(url))
    if ca_cert is None and session.verify is True:
        session.verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
    session.trust_env = False


def speaks_tls(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether ``host:port`` answers a TLS handshake: tells a plain-HTTP client's "connection closed"
    from an HTTPS-only etcd apart from a member that is merely restarting."""
    import socket
    import ssl

    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            with context.wrap_socket(sock, server_hostname=host):
                return True
    except ssl.SSLError as exc:
        return "alert" in str(exc).lower()  # a TLS server that refused us (e.g. no client certificate)
    except OSError:
        return False


# ---------------------------------------------------------------------- txn building blocks
def _range_body(key: str, end: str | None = None, *, count_only: bool = False, keys_only: bool = False,
                by_create: bool = False, limit: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key)}
    if end is not None:
        body["range_end"] = b64(end)
    if count_only:
        body["count_only"] = True
    if keys_only:
        body["keys_only"] = True
    if by_create:
        body["sort_order"], body["sort_target"] = 1, 2
    if limit:
        body["limit"] = limit
    return body


def op_range(key: str, end: str | None = None, *, count_only: bool = False, keys_only: bool = False,
             by_create: bool = False, limit: int = 0) -> dict[str, Any]:
    """A read inside a transaction (same arguments as :meth:`EtcdClient.range`)."""
    return {"request_range": _range_body(key, end, count_only=count_only, keys_only=keys_only,
                                         by_create=by_create, limit=limit)}


def cmp_absent(key: str) -> dict[str, Any]:
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def cmp_range_empty(prefix: str) -> dict[str, Any]:
    return {**cmp_absent(prefix), "range_end": b64(prefix_end(prefix))}


def cmp_mod(key: str, revision: int) -> dict[str, Any]:
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}


def cmp_lease(key: str, lease: int) -> dict[str, Any]:
    """``key`` exists and is attached to ``lease``."""
    return {"key": b64(key), "target": "LEASE", "result": "EQUAL", "lease": str(lease)}


def op_put(key: str, value: str | bytes, lease: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        body["lease"] = lease
    return {"request_put": body}


def op_delete(key: str) -> dict[str, Any]:
    return {"request_delete_range": {"key": b64(key)}}


def op_delete_prefix(prefix: str) -> dict[str, Any]:
    return {"request_delete_range": {"key": b64(prefix), "range_end": b64(prefix_end(prefix))}}


# ---------------------------------------------------------------------- watch
@dataclass
class Event:
    seq: int
    kind: str  # "PUT" or "DELETE"
    key: str
    value: bytes


class WatchSet:
    """The events of a few watched key ranges, merged into one buffer that waiters read with a cursor.

    Each range is streamed by its own :class:`_RangeStream` (etcd3gw's ``Watcher`` has no read
    timeout and its thread ends silently on an error, so a partitioned member would leave it
    hanging forever).  An agent watches only the ranges it must act on (see
    docs/etcd.md, "What each agent watches"), so the events of a round grow with the number of
    nodes, not with its square.  Ranges are named; :meth:`watch` replaces a name's range,
    :meth:`unwatch` drops it.
    """

    def __init__(self, client_factory, capacity: int = 100_000) -> None:
        self._client_factory = client_factory
        self.seq = 0
        self._events: deque[Event] = deque(maxlen=capacity)
        self._cond = threading.Condition()
        self._streams: dict[str, _RangeStream] = {}
        self._lock = threading.Lock()
        #: Set when events may have been missed (compaction, buffer overflow): waiters must re-read state.
        self.gap = False

    def watch(self, name: str, key: str, end: str, start_revision: int) -> None:
        """Watch ``[key, end)`` from ``start_revision`` on, under ``name`` (replacing what it watched)."""
        with self._lock:
            old = self._streams.get(name)
            if old is not None and (old.key, old.end) == (key, end):
                return
            stream = _RangeStream(self._client_factory(), key, end, start_revision, self)
            self._streams[name] = stream
        if old is not None:
            old.stop()
        stream.start()

    def unwatch(self, name: str) -> None:
        with self._lock:
            old = self._streams.pop(name, None)
        if old is not None:
            old.stop()

    def ranges(self) -> dict[str, tuple[str, str]]:
        """What is watched now: name -> (key, range end)."""
        with self._lock:
            return {name: (s.key, s.end) for name, s in self._streams.items()}

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
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.close_stream()

    def stop(self) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.stop()
        with self._cond:
            self._cond.notify_all()

    def _lost_history(self, revision: int) -> None:
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


class _RangeStream(threading.Thread):
    """One watch stream of a :class:`WatchSet`: reconnects (to the member the other threads use,
    from the last revision seen, so no event is lost) when it breaks, stays idle past ``idle``
    seconds, or :meth:`close_stream` is called."""

    def __init__(self, client: EtcdClient, key: str, end: str, start_revision: int, sink: WatchSet,
                 idle: float = 10.0) -> None:
        super().__init__(daemon=True, name="elastrun-etcd-watch")
        self.client = client
        self.key, self.end = key, end
        self.next_revision = start_revision
        self.idle = idle
        self.connected = False
        self._sink = sink
        self._stop_event = threading.Event()
        self._response = None

    def stop(self) -> None:
        self._stop_event.set()
        self.close_stream()

    def close_stream(self) -> None:
        response = self._response
        if response is None:
            return
        try:
            import socket

            sock = socket.fromfd(response.raw._fp.fileno(), socket.AF_INET, socket.SOCK_STREAM)
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        except Exception:
            pass

    def run(self) -> None:
        backoff = 0.05
        while not self._stop_event.is_set():
            with self.client.shared.lock:
                index = self.client.shared.preferred
            try:
                self._stream(index)
                backoff = 0.05
            except Exception:
                self.connected = False
                if self._stop_event.is_set():
                    break
                with self.client.shared.lock:  # try the next member if this one keeps failing
                    if self.client.shared.preferred == index and backoff >= 0.4:
                        self.client.shared.preferred = (index + 1) % len(self.client.settings.endpoints)
                self._stop_event.wait(backoff * (1 + random.random()))
                backoff = min(1.0, backoff * 2)

    def _stream(self, index: int) -> None:
        session = self.client.new_session(index)
        body = {"create_request": {"key": b64(self.key), "range_end": b64(self.end),
                                   "start_revision": str(self.next_revision)}}
        settings = self.client.settings
        try:
            response = session.post(self.client.url(index, "/watch"), json=body, stream=True,
                                    timeout=(settings.timeout[0], self.idle))
            self._response = response
            if self._stop_event.is_set():
                return
            if response.status_code != 200:
                raise EtcdUnavailable(f"watch refused: {response.status_code} {response.text[:200]}")
            for line in response.iter_lines(chunk_size=None):
                if self._stop_event.is_set():
                    return
                if not line.strip():
                    continue
                self._handle(json.loads(line))
        finally:
            self.connected = False
            self._response = None
            session.close()

    def _handle(self, doc: dict[str, Any]) -> None:
        if "error" in doc:
            raise EtcdUnavailable(str(doc["error"])[:200])
        result = doc.get("result") or {}
        if result.get("created"):
            self.connected = True
        compacted = int(result.get("compact_revision", 0) or 0)
        if compacted:
            self.next_revision = compacted
            self._sink._lost_history(compacted)
            raise EtcdUnavailable("watch history was compacted")
        if result.get("canceled"):
            raise EtcdUnavailable("watch canceled by etcd")
        events = result.get("events") or []
        if not events or self._stop_event.is_set():
            return
        items = []
        for item in events:
            kv = item.get("kv") or {}
            items.append((item.get("type", "PUT"), unb64(kv.get("key", "")).decode(), unb64(kv.get("value", ""))))
            self.next_revision = max(self.next_revision, int(kv.get("mod_revision", 0)) + 1)
        self._sink._add(items)


# ---------------------------------------------------------------------- lease keep-alive
class LeaseKeeper(threading.Thread):
    """Renews this agent's lease (and, less often, the job's) and reports etcd outages once each.

    ``lost`` is set when etcd says the agent lease expired (e.g. after a network partition longer
    than its TTL); the handler then registers again with a new lease.  ``outage_since`` is the
    monotonic time of the first failed renewal of a running outage, None while etcd answers.
    """

    def __init__(self, client: EtcdClient, interval: float, job_interval: float, warn) -> None:
        super().__init__(daemon=True, name="elastrun-etcd-keepalive")
        self.client = client
        self.interval = interval
        self.job_interval = job_interval
        self.lease = 0
        self.job_lease = 0
        self.lost = False
        self.job_lost = False
        self.outage_since: float | None = None
        self.last_error = ""
        self._warn = warn
        self._stop_event = threading.Event()
        self._next_job = 0.0
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
        self.lease, self.job_lease, self.lost, self.job_lost = lease, job_lease, False, False

    def run(self) -> None:
        # After a failed renewal, try again sooner than ``interval`` (the lease may still be saved),
        # at random moments so that a job's agents do not retry in step; during an outage, about
        # once a second, so that its end is noticed soon.
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

    def _renew(self) -> None:
        lease = self.lease
        if lease and not self.lost and self.client.keepalive(lease) <= 0 and lease == self.lease:
            self.lost = True
        now = time.monotonic()
        if self.job_lease and now >= self._next_job:
            job_lease = self.job_lease
            if self.client.keepalive(job_lease) <= 0 and job_lease == self.job_lease:
                self.job_lost = True
            self._next_job = now + self.job_interval

    def stop(self) -> None:
        self._stop_event.set()
