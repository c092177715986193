"""Every module of the package imports (with the dev extras installed).

Some modules are imported lazily (``elastrun.train.MemoryReader`` imports its module on first use),
so a name that one of them imports from a module that no longer has it fails only when a user
reaches it; this test reaches every module at once.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import elastrun

pytestmark = pytest.mark.unit


def test_every_module_imports():
    failed = {}
    for module in pkgutil.walk_packages(elastrun.__path__, "elastrun."):
        try:
            importlib.import_module(module.name)
        except Exception as exc:  # noqa: BLE001 - collect them all, then report
            failed[module.name] = repr(exc)
    assert not failed, failed
