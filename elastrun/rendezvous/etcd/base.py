"""The state one agent's etcd handler keeps, and the plumbing each of its parts uses.

:class:`HandlerBase` holds the settings, the etcd clients, the lease and watch threads and what
this agent knows of the job (its incarnation, its round, the members).  The parts of the
protocol are mixins on it, each in its own module (the keys are listed in
:mod:`elastrun.rendezvous.etcd.handler`):

- :mod:`.registration`: leases, this agent's registration and the job's incarnation;
- :mod:`.joining`: joining a round and waiting for its close; :mod:`.closing`: the closer's decision;
- :mod:`.liveness`: lost members (ring watch, liveness link) and ``poll`` while the workers run;
- :mod:`.ending`: failures, leaving, the exit barrier and clean-up.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

from elastrun.rendezvous.api import (
    JobFailedError,
    JobFinishedError,
    Member,
    NodeInfo,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousTimeoutError,
    RoundResult,
)
from elastrun.rendezvous.auth import JobAuth, JobToken, NoAuth, load_token
from elastrun.rendezvous.endpoint import route_address
from elastrun.rendezvous.etcd.backoff import Backoff
from elastrun.rendezvous.etcd.client import (
    KV,
    EtcdClient,
    EtcdSettings,
    EtcdUnavailable,
    LeaseNotFound,
    Shared,
    op_range,
    prefix_end,
)
from elastrun.rendezvous.etcd.lease_keeper import LeaseKeeper
from elastrun.rendezvous.etcd.streams import WatchSet
from elastrun.rendezvous.link import Link
from elastrun.rendezvous.rounds import timeout_error
from elastrun.rendezvous.wakeup import Wakeup
from elastrun.shared import log


def one_key_end(key: str) -> str:
    """The end of a range that holds ``key`` alone."""
    return key + "\0"


class Reregister(Exception):
    """This agent's lease expired (or the incarnation changed): register again and rejoin."""


def first_kv(read: tuple[list[KV], int]) -> KV | None:
    """The first key-value of a range read, or None."""
    return read[0][0] if read[0] else None


class HandlerBase(RendezvousHandler):
    """What every part of the etcd handler shares: its settings, its clients, its state, and the
    plumbing (sealing and opening values, retrying while etcd does not answer, key names)."""

    backend_name = "etcd"

    def __init__(self, params: RendezvousParameters, endpoints: list[tuple[str, int]], conf: dict[str, Any]) -> None:
        self.params = params
        self.conf = conf
        self.run_id = params.run_id
        self.min_nodes, self.max_nodes = params.min_nodes, params.max_nodes
        self.join_timeout = float(conf["join_timeout"])
        self.settings = EtcdSettings(
            endpoints=endpoints, protocol=conf["protocol"], ca_cert=conf["ca_cert"],
            client_cert=conf["client_cert"], client_key=conf["client_key"], username=conf["username"],
            password=conf["password"], request_timeout=float(conf["request_timeout"]),
        )
        self.endpoints_text = self.settings.describe()
        self.local_addr = params.local_addr or route_address(*endpoints[0])
        self._shared = Shared()
        self._kv = EtcdClient(self.settings, self._shared)
        self._p = f"/elastrun/{self.run_id}/"
        self._q = ""
        self._epoch: str | None = None
        self._epoch_rev = 0
        #: mod revision of a ``P/epoch`` seen without a live agent through one lease TTL (0: none):
        #: its incarnation may be replaced without waiting again (:meth:`Registration._try_register`).
        self._quiet_epoch = 0
        self._lease = 0
        self._job_lease = 0
        self._keeper: LeaseKeeper | None = None
        self._watch: WatchSet | None = None
        self._ring_target: str | None = None
        self._node: NodeInfo | None = None
        self._round: int | None = None
        #: The round this agent put its join key in and has not finished joining (None: none).
        self._joining: int | None = None
        self._result: RoundResult | None = None
        self._members: set[str] = set()
        #: Liveness link (:mod:`elastrun.rendezvous.link`): this round's members by group rank, the
        #: ones the link found gone, and why each lost member went (its ``lost/`` or ``left/`` marker).
        self._link: Link | None = None
        self._link_tried = False
        self._link_kv: EtcdClient | None = None
        self._ring_members: list[Member] = []
        self._link_gone: set[str] = set()
        self._ring_lock = threading.Lock()
        self._causes: dict[str, str] = {}
        self._wakeup = Wakeup()
        self._poll_seq = 0
        self._ring: list[str] = []
        self._ring_pending: str | None = None
        self._reported: set[str] = set()
        self._worker_store = None
        #: The job's state (abort, finished, current) read in the registration's transaction, for
        #: the join that follows it (saves a request); None: read it afresh.
        self._job_state: list[tuple[list[KV], int]] | None = None
        self._warned_wait = False
        self._closed = False
        self._token = JobToken(load_token(conf["token_file"], self._warn), self.run_id)
        self._auth: JobAuth | NoAuth = NoAuth(self.run_id)
        self._probe()

    # ------------------------------------------------------------------ plumbing
    def _warn(self, message: str) -> None:
        log.get("rendezvous").warning(message)

    def _probe(self) -> None:
        """Reach etcd once at start so that wrong credentials or certificates fail at once.

        An unreachable cluster is not an error yet: :meth:`next_round` keeps trying until the
        join timeout.
        """
        try:
            epoch_read, agents = self._kv.read_many([op_range(self._p + "epoch"), self._agents_op()])
            epoch = first_kv(epoch_read)
            if epoch is not None and agents[1] > 0:
                # A running job: a node whose token does not match fails now, before anything starts.
                self._token.accept(json.loads(epoch.value).get("auth", "none"), self.endpoints_text)
        except EtcdUnavailable:
            pass

    def _seal(self, key: str, value: str) -> str:
        return self._auth.seal(key, value)

    def _open(self, kv: KV | None) -> str | None:
        """The authentic value of ``kv`` (None: absent, or forged and reported once)."""
        return None if kv is None else self._auth.open(kv.key, kv.value)

    def _authentic(self, kvs: list[KV]) -> list[KV]:
        """The entries of ``kvs`` whose values are authentic, values opened (all of them without a token)."""
        if not self._auth.enabled:
            return kvs
        opened = ((kv, self._auth.open(kv.key, kv.value)) for kv in kvs)
        return [dataclasses.replace(kv, value=value.encode()) for kv, value in opened if value is not None]

    def _report_forged(self, key: str, why: str) -> None:
        self.warn(f"ignored a value in etcd that is not authentic: {key} ({why})",
                  kind="forged_value", key=key, why=why)

    def _retry(self, op, deadline: float, what: str):
        """Run ``op()`` until etcd answers or ``deadline``; then a connection error naming the endpoints.

        Waits between tries back off with jitter (:mod:`.backoff`): a job's agents that all saw
        an overloaded etcd time out must not all come back at once.
        """
        backoff = Backoff(0.1, 2.0)
        while True:
            try:
                result = op()
                if self._warned_wait:
                    self._warn(f"etcd answers again ({what})")
                    self._warned_wait = False
                return result
            except EtcdUnavailable as exc:
                delay = backoff.delay()
                if time.monotonic() + delay >= deadline:
                    raise RendezvousConnectionError(
                        f"could not reach etcd at {self.endpoints_text} to {what} within the time allowed "
                        f"(join_timeout={self.join_timeout:g} s): {exc}. Is etcd running there and is "
                        "--rdzv-endpoint right?"
                    ) from None
                if not self._warned_wait:
                    self._warn(f"etcd unreachable at {self.endpoints_text} ({exc}); retrying with back-off")
                    self._warned_wait = True
                time.sleep(delay)
            except (RendezvousConfigError, LeaseNotFound, Reregister, JobFailedError, JobFinishedError):
                raise
            except RendezvousError as exc:
                raise RendezvousConnectionError(f"etcd at {self.endpoints_text}: {exc}") from exc

    def _r(self, round_: int, *parts: str) -> str:
        return f"{self._q}r{round_}/" + "/".join(parts)

    def _agents_op(self) -> dict[str, Any]:
        """Count of the live agents of the job (a read for a transaction)."""
        return op_range(self._p + "agents/", prefix_end(self._p + "agents/"), count_only=True)

    @staticmethod
    def _job_state_ops(q: str) -> list[dict[str, Any]]:
        """Reads of an incarnation's ``abort``, ``finished`` and ``current`` (for a transaction)."""
        return [op_range(q + "abort"), op_range(q + "finished"), op_range(q + "current")]


    def _timeout_error(self, round_: int, joined: int) -> RendezvousTimeoutError:
        return timeout_error(self.run_id, self.join_timeout, round_, self.min_nodes, self.max_nodes, joined)


    def _abort_code(self) -> int:
        try:
            found = self._open(self._kv.get(self._q + "abort_code"))
        except RendezvousError:
            return 1
        return int(found) if found else 1
