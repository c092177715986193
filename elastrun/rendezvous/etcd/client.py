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
from dataclasses import dataclass, field
from typing import Any

from elastrun.rendezvous.api import RendezvousConfigError, RendezvousError


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


#: A request's read timeout grows at most to this multiple of ``request_timeout`` (see :class:`Shared`).
TIMEOUT_CAP = 4.0


@dataclass
class Shared:
    """State shared by the clients of one handler: the member to try first, and how long etcd takes.

    **Adaptive time-outs.**  One request may wait for its answer ``2 * srtt + 4 * rttvar`` (``srtt``:
    the smoothed round trip of the answered requests, ``rttvar`` its mean deviation, as TCP keeps
    them for its retransmission time-out), at least twice what the last time-out waited until an
    answer comes, and always between
    ``request_timeout`` and :data:`TIMEOUT_CAP` times it (3 to 12 s with the defaults).  An etcd that
    is merely slow (overloaded) thus gets the time it needs, instead of every agent giving up on a
    request that etcd still carries out and sending it again (more load); a member that is gone is
    still left within the cap.
    """

    preferred: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    srtt: float = 0.0
    rttvar: float = 0.0
    boost: float = 0.0

    def answered(self, seconds: float) -> None:
        with self.lock:
            if self.srtt == 0.0:
                self.srtt, self.rttvar = seconds, seconds / 2
            else:
                self.rttvar = 0.75 * self.rttvar + 0.25 * abs(seconds - self.srtt)
                self.srtt = 0.875 * self.srtt + 0.125 * seconds
            self.boost = 0.0

    def timed_out(self, waited: float) -> None:
        with self.lock:
            self.boost = max(self.boost, waited) * 2

    def read_timeout(self, floor: float) -> float:
        """How long the next request may wait for its answer (``floor``: ``request_timeout``)."""
        with self.lock:
            return min(TIMEOUT_CAP * floor, max(floor, 2 * self.srtt + 4 * self.rttvar, self.boost))


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

    def request(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first member that answers; see the module docstring.

        Each try waits for its answer up to ``timeout``, or by default :meth:`Shared.read_timeout`.
        """
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
                read = timeout if timeout is not None else self.shared.read_timeout(self.settings.request_timeout)
                client.timeout = (self.settings.timeout[0], read)
                sent = time.monotonic()
                try:
                    if index not in self._authed:
                        self._authenticate(index)
                    reply = client.post(client.get_url(path), json=body)
                    self.shared.answered(time.monotonic() - sent)
                except (ex.ConnectionFailedError, ex.ConnectionTimeoutError, ex.InternalServerError) as exc:
                    if isinstance(exc, ex.ConnectionTimeoutError) and timeout is None:
                        self.shared.timed_out(time.monotonic() - sent)
                    errors.append(f"{host}:{port}: {self._unreached(exc, host, port)[:200]}")
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

    def _unreached(self, exc: Exception, host: str, port: int) -> str:
        """The text of a connection error with one member (to try the next); raises
        :class:`EtcdTLSError` where the error is TLS's (a wrong certificate or protocol): no other
        member would answer either, and the user has a setting to fix."""
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
        return text

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
    def grant(self, ttl: int, lease_id: int = 0) -> int:
        """A new lease of ``ttl`` s.  With ``lease_id`` (chosen by the caller: :func:`new_lease_id`) a
        grant sent again after a time-out is not a second lease: etcd answers that the lease exists,
        which means the first request went through, and that lease is the one returned."""
        try:
            return int(self.request("/lease/grant", {"TTL": ttl, "ID": lease_id})["ID"])
        except EtcdRequestError as exc:
            if lease_id and "lease already exists" in str(exc):
                return lease_id
            raise

    def keepalive(self, lease: int, timeout: float | None = None) -> int:
        """Renew ``lease``; its new TTL, or -1 when it already expired."""
        reply = self.request("/lease/keepalive", {"ID": lease}, timeout)
        return int((reply.get("result") or {}).get("TTL", -1))

    def auth_header(self, index: int) -> str | None:
        """The ``Authorization`` value for member ``index`` (authenticating first), for a stream."""
        if index not in self._authed:
            self._authenticate(index)
        return self._clients[index].session.headers.get("Authorization")

    def revoke(self, lease: int) -> None:
        try:
            self.request("/kv/lease/revoke", {"ID": lease})
        except LeaseNotFound:
            pass


def new_lease_id() -> int:
    """A random lease id for :meth:`EtcdClient.grant` (positive, 62 bits: a clash is out of reach)."""
    return random.getrandbits(62) | 1


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
