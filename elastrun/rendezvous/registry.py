"""The registry of rendezvous backends (``--rdzv-backend NAME``).

Backends come from three places, looked up in this order:

1. code that called :func:`register` (tests, embedding applications);
2. the ``elastrun.rendezvous`` entry-point group, so a third-party package adds a backend by
   declaring, in its ``pyproject.toml``::

       [project.entry-points."elastrun.rendezvous"]
       mybackend = "mypackage.rdzv:create_handler"

   where ``create_handler(params: RendezvousParameters) -> RendezvousHandler``;
3. nothing else: an unknown name is an error that lists the known ones.

Entry points are loaded lazily so that ``elastrun --help`` does not import every backend.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

from elastrun.rendezvous.api import RendezvousConfigError, RendezvousHandler, RendezvousParameters

HandlerFactory = Callable[[RendezvousParameters], RendezvousHandler]

ENTRY_POINT_GROUP = "elastrun.rendezvous"

#: Built-in backends, importable without the package being installed (e.g. from a source tree).
_BUILTIN: dict[str, str] = {
    "c10d": "elastrun.rendezvous.c10d:create_handler",
    "static": "elastrun.rendezvous.static:create_handler",
    "etcd": "elastrun.rendezvous.etcd:create_handler",
    "etcd-v3": "elastrun.rendezvous.etcd:create_handler",
}

_registered: dict[str, HandlerFactory] = {}


def register(name: str, factory: HandlerFactory) -> None:
    """Make ``factory`` the backend called ``name`` (overrides an entry point of the same name)."""
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"backend name {name!r} must be letters, digits, '-' or '_'")
    _registered[name] = factory


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def known_backends() -> list[str]:
    """Names accepted by ``--rdzv-backend``, sorted."""
    return sorted(set(_registered) | set(_BUILTIN) | set(_entry_points()))


def _load(target: str) -> HandlerFactory:
    module_name, _, attr = target.partition(":")
    module = __import__(module_name, fromlist=[attr])
    return getattr(module, attr)


def get_factory(name: str) -> HandlerFactory:
    """The factory for backend ``name``; :class:`RendezvousConfigError` if there is none."""
    if name in _registered:
        return _registered[name]
    if name in _BUILTIN:
        return _load(_BUILTIN[name])
    entry_points = _entry_points()
    if name in entry_points:
        return entry_points[name].load()
    raise RendezvousConfigError(
        f"unknown rendezvous backend {name!r}; known backends: {', '.join(known_backends())}"
    )


def validate(params: RendezvousParameters) -> None:
    """Check ``params`` without connecting anywhere, so a bad flag stops the launch before anything starts.

    A backend opts in by defining ``validate_params(params)`` beside its factory; it raises
    :class:`RendezvousConfigError`.
    """
    factory = get_factory(params.backend)
    module = __import__(factory.__module__, fromlist=["validate_params"])
    check = getattr(module, "validate_params", None)
    if check is not None:
        check(params)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the handler for ``params.backend``."""
    return get_factory(params.backend)(params)
