"""The etcd backend's settings: its ``--rdzv-conf`` keys (docs/etcd.md), its endpoints, its client library.

Read by the handler (:mod:`elastrun.rendezvous.etcd.handler`) and the status reader
(:mod:`elastrun.rendezvous.etcd.status`) alike, and checked before anything starts.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

from elastrun.rendezvous import conf
from elastrun.rendezvous.api import RendezvousConfigError, RendezvousParameters
from elastrun.rendezvous.endpoint import split_endpoint
from elastrun.rendezvous.waiting import DEFAULT_INTERVAL as DEFAULT_WAIT_REPORT

#: ``--rdzv-conf`` keys of the etcd backend, with defaults.
CONFIG_KEYS: dict[str, conf.Key] = {
    "join_timeout": conf.Key("seconds", 600.0),
    "last_call_timeout": conf.Key("seconds", 1.0),
    "lease_ttl": conf.Key("seconds", 3.0),
    "keepalive_interval": conf.Key("seconds"),  # default: lease_ttl / 3 (see parse_config)
    "request_timeout": conf.Key("seconds", 3.0),
    "outage_timeout": conf.Key("seconds", 600.0),
    "job_ttl": conf.Key("seconds", 600.0),
    "wait_report_interval": conf.Key("seconds", DEFAULT_WAIT_REPORT),
    **{name: conf.Key("text") for name in ("protocol", "ca_cert", "client_cert", "client_key")},
    **{name: conf.Key("text") for name in ("username", "password", "password_file", "token_file")},
}
#: torchrun's names (its etcd and c10d backends) accepted as aliases.
CONFIG_ALIASES = {
    "timeout": "join_timeout",
    "cacert": "ca_cert",
    "cert": "client_cert",
    "key": "client_key",
    "heartbeat_interval": "keepalive_interval",
    "keep_alive_interval": "keepalive_interval",
    "heartbeat_timeout": "lease_ttl",
    "user": "username",
}
DEFAULT_PORT = 2379


def parse_config(params: RendezvousParameters) -> dict[str, Any]:
    """Typed ``--rdzv-conf`` values; unknown keys and bad combinations are errors that say what is allowed."""
    values = conf.read(params.config, CONFIG_KEYS, params.backend, CONFIG_ALIASES)
    if values["keepalive_interval"] is None:
        # Three renewals per lease TTL, as etcd's own client does: a renewal may fail or wait
        # twice before the lease is at risk, and a job of n agents costs etcd n / (TTL / 3)
        # renewals a second (not twice that).
        values["keepalive_interval"] = values["lease_ttl"] / 3
    if values["keepalive_interval"] <= 0:
        raise RendezvousConfigError("--rdzv-conf keepalive_interval must be positive")
    if values["lease_ttl"] < 2 * values["keepalive_interval"] or values["lease_ttl"] < 1:
        raise RendezvousConfigError(
            f"--rdzv-conf lease_ttl={values['lease_ttl']:g} must be at least 1 s and at least twice "
            f"keepalive_interval={values['keepalive_interval']:g}"
        )
    if values["request_timeout"] <= 0:
        raise RendezvousConfigError("--rdzv-conf request_timeout must be positive")
    if values["job_ttl"] < 10 * values["lease_ttl"]:
        raise RendezvousConfigError("--rdzv-conf job_ttl must be at least 10 times lease_ttl")
    for key in ("ca_cert", "client_cert", "client_key", "password_file"):
        path = values[key]
        if path is not None and not os.path.isfile(path):
            raise RendezvousConfigError(f"--rdzv-conf {key}={path!r}: no such file")
    if (values["client_cert"] is None) != (values["client_key"] is None):
        raise RendezvousConfigError("--rdzv-conf client_cert and client_key go together; give both or neither")
    if values["password_file"] is not None:
        if values["password"] is not None:
            raise RendezvousConfigError("--rdzv-conf: give password or password_file, not both")
        with open(values["password_file"]) as fh:
            values["password"] = fh.read().strip()
    if values["password"] is None and values["username"] is not None:
        values["password"] = os.environ.get("ELASTRUN_ETCD_PASSWORD")
    if values["password"] is not None and values["username"] is None:
        raise RendezvousConfigError("--rdzv-conf password needs username")
    tls = any(values[k] is not None for k in ("ca_cert", "client_cert"))
    protocol = values["protocol"] or ("https" if tls else "http")
    if protocol not in ("http", "https"):
        raise RendezvousConfigError(f"--rdzv-conf protocol={protocol!r}: use http or https")
    values["protocol"] = protocol
    values["lease_ttl_int"] = max(1, math.ceil(values["lease_ttl"]))
    return values


def parse_endpoints(endpoint: str) -> list[tuple[str, int]]:
    """``h1:2379,h2:2379`` (port optional, ``[v6]:port`` allowed) → [(host, port), ...]."""
    members = [part.strip() for part in endpoint.split(",") if part.strip()]
    if not members:
        raise RendezvousConfigError(
            "the etcd backend needs --rdzv-endpoint HOST[:PORT][,HOST[:PORT]...] (the etcd members' client URLs)"
        )
    for member in members:
        if "://" in member:
            raise RendezvousConfigError(
                f"--rdzv-endpoint {member!r}: give HOST:PORT without a scheme; use --rdzv-conf protocol=https for TLS"
            )
    return [split_endpoint(member, DEFAULT_PORT) for member in members]


def require_client(params: RendezvousParameters) -> None:
    """Raise :class:`RendezvousConfigError` naming the extra when the etcd client library is missing.

    ``etcd3gw`` and ``websocket-client`` (its streams: :mod:`.streams`) come with
    ``pip install 'elastrun[etcd]'``, not with the plain install; checked before anything starts
    so that the user gets one line instead of an import traceback.
    """
    missing = [name for name, module in (("etcd3gw", "etcd3gw"), ("websocket-client", "websocket"))
               if importlib.util.find_spec(module) is None]
    if missing:
        raise RendezvousConfigError(
            f"--rdzv-backend={params.backend} needs the {' and '.join(missing)} package"
            f"{'s' if len(missing) > 1 else ''}, which {'are' if len(missing) > 1 else 'is'} not installed; "
            "install it with: pip install 'elastrun[etcd]'"
        )


def validate_params(params: RendezvousParameters) -> None:
    """Check the client library, the endpoints and ``--rdzv-conf`` without connecting anywhere."""
    require_client(params)
    parse_endpoints(params.endpoint)
    parse_config(params)
