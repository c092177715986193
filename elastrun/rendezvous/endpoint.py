"""Rendezvous endpoints and this host's addresses: one reading of ``HOST[:PORT]`` for every part.

The command line, the c10d/static and etcd backends and ``elastrun status`` all read an
endpoint with :func:`split_address` (strict: a host name or an IP address, a port in 0-65535, port 0 on
a loopback host only) and write it back with :func:`join_address`.  The address helpers answer the
backends' questions about this host: is the endpoint one of our addresses (:func:`is_local_host`),
which of our addresses reaches it (:func:`route_address`), a listening socket on one address
(:func:`listen_on`) and the workers' store of a round on it (:func:`host_worker_store`).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket

from elastrun.rendezvous.api import RendezvousConfigError
from elastrun.shared.imports import import_quickly

_HOST_RE = re.compile(r"[A-Za-z0-9_.-]+")
_BRACKETED = re.compile(r"\[([^\]]+)\](?::(.*))?")
ALLOWED = "use HOST[:PORT] with a port in 1-65535 (IPv6 as [ADDR]:PORT)"


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text.partition("%")[0])
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """Whether ``host`` is written as a loopback name or address (no lookup)."""
    return host in ("localhost", "::1") or host.startswith("127.")


def check_host(host: str) -> str:
    """A host name, an IPv4 address, or an IPv6 address (bare or in brackets); returned as given.

    Raises ValueError saying what is wrong.
    """
    inner = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not (_HOST_RE.fullmatch(inner) or (":" in inner and _is_ipv6(inner))):
        raise ValueError(f"{host!r} is not a host; give a host name or an IP address")
    return host


def split_address(text: str, default_port: int) -> tuple[str, int]:
    """``HOST[:PORT]``, ``[ADDR]:PORT`` or a bare IPv6 address → (host, port), brackets removed.

    The port is ``default_port`` when left out.  Port 0 ("the agent binds any free port") is
    allowed on a loopback host only: other nodes could not learn which port was picked.  Raises
    ValueError saying what is wrong and what is allowed.
    """
    item = text.strip()
    bracketed = _BRACKETED.fullmatch(item)
    if bracketed:
        host, port_text = bracketed.group(1), bracketed.group(2)
        if not _is_ipv6(host):
            raise ValueError(f"{host!r} is not an IPv6 address; {ALLOWED}")
    elif item.count(":") >= 2:
        if not _is_ipv6(item):
            raise ValueError(f"{item!r} is not a valid endpoint; {ALLOWED}")
        host, port_text = item, None
    else:
        host, colon, port_text = item.partition(":")
        if not _HOST_RE.fullmatch(host):
            raise ValueError(f"{host!r} is not a host name or address; {ALLOWED}")
        port_text = port_text if colon else None
    if port_text is None:
        return host, default_port
    if not port_text.isdigit():
        raise ValueError(f"port {port_text!r} is not a number; {ALLOWED}")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"port {port} is out of range; {ALLOWED}")
    if port == 0 and not is_loopback(host):
        raise ValueError(f"port 0 (any free port) works on localhost only; {ALLOWED}")
    return host, port


def split_endpoint(text: str, default_port: int) -> tuple[str, int]:
    """:func:`split_address` for a backend: a mistake is a :class:`RendezvousConfigError`."""
    try:
        return split_address(text, default_port)
    except ValueError as exc:
        raise RendezvousConfigError(f"rendezvous endpoint {text.strip()!r}: {exc}") from None


def join_address(host: str, port: int) -> str:
    """``host:port``, or ``[host]:port`` for an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _host_addresses(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return set()


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine (a loopback name or one of its interface addresses)."""
    import psutil

    addresses = _host_addresses(host)
    if any(a.startswith("127.") or a == "::1" for a in addresses):
        return True
    local = {addr.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for addr in addrs}
    return bool(addresses & local)


def route_address(host: str, port: int) -> str:
    """The local address that packets to ``host`` leave from (no packet is sent)."""
    addresses = _host_addresses(host)
    if not addresses:
        return socket.gethostname()
    if any(a.startswith("127.") for a in addresses):
        return "127.0.0.1"
    target = sorted(addresses)[0]
    family = socket.AF_INET6 if ":" in target else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((target, port or 9))
            return sock.getsockname()[0]
        except OSError:
            return socket.gethostname()


def listen_on(addr: str) -> int:
    """A listening TCP socket on ``addr`` (any free port), handed over as a file descriptor.

    ``TCPStore`` itself binds every interface whatever host it is given; a store created on this
    descriptor listens only where the agents said this node can be reached.
    """
    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(sockaddr)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the installed torch is ``major.minor`` or newer (for the few version-guarded paths)."""
    import torch

    return tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) >= (major, minor)


def host_worker_store(addr: str):  # noqa: ANN201 - a torch.distributed.TCPStore; torch is imported here only
    """The workers' store of a round, hosted by the agent of group rank 0, on any free port.

    It listens only on ``addr``, the address the agents use for this node (:func:`listen_on`).
    """
    dist = import_quickly("torch.distributed")

    # torch's libuv server takes a handed-over socket from 2.8 on (pytorch PR 150215); 2.4-2.7 refuse
    # it (NotImplementedError) and 2.3 ignores it (its clients then hang): the classic server there.
    for use_libuv in (True, False) if torch_at_least(2, 8) else (False,):
        fd = listen_on(addr)
        with socket.socket(fileno=os.dup(fd)) as sock:
            port = sock.getsockname()[1]  # torch < 2.8 insists that the port given is the descriptor's
        try:
            return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, use_libuv=use_libuv,
                                 master_listen_fd=fd)
        except NotImplementedError:
            os.close(fd)
    raise AssertionError("unreachable: the classic TCPStore server takes a listening socket")
