"""Single command-line values checked: node counts, ``--redirects``/``--tee`` specs, ``--rdzv-conf``,
hosts and endpoints, ``--nproc-per-node``.  Each raises :class:`~elastrun.errors.UsageError` with one
line naming where the value came from (its ``label``) and what is allowed; :mod:`elastrun.cli.parsing`
reads the whole command line with them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from elastrun.config import ALLOWED, Std
from elastrun.errors import UsageError
from elastrun.hostprobe import count_gpus, cpu_count, torch_has_cuda
from elastrun.rendezvous import conf as rdzv_conf
from elastrun.rendezvous.endpoint import check_host as _check_host
from elastrun.rendezvous.endpoint import join_address, split_address

#: What ``--nproc-per-node`` takes (its errors end with this).
NPROC_ALLOWED = "use a positive integer, auto, cpu or gpu"

def int_value(label: str, text: str, lo: int | None, hi: int | None, allowed: str) -> int:
    """``text`` as a base-10 integer within ``[lo, hi]`` (None: unbounded), else one line saying what is allowed."""
    try:
        value = int(text, 10)
    except ValueError:
        raise UsageError(f"{label} is not an integer; {allowed}") from None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise UsageError(f"{label} is out of range; {allowed}")
    return value


def parse_nnodes(label: str, text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` → ``(min_nodes, max_nodes)``; their range is checked by LaunchConfig.validate."""
    parts = text.strip().split(":")
    if len(parts) > 2 or not all(part.strip().isdigit() for part in parts):
        raise UsageError(f"{label} is not a node count; {ALLOWED['min_nodes']}")
    return int(parts[0]), int(parts[-1])


def parse_std_spec(label: str, text: str) -> dict[int, Std]:
    """torchrun's ``--redirects``/``--tee`` syntax → ``{local_rank: Std}``.

    A single value (``"3"``) applies to every local rank and is stored under the key ``-1``;
    ``"0:1,1:2"`` names ranks one by one; ``"0"`` (nothing) gives an empty map.
    """
    allowed = "use 0-3 for every local rank (0 none, 1 stdout, 2 stderr, 3 both) or LOCAL_RANK:0-3,..."
    spec = text.strip()
    if re.fullmatch(r"[0-3]", spec):
        level = Std(int(spec))
        return {-1: level} if level else {}
    if not re.fullmatch(r"\d+:[0-3](,\d+:[0-3])*", spec):
        raise UsageError(f"{label} is not a stream spec; {allowed}")
    out: dict[int, Std] = {}
    for item in spec.split(","):
        rank, level = (int(part) for part in item.split(":"))
        if rank in out:
            raise UsageError(f"{label} names local rank {rank} twice; {allowed}")
        out[rank] = Std(level)
    return out


def parse_rdzv_conf(label: str, text: str) -> dict[str, str]:
    """``KEY=VALUE,KEY=VALUE`` → dict (see :func:`elastrun.rendezvous.conf.split`)."""
    try:
        return rdzv_conf.split(text)
    except ValueError as exc:
        raise UsageError(f"{label}: {exc}") from None


def check_host(label: str, host: str) -> str:
    """A host name or an IP address (see :func:`elastrun.rendezvous.endpoint.check_host`)."""
    try:
        return _check_host(host)
    except ValueError as exc:
        raise UsageError(f"{label}: {exc}") from None


def parse_endpoint(label: str, text: str, default_port: int) -> str:
    """``HOST[:PORT]`` → ``HOST:PORT`` (``[ADDR]:PORT`` for IPv6), the port filled in when left out."""
    try:
        return join_address(*split_address(text, default_port))
    except ValueError as exc:
        raise UsageError(f"{label}: {exc}") from None


# --------------------------------------------------------------------------------------------
# --nproc-per-node words
# --------------------------------------------------------------------------------------------


def parse_nproc(label: str, text: str, environ: Mapping[str, str]) -> int:
    """``--nproc-per-node``: an integer, or auto / cpu / gpu (see the flag's help)."""
    allowed = NPROC_ALLOWED
    word = text.strip().lower()
    if word == "cpu":
        return cpu_count()
    if word == "auto":
        gpus = count_gpus(environ) if torch_has_cuda() else 0
        return gpus or cpu_count()
    if word == "gpu":
        gpus = count_gpus(environ)
        if not gpus:
            raise UsageError(f"{label}: no GPU is visible on this host; {allowed}")
        if not torch_has_cuda():
            raise UsageError(f"{label}: the installed torch is a CPU-only build; {allowed}")
        return gpus
    return int_value(label, text, None, None, allowed)
