"""``--rdzv-conf``: one parser for the command line, ``elastrun status`` and every backend.

The text ``KEY=VALUE,KEY=VALUE`` becomes a ``dict[str, str]`` with :func:`split` (what the
command line and ``elastrun status`` do); a backend turns that dict into typed values with
:func:`read` and a table of :class:`Key` (name → kind and default), so that every backend accepts
the same boolean words, the same seconds, torchrun's aliases and ignored keys, and reports an
unknown key the same way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from elastrun.rendezvous.api import RendezvousConfigError

#: The one boolean vocabulary of elastrun: ``--rdzv-conf`` values and ``PET_*`` switches alike.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
BOOL_HELP = "1/true/yes/on or 0/false/no/off"

_KEY_RE = re.compile(r"[A-Za-z0-9_.-]+")
_ALLOWED = "use KEY=VALUE,KEY=VALUE, e.g. join_timeout=600,last_call_timeout=1"


def parse_bool(text: str) -> bool | None:
    """True or False for a word of :data:`TRUE_WORDS` / :data:`FALSE_WORDS` (any case), else None."""
    word = text.strip().lower()
    return True if word in TRUE_WORDS else False if word in FALSE_WORDS else None


def seconds(key: str, raw: str) -> float:
    """``raw`` as seconds >= 0; ValueError with a message that names ``key=raw`` otherwise."""
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{key}={raw} is not a number; give seconds, e.g. {key}=60") from None
    if not 0 <= value < math.inf:
        raise ValueError(f"{key}={raw} is out of range; give seconds >= 0")
    return value


def split(text: str) -> dict[str, str]:
    """``KEY=VALUE,KEY=VALUE`` → dict; a key ending in ``timeout`` must be seconds >= 0.

    Raises ValueError (the message says which item is wrong and what is allowed).
    """
    out: dict[str, str] = {}
    for item in text.split(",") if text.strip() else []:
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not value or not _KEY_RE.fullmatch(key):
            raise ValueError(f"{item.strip()!r} is not KEY=VALUE; {_ALLOWED}")
        if key in out:
            raise ValueError(f"{key} is given twice; {_ALLOWED}")
        if key.endswith("timeout"):
            seconds(key, value)
        out[key] = value
    return out


@dataclass(frozen=True)
class Key:
    """One ``--rdzv-conf`` key of a backend: how its value is read, and its value when not given."""

    kind: Literal["seconds", "bool", "text"]
    default: Any = None


#: torchrun's keys that no elastrun backend acts on; accepted and ignored.
IGNORED_TORCHRUN_KEYS = frozenset({"close_timeout", "keep_alive_max_attempt", "use_libuv"})


def read(
    config: Mapping[str, str], keys: Mapping[str, Key], backend: str, aliases: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Typed values of a backend's keys (defaults for those not given).

    ``aliases`` maps torchrun's names to the backend's.  An unknown key, a bad number or a bad
    boolean raises :class:`RendezvousConfigError` naming the key and what is allowed.
    """
    values = {name: key.default for name, key in keys.items()}
    for raw_key, raw in config.items():
        if raw_key in IGNORED_TORCHRUN_KEYS:
            continue
        name = (aliases or {}).get(raw_key, raw_key)
        if name not in keys:
            known = ", ".join(sorted(keys))
            raise RendezvousConfigError(
                f"unknown --rdzv-conf key {raw_key!r} for backend {backend!r}; known keys: {known}"
            )
        kind = keys[name].kind
        if kind == "seconds":
            try:
                values[name] = seconds(raw_key, raw)
            except ValueError as exc:
                raise RendezvousConfigError(f"--rdzv-conf {exc}") from None
        elif kind == "bool":
            values[name] = parse_bool(raw)
            if values[name] is None:
                raise RendezvousConfigError(f"--rdzv-conf {raw_key}={raw!r} is not a boolean; use {BOOL_HELP}")
        else:
            values[name] = raw
    return values
