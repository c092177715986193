"""The c10d and static backends' access to the job's ``TCPStore``: connecting to it (or hosting it),
the job token's check, and the store operations every part of the protocol uses.

:class:`StoreClient` is the base of :class:`~elastrun.rendezvous.c10d.StoreRendezvousHandler`: the
handler owns the state and the protocol (docs/rendezvous-protocol.md), this class how a value is
written (sealed with the job token when there is one), read in one operation without blocking, or
awaited.  It expects the handler's attributes: ``conf``, ``run_id``, ``max_nodes``,
``join_timeout``, ``store_host``, ``store_port``, ``_server``, ``_store``, ``_auth`` and ``_prefix``.

Example (inside the handler)::

    self._put(self._r(round_, "store"), address)      # sealed with the token
    value = self._read(self._k("current"))            # the authentic value, or None
"""

from __future__ import annotations

import datetime
import functools
import time
from typing import Any

from elastrun.rendezvous.api import (
    JobFailedError,
    JobFinishedError,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousTimeoutError,
)
from elastrun.rendezvous.auth import JobAuth, JobToken, NoAuth
from elastrun.rendezvous.endpoint import is_local_host, torch_at_least
from elastrun.rendezvous.waiting import WaitReport, time_left
from elastrun.shared.imports import import_quickly

#: What :meth:`StoreClient._peek` compares with: no value the protocol writes equals it.
_ABSENT = "\x00elastrun:absent\x00"
_ABSENT_BYTES = _ABSENT.encode()
#: Longest single connection attempt to the job's store.  With thousands of agents connecting at
#: once some are accepted only after TCP's SYN retries (1, 3, 7, 15 s): a shorter attempt would
#: give up on a connection about to succeed and start over at the back of the queue.
_CONNECT_WAIT = 30.0


def store_errors(method):
    """Turn errors of the store client into :class:`RendezvousConnectionError` with an explanation."""

    @functools.wraps(method)
    def wrapper(self: StoreClient, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (RendezvousConnectionError, JobFailedError, JobFinishedError, RendezvousTimeoutError):
            raise
        except RendezvousConfigError:
            raise
        except Exception as exc:
            raise self.store_lost_error(exc) from exc

    return wrapper


def all_present(store, keys: list[str], timeout: float) -> bool:
    """Whether every key exists, after waiting up to ``timeout`` s for the last ones (a few
    operations, where checking slot by slot would be one per key)."""
    if store.check(keys):
        return True
    if timeout <= 0:
        return False
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception:
        return False
    # Checked again: ``multi_get`` blocks for ``read_timeout`` on an absent key, and a ``wait`` has
    # been seen to return before all its keys were there.
    return bool(store.check(keys))


class StoreClient(RendezvousHandler):
    """Connecting to (or hosting) a job's ``TCPStore`` and the store operations of its protocol."""

    conf: dict[str, Any]
    _store: Any
    _server: Any
    _auth: JobAuth | NoAuth
    _prefix: str

    def _connect(self, host: str, port: int, is_host: bool | None):
        dist = import_quickly("torch.distributed")

        timeout = datetime.timedelta(seconds=float(self.conf["read_timeout"]))
        must_host = bool(is_host)
        if is_host is None:
            is_host = is_local_host(host)
        if is_host:
            self._allow_connections(2 * self.max_nodes + 256)
            try:
                # torch 2.3's libuv server (experimental there) kills its clients' agents: the classic one.
                self._server = dist.TCPStore(
                    host, port, is_master=True, wait_for_workers=False, use_libuv=torch_at_least(2, 4), timeout=timeout
                )
                self.store_port = self._server.port
                return self._server
            except Exception as exc:  # port taken: another agent on this host may be the host
                if must_host or port == 0:
                    raise RendezvousConnectionError(
                        f"could not start the rendezvous store on {host}:{port}: {exc}; "
                        "is the port in use by another job? choose another port"
                    ) from exc
        deadline = time.monotonic() + self.join_timeout
        last_error: Exception | None = None
        report = self._wait_report()

        def line() -> str | None:
            if time.monotonic() >= deadline:
                return None  # the time-out's own message comes next
            return (f"waiting for the rendezvous store at {host}:{port}: the agent on {host} hosts it (is it started, "
                    f"and is --rdzv-endpoint right?); {time_left(deadline)}")

        while time.monotonic() < deadline:
            try:
                connect_timeout = datetime.timedelta(seconds=max(1.0, min(_CONNECT_WAIT, deadline - time.monotonic())))
                with report.during(line):  # the client retries a refused connection inside, until its time-out
                    store = dist.TCPStore(host, port, is_master=False, timeout=connect_timeout)
                store.set_timeout(timeout)
                return store
            except Exception as exc:
                last_error = exc
                time.sleep(0.2)
        raise RendezvousTimeoutError(
            f"could not reach the rendezvous store at {host}:{port} within {self.join_timeout:g} s "
            f"(join_timeout): is the agent on {host} running and is --rdzv-endpoint right? last error: "
            f"{str(last_error).strip().splitlines()[0] if str(last_error).strip() else type(last_error).__name__}"
        )

    def _second_connection(self):
        """Another client connection to the store, for another thread (a client is not shared between
        threads).  ``Store.clone()`` where torch has it (2.5+); before, a new client."""
        if hasattr(self._store, "clone"):
            return self._store.clone()
        import torch.distributed as dist  # loaded already: this node is connected

        store = dist.TCPStore(self.store_host, self.store_port, is_master=False,
                              timeout=datetime.timedelta(seconds=_CONNECT_WAIT))
        store.set_timeout(datetime.timedelta(seconds=float(self.conf["read_timeout"])))
        return store

    def _allow_connections(self, needed: int) -> None:
        """Let this process hold ``needed`` descriptors: the job's store keeps two connections per node,
        and the usual soft limit (1,024) would refuse the connections of a job past ~500 nodes."""
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft >= needed:
            return
        wanted = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
        except (ValueError, OSError):
            wanted = soft
        if wanted < needed:
            self.warn(f"this agent hosts the rendezvous store of up to {self.max_nodes} nodes (2 connections each), "
                      f"but may open only {wanted} files (RLIMIT_NOFILE); raise the limit (ulimit -n) or nodes past "
                      f"about {max(0, wanted - 256) // 2} cannot connect", kind="open_files", limit=wanted)

    def _wait_report(self) -> WaitReport:
        """A new wait's reporter (:mod:`elastrun.rendezvous.waiting`)."""
        return WaitReport(self.say_waiting, float(self.conf["wait_report_interval"]))

    def _authenticate(self, token: JobToken) -> JobAuth | NoAuth:
        """Publish (store host) or read (others) the job's ``auth`` marker and check this node's token.

        Raises :class:`~elastrun.rendezvous.auth.JobTokenRejected` when the token does not match.
        """
        key = token.marker_key()
        if self._server is not None:
            marker = self._store.compare_set(key, "", token.new_marker())
        else:
            if not self._wait(key, self.join_timeout):
                raise RendezvousTimeoutError(
                    f"the rendezvous store at {self.store_host}:{self.store_port} holds no job {self.run_id!r} "
                    f"after {self.join_timeout:g} s (join_timeout); is --rdzv-id right?"
                )
            marker = self._store.get(key)
        return token.accept(marker, f"{self.store_host}:{self.store_port}")

    def _report_forged(self, key: str, why: str) -> None:
        self.warn(f"ignored a value in the rendezvous store that is not authentic: {key} ({why})",
                  kind="forged_value", key=key, why=why)

    def store_lost_error(self, exc: BaseException) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            f"lost the rendezvous store at {self.store_host}:{self.store_port} ({exc}). The c10d backend keeps "
            f"the job's state in the agent on {self.store_host}; that agent is gone, so this job cannot continue. "
            "Use --rdzv-backend=etcd with an etcd cluster to survive the loss of any node."
        )

    def _k(self, *parts: object) -> str:
        return self._prefix + "/".join(str(p) for p in parts)

    def _r(self, round_: int, *parts: object) -> str:
        return self._k(f"r{round_}", *parts)

    def _count(self, key: str, store=None) -> int:
        return int((store or self._store).add(key, 0))

    def _exists(self, key: str, store=None) -> bool:
        return bool((store or self._store).check([key]))

    def _get(self, key: str, store=None) -> bytes:
        return (store or self._store).get(key)

    def _put(self, key: str, value: str, store=None) -> None:
        """Write ``value`` under ``key``, sealed with the job token when there is one."""
        (store or self._store).set(key, self._auth.seal(key, value))

    def _peek(self, key: str, store=None) -> bytes | None:
        """The raw value under ``key``, or None when it is absent: one store operation, never blocks.

        ``compare_set`` with a sentinel that no value equals answers the current value, or the
        sentinel itself when the key is absent, and writes nothing (``get`` would block on an
        absent key, and ``check`` + ``get`` costs two round trips).
        """
        raw = (store or self._store).compare_set(key, _ABSENT, _ABSENT)
        return None if raw == _ABSENT_BYTES else raw

    def _read(self, key: str, store=None) -> str | None:
        """The authentic value under ``key``, or None when it is absent or not authentic (reported once)."""
        raw = self._peek(key, store)
        return None if raw is None else self._auth.open(key, raw)

    def _claim(self, key: str, value: str, store=None) -> tuple[bool, str | None]:
        """``compare_set`` ``key`` from absent to ``value``: (whether this call won, the authentic value now)."""
        sealed = self._auth.seal(key, value)
        raw = (store or self._store).compare_set(key, "", sealed)
        won = raw == (sealed.encode() if isinstance(sealed, str) else sealed)
        return won, value if won else self._auth.open(key, raw)

    def _append(self, key: str, line: str, store=None) -> None:
        (store or self._store).append(key, self._auth.seal_line(key, line))

    def _lines(self, key: str, store=None) -> list[str]:
        """The authentic lines of the list under ``key`` (empty when absent)."""
        raw = self._peek(key, store)
        return [] if raw is None else self._auth.open_lines(key, raw)

    def _wait(self, key: str | list[str], timeout: float) -> bool:
        """Block until ``key`` (every key of a list) exists or ``timeout`` passes (one store operation)."""
        keys = [key] if isinstance(key, str) else key
        if timeout <= 0:
            return bool(self._store.check(keys))
        try:
            self._store.wait(keys, datetime.timedelta(seconds=timeout))
            return True
        except Exception as exc:
            if "timeout" in str(exc).lower():
                return False
            raise
