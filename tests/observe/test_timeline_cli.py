"""``elastrun timeline``'s output name, in-process: a wrong ``-o`` is one line, exit 2 and no file, before
anything is read; an image suffix picks the format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastrun.observe.cli import main

pytestmark = pytest.mark.unit


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    """A log directory holding one node's one-worker job, as an agent writes it."""
    logs = tmp_path / "logs"
    logs.mkdir()
    node = {"node": "n0"}
    events = [
        {"ts": 100.0, **node, "event": "agent_start", "run_id": "r", "backend": "c10d", "min_nodes": 1,
         "max_nodes": 1, "nproc": 1, "pid": 7, "hostname": "h"},
        {"ts": 100.1, **node, "event": "round_start", "after": None},
        {"ts": 100.2, **node, "event": "round_closed", "round": 0, "generation": 0, "group_rank": 0,
         "group_world_size": 1, "world_size": 1, "members": ["n0"], "duration": 0.1, "restarts_used": 0,
         "max_restarts": 0},
        {"ts": 101.0, **node, "event": "worker_start", "round": 0, "generation": 0, "rank": 0, "local_rank": 0,
         "pid": 8, "start_method": "fork-pool"},
        {"ts": 102.0, **node, "event": "worker_exit", "round": 0, "generation": 0, "rank": 0, "local_rank": 0,
         "pid": 8, "exitcode": 0, "signal": None, "alive_at": None},
        {"ts": 102.1, **node, "event": "agent_exit", "exitcode": 0, "reason": "succeeded"},
    ]
    (logs / "events-n0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return logs


@pytest.mark.parametrize("name, words", [
    ("page.html", ["-o page.html", "--html page.html"]),
    ("page.HTM", ["-o page.HTM", "--html page.HTM"]),
    ("t.jpg", ["-o t.jpg", ".jpg", ".png, .svg, .pdf"]),
])
def test_a_wrong_output_name_is_one_line_and_writes_nothing(log_dir: Path, tmp_path: Path, capsys, monkeypatch,
                                                             name: str, words: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["timeline", str(log_dir), "-o", name]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("elastrun timeline: error: "), err
    for word in words:
        assert word in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]


def test_the_suffix_picks_the_format_and_none_means_png(log_dir: Path, tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib", reason="the timeline extra (matplotlib) is not installed")
    assert main(["timeline", str(log_dir), "-o", str(tmp_path / "t.svg")]) == 0
    assert (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")
    assert main(["timeline", str(log_dir), "-o", str(tmp_path / "plain")]) == 0
    assert (tmp_path / "plain.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "plain").exists()
    assert f"wrote {tmp_path / 'plain.png'} " in capsys.readouterr().out
