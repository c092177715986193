"""Keeping an agent's leases alive while etcd is slow: a renewal cadence counted from each
renewal's send and tightened as the latency observed grows, within fixed bounds.

**Why leases expired under load.**  etcd starts a renewed lease's TTL when it *processes* the
renewal, and the leader processes one only once it has applied every write it committed (etcd
3.4.23 as installed here, and 3.5: a renewal waits up to 1 s for the applied index, then fails with "waiting for
the applied index took too long" and ends the stream).  So on a member that falls behind applying
writes, renewals are processed late.  The keeper used to send a renewal, wait for its answer,
*then* wait ``keepalive_interval``: two renewals reached etcd ``interval`` + the latency apart, and
with ``lease_ttl`` 3 s and the default 1 s interval, a member that took 2 s to answer lost the
lease.  Other ways it lost one: its life was counted from the answer's arrival (a renewal that
timed out on the agent's side had used more of it), a grant slow to answer was first renewed a
whole interval after its answer, and the first renewal also paid for opening the stream.

**The rule** (docs/etcd.md, "Keep-alive cadence"):

- The next renewal is sent ``cadence`` after the previous one was *sent*, or at once when its
  answer came later than that (one renewal in flight: etcd ends the stream when one fails, and a
  queue of them would go with it).
- ``cadence`` = min(``keepalive_interval``, max(``lease_ttl`` / 6, (``lease_ttl`` − *L*) / 2)),
  *L* the slowest of the last 16 answers (the grant's included): room for two renewals after the
  worst latency seen.  While etcd answers within ``lease_ttl`` / 3 it is the interval of the
  settings; it never goes below ``lease_ttl`` / 6 (at most twice the default rate of renewals,
  which cost no write: etcd renews in memory).
- A grant's TTL counts from when it was first *sent*: a grant slow to answer is renewed at once.
- A renewal waits for its answer as long as the lease may live (``lease_ttl`` after the latest
  confirming answer): giving up sooner on a member that is merely slow costs a new stream and one
  more renewal.  After a failure the next try comes within a quarter of what the lease surely
  has left (jittered back-off, 0.25-1 s, capped by that).
- The stream is opened while the lease is being granted, so the first renewal is one message.
- Only etcd's answer "expired" (TTL ≤ 0) marks the lease lost; nothing is guessed from time, so a
  lease that really expired is counted and registered again, and one that is merely slow is kept.
  ``lease_ttl`` itself is never stretched: a partitioned agent's keys still go ``lease_ttl`` after
  its last renewal.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque

from elastrun.rendezvous.etcd.backoff import Backoff
from elastrun.rendezvous.etcd.client import EtcdClient, EtcdUnavailable
from elastrun.rendezvous.etcd.streams import open_stream, recv_json

#: How many renewal latencies the cadence looks back over (their maximum is the high percentile).
RECENT = 16
#: The cadence never goes below ``lease_ttl`` / this (6 renewals per TTL, 2 x the default rate).
MIN_CADENCE_DIVISOR = 6


def cadence(interval: float, ttl: float, worst: float) -> float:
    """Seconds between renewals sent, given the slowest recent answer ``worst`` (module docstring)."""
    return min(interval, max(ttl / MIN_CADENCE_DIVISOR, (ttl - worst) / 2))


class KeepAliveStream:
    """One WebSocket to ``/v3/lease/keepalive`` on the member the agent's requests use.

    Used by one thread only; :meth:`renew` is one renewal and its answer (a late answer to an earlier
    renewal is skipped).
    """

    def __init__(self, client: EtcdClient) -> None:
        self.client = client
        self._ws = None
        self._index = -1
        #: Monotonic time before which no new stream is tried (after one could not be opened).
        self._retry_at = 0.0

    def held(self, timeout: float) -> bool:
        """True when a stream to the preferred member is open (opening one if needed)."""
        with self.client.shared.lock:
            index = self.client.shared.preferred
        if self._ws is not None and index == self._index:
            return True
        self.close()  # the other requests moved to another member: follow them
        if time.monotonic() < self._retry_at:
            return False
        try:
            self._ws = open_stream(self.client, index, "lease/keepalive", timeout)
            self._index = index
        except EtcdUnavailable:
            self._retry_at = time.monotonic() + 10.0
            return False
        return True

    def send(self, lease: int) -> None:
        """Send one renewal of ``lease`` (its answer comes through :meth:`recv`)."""
        try:
            self._ws.settimeout(5.0)
            self._ws.send(json.dumps({"ID": str(lease)}))
        except Exception as exc:
            self.close()
            raise EtcdUnavailable(f"keep-alive stream: {exc}") from None

    def recv(self, timeout: float) -> tuple[int, int] | None:
        """The next answer as (lease, TTL; -1 when it expired), or None when none came in ``timeout``."""
        try:
            self._ws.settimeout(max(0.01, timeout))
            result = recv_json(self._ws)
        except Exception as exc:
            if type(exc).__name__ == "WebSocketTimeoutException":
                return None
            self.close()
            raise EtcdUnavailable(f"keep-alive stream: {exc}") from None
        return int(result.get("ID", 0) or 0), int(result.get("TTL", -1) or -1)

    def renew(self, lease: int, timeout: float) -> int:
        """Renew ``lease`` and wait for its answer: its new TTL, or -1 when it expired.  Over the
        stream when one can be held, else as one HTTP request; raises :class:`EtcdUnavailable` when no
        member answers in ``timeout``."""
        if not self.held(timeout):
            return self.client.keepalive(lease, timeout)
        deadline = time.monotonic() + timeout
        self.send(lease)
        while True:
            answer = self.recv(deadline - time.monotonic())
            if answer is None:
                self.close()
                raise EtcdUnavailable(f"keep-alive stream: no answer in {timeout:.2f} s")
            if answer[0] == lease:  # a late answer to an earlier renewal is skipped
                return answer[1]

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
    monotonic time of the first failure of a running outage (no stream, no answer), None while
    etcd answers.  The cadence and its bounds: module docstring.
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
        self.on_failover = None
        self._warn = warn
        self._stop_event = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.RLock()  # the leases, their times and the latencies (handler and keeper threads)
        self._next_job = 0.0
        #: Send time of the latest renewal (or the grant) of ``lease`` that etcd confirmed.
        self._confirmed = time.monotonic()
        #: When etcd's answer confirming that renewal (or the grant) came.
        self._answered = self._confirmed
        self._due = 0.0
        self._heard_at = 0.0
        self._latencies: deque[float] = deque(maxlen=RECENT)
        self._stream = KeepAliveStream(client)

    # ------------------------------------------------------------------ the handler's side
    def set_leases(self, lease: int, job_lease: int, granted_at: float | None = None) -> None:
        """Renew ``lease`` and ``job_lease`` from now on.

        ``granted_at``: the monotonic time the grant of a new ``lease`` was first sent (etcd started
        its TTL no earlier), so a grant that was slow to answer is renewed at once.  A job lease
        new to this keeper is first renewed one ``job_interval`` from now: it was just granted, or
        adopted from a running incarnation whose live agents renew it themselves.
        """
        with self._lock:
            now = time.monotonic()
            if job_lease != self.job_lease:
                self._next_job = now + self.job_interval
            if lease != self.lease:
                self._confirmed = granted_at if granted_at is not None else now
                self._answered = now
                if granted_at is not None:
                    self._latencies.append(now - granted_at)  # the grant's answer: the latency known so far
                self._due = self._confirmed + self.cadence()
            self.lease, self.job_lease, self.lost, self.job_lost = lease, job_lease, False, False
        self._wake.set()

    def cadence(self) -> float:
        """Seconds between renewals now (module docstring)."""
        with self._lock:
            worst = max(self._latencies, default=-1.0)
        if worst < 0:
            shared = self.client.shared
            worst = shared.srtt + 2 * shared.rttvar
        return cadence(self.interval, self.ttl, worst)

    def stop(self) -> None:
        self._stop_event.set()
        self._wake.set()

    # ------------------------------------------------------------------ the thread
    def run(self) -> None:
        cap = min(1.0, self.interval)
        retry = Backoff(cap / 2, cap)
        # Open the stream while the lease is being granted: the first renewal then costs one message,
        # not a connection and a message (a slow member takes each as long).
        try:
            self._stream.held(self.ttl)
        except Exception:  # credentials, TLS: the first renewal meets it again and reports it
            pass
        while not self._stop_event.is_set():
            preferred = self.client.shared.preferred
            try:
                wait = self._step()
                if self.outage_since is not None and self._heard_at > self.outage_since:
                    took = time.monotonic() - self.outage_since
                    self._warn(f"etcd is reachable again after {took:.1f} s; the rendezvous carries on")
                    self.outage_since = None
                retry.reset()
            except Exception as exc:  # EtcdUnavailable; credentials revoked, etc.: keep trying, report once
                self.last_error = str(exc)
                if self.outage_since is None:
                    self.outage_since = time.monotonic()
                    what = "unreachable or too slow" if isinstance(exc, EtcdUnavailable) else "keep-alive failed:"
                    self._warn(f"etcd {what} ({exc}); running workers keep training, retrying with back-off")
                # Sooner while the lease may still be saved: within a quarter of what it surely has
                # left; past that, haste cannot save it and the back-off alone spaces the tries.
                wait, left = retry.delay(), self._confirmed + self.ttl - time.monotonic()
                if left > 0:
                    wait = min(wait, max(0.05, left / 4))
            if self.client.shared.preferred != preferred and self.on_failover is not None:
                self.on_failover()
            self._wake.wait(wait)
            self._wake.clear()
        self._stream.close()

    def _left(self, now: float) -> float:
        """How long a renewal sent now may wait for its answer: what the agent lease may have left
        (``lease_ttl`` after the latest confirming answer came; etcd processed that renewal before
        its answer left), at least 0.25 s.  Giving up sooner would cost a new stream and one more
        renewal on a member that is merely slow."""
        return max(0.25, self._answered + self.ttl - now)

    def _step(self) -> float:
        """Renew what is due (one renewal at a time, each waiting for its answer); the seconds until
        the next renewal is due."""
        now = time.monotonic()
        with self._lock:
            lease, job_lease = (0 if self.lost else self.lease), self.job_lease
        if lease and now >= self._due:
            self._answer(lease, now, self._stream.renew(lease, self._left(now)))
            self._due = now + self.cadence()  # from the send: a slow answer does not delay the next one
        now = time.monotonic()
        if job_lease and now >= self._next_job:
            self._answer(job_lease, now, self._stream.renew(job_lease, max(1.0, self._left(now))))
            self._next_job = now + self.job_interval
        with self._lock:
            times = ([self._due] if self.lease and not self.lost else []) + ([self._next_job] if self.job_lease else [])
        return max(0.0, min(times, default=now + self.interval) - time.monotonic())

    def _answer(self, lease: int, sent: float, ttl: int) -> None:
        """etcd answered a renewal of ``lease`` sent at ``sent``: ``ttl`` > 0 renewed it, else it expired."""
        with self._lock:
            self._heard_at = time.monotonic()
            self._latencies.append(self._heard_at - sent)
            if lease == self.lease and lease:
                if ttl <= 0:
                    self.lost = True
                elif sent >= self._confirmed:
                    self._confirmed, self._answered = sent, self._heard_at
            if lease == self.job_lease and lease and ttl <= 0:
                self.job_lost = True
