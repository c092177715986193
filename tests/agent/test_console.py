"""elastrun's own messages (elastrun.shared.log): one console format, and -q/-v the same for every part."""

from __future__ import annotations

import re
import sys
import threading

import pytest

from elastrun.shared import log
from tests import warm
from tests.harness import REPO, base_env

pytestmark = pytest.mark.unit

PARTS = ("agent", "pool", "rendezvous", "launcher", "observe", "cli")
LINE = re.compile(r"elastrun\[n1\] \d\d:\d\d:\d\d (warning: |error: |debug: )?\S.*|    \S.*")


@pytest.fixture(autouse=True)
def _default_level():
    yield
    log.configure()


def _lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_one_format_before_and_after_the_node_is_known(capsys):
    log.configure()
    log.get("pool").warning("warm pool: the template died; starting workers with exec")
    assert _lines(capsys) == ["elastrun: warning: warm pool: the template died; starting workers with exec"]
    log.set_node("n1")
    log.get("agent").info("round 0 closed\nmembers: a, b")
    log.get("rendezvous").error("lost the store")
    lines = _lines(capsys)
    assert len(lines) == 3 and all(LINE.fullmatch(line) for line in lines), lines
    assert lines[0].endswith(" round 0 closed") and lines[1] == "    members: a, b"
    assert lines[2].endswith(" error: lost the store")


@pytest.mark.parametrize(("quiet", "verbose", "shown"), [
    (True, False, {"error"}),
    (False, False, {"error", "warning", "info"}),
    (False, True, {"error", "warning", "info", "debug"}),
])
def test_quiet_and_verbose_mean_the_same_for_every_part(capsys, quiet, verbose, shown):
    log.configure(quiet, verbose)
    for part in PARTS:
        for level in ("debug", "info", "warning", "error"):
            getattr(log.get(part), level)(f"{part} {level}")
    seen = {tuple(line.split()[-2:]) for line in _lines(capsys)}
    assert seen == {(part, level) for part in PARTS for level in shown}


def test_each_message_is_written_whole_while_threads_speak_at_once(capsys):
    log.configure()
    log.set_node("n1")

    def speak(part: str) -> None:
        for i in range(200):
            log.get(part).warning(f"{part} message {i}\nsecond line of {part} {i}")

    threads = [threading.Thread(target=speak, args=(part,)) for part in PARTS[:4]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    lines = _lines(capsys)
    assert len(lines) == 4 * 200 * 2
    for first, second in zip(lines[::2], lines[1::2], strict=True):
        part, _, i = first.split("warning: ", 1)[1].split(" ")
        assert second == f"    second line of {part} {i}", (first, second)


@pytest.mark.e2e
def test_train_warnings_are_silenced_by_quiet():
    code = "from elastrun.train.notes import warn\nwarn('snapshot of step 3 skipped')\n"

    def stderr(level: str | None) -> str:
        env = {k: v for k, v in base_env().items() if k != log.LEVEL_ENV}
        if level:
            env[log.LEVEL_ENV] = level
        proc = warm.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    assert "TrainWarning: snapshot of step 3 skipped" in stderr(None)
    assert "TrainWarning: snapshot of step 3 skipped" in stderr("INFO")
    assert stderr("ERROR") == ""
