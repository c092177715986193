"""``elastrun.shared.imports``: the agent's and the template's heavy imports run with the collector paused.

The module imported here records, while it runs, whether the collector is on; the collector must be
back as it was afterwards, also where the import fails and where the caller had turned it off.
"""

from __future__ import annotations

import gc
import sys

import pytest

from elastrun.shared.imports import collector_paused, import_quickly

pytestmark = pytest.mark.unit

_RECORDER = "import gc\nSEEN_ON = gc.isenabled()\n"


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    """A folder on ``sys.path`` for this test's modules; they leave ``sys.modules`` with the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]
    gc.enable()


def test_the_collector_is_off_while_the_module_imports_and_on_again_after(module_dir):
    (module_dir / "quick_probe_a.py").write_text(_RECORDER)
    assert gc.isenabled()
    module = import_quickly("quick_probe_a")
    assert module.SEEN_ON is False
    assert gc.isenabled()
    assert import_quickly("quick_probe_a") is module  # a second call is the loaded module


def test_a_collector_the_caller_turned_off_stays_off(module_dir):
    (module_dir / "quick_probe_b.py").write_text(_RECORDER)
    gc.disable()
    import_quickly("quick_probe_b")
    assert not gc.isenabled()


def test_a_failing_import_puts_the_collector_back(module_dir):
    (module_dir / "quick_probe_c.py").write_text("raise RuntimeError('broken module')\n")
    with pytest.raises(RuntimeError, match="broken module"):
        import_quickly("quick_probe_c")
    assert gc.isenabled()
    with pytest.raises(ValueError), collector_paused():
        assert not gc.isenabled()
        raise ValueError
    assert gc.isenabled()


def test_a_block_asked_to_freeze_freezes_what_it_made_before_the_collector_resumes():
    assert gc.isenabled()
    try:
        with collector_paused(freeze=True):
            made = [[] for _ in range(1000)]
            frozen_before = gc.get_freeze_count()
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen_before + len(made)
        assert gc.get_count()[0] < len(made)  # none of them waits in the youngest generation
        unfrozen = gc.get_freeze_count()
        with pytest.raises(ValueError), collector_paused(freeze=True):
            made.append([])
            raise ValueError
        assert gc.get_freeze_count() == unfrozen  # a block that failed freezes nothing
    finally:
        gc.unfreeze()
