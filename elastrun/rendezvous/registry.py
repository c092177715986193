"""The registry of rendezvous backends (``--rdzv-backend NAME``).

A backend is one :class:`~elastrun.rendezvous.api.RendezvousBackend` object: it validates a
job's settings, creates an agent's handler and reads the job's status.  The command line,
:func:`elastrun.launcher.launch` and ``elastrun status`` all find it here, in this order:

1. code that called :func:`register` (tests, embedding applications);
2. the built-in backends (c10d, static, etcd, etcd-v3), importable from a source tree;
3. the ``elastrun.rendezvous`` entry-point group, so a third-party package adds a backend by
   declaring, in its ``pyproject.toml``::

       [project.entry-points."elastrun.rendezvous"]
       mybackend = "mypackage.rdzv:BACKEND"

   where ``BACKEND`` is a ``RendezvousBackend``;
4. nothing else: an unknown name is an error that lists the known ones.

A plain factory ``create_handler(params) -> RendezvousHandler`` is accepted in place of a backend
object (registered or declared): it creates handlers, accepts every setting and has no status
reader.  Backends are loaded lazily so that ``elastrun --help`` does not import every backend.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import Any

from elastrun.rendezvous.api import (
    RendezvousBackend,
    RendezvousConfigError,
    RendezvousHandler,
    RendezvousParameters,
    StatusNotSupportedError,
)

HandlerFactory = Callable[[RendezvousParameters], RendezvousHandler]

ENTRY_POINT_GROUP = "elastrun.rendezvous"

#: Built-in backends, importable without the package being installed (e.g. from a source tree).
_BUILTIN: dict[str, str] = {
    "c10d": "elastrun.rendezvous.c10d:BACKEND",
    "static": "elastrun.rendezvous.c10d.static:BACKEND",
    "etcd": "elastrun.rendezvous.etcd:BACKEND",
    "etcd-v3": "elastrun.rendezvous.etcd:BACKEND",
}

_registered: dict[str, RendezvousBackend] = {}


class FactoryBackend(RendezvousBackend):
    """A backend given as a bare handler factory: creates handlers and nothing more."""

    def __init__(self, factory: HandlerFactory) -> None:
        self.factory = factory

    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        return self.factory(params)

    def read_status(self, params: RendezvousParameters, timeout: float) -> dict[str, Any]:
        name = getattr(self.factory, "__module__", "") or "?"
        raise StatusNotSupportedError(
            f"the {params.backend!r} rendezvous backend does not support 'elastrun status' (it is registered "
            f"as a handler factory from {name}; register a RendezvousBackend with read_status)"
        )


def _as_backend(found: RendezvousBackend | HandlerFactory) -> RendezvousBackend:
    return found if isinstance(found, RendezvousBackend) else FactoryBackend(found)


def register(name: str, backend: RendezvousBackend | HandlerFactory) -> None:
    """Make ``backend`` the one called ``name`` (overrides a built-in or an entry point of that name)."""
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"backend name {name!r} must be letters, digits, '-' or '_'")
    _registered[name] = _as_backend(backend)


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def known_backends() -> list[str]:
    """Names accepted by ``--rdzv-backend``, sorted."""
    return sorted(set(_registered) | set(_BUILTIN) | set(_entry_points()))


def _load(target: str) -> RendezvousBackend | HandlerFactory:
    module_name, _, attr = target.partition(":")
    module = __import__(module_name, fromlist=[attr])
    return getattr(module, attr)


def get_backend(name: str) -> RendezvousBackend:
    """The backend called ``name``; :class:`RendezvousConfigError` listing the known ones if there is none."""
    if name in _registered:
        return _registered[name]
    if name in _BUILTIN:
        return _as_backend(_load(_BUILTIN[name]))
    entry_points = _entry_points()
    if name in entry_points:
        return _as_backend(entry_points[name].load())
    raise RendezvousConfigError(
        f"unknown rendezvous backend {name!r}; known backends: {', '.join(known_backends())}"
    )


def validate(params: RendezvousParameters) -> None:
    """Check ``params`` with its backend, without connecting anywhere (a bad flag stops the launch early)."""
    get_backend(params.backend).validate(params)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the handler for ``params.backend``."""
    return get_backend(params.backend).create_handler(params)


def read_status(params: RendezvousParameters, timeout: float) -> dict[str, Any]:
    """The job's status document from ``params.backend``'s reader (``elastrun status``)."""
    return get_backend(params.backend).read_status(params, timeout)
