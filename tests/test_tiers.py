"""The test tiers hold: an in-process test that starts a child process fails, and a test without a tier is refused.

A real pytest run over a small file of cases, with this suite's conftest as its plugin.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tests.harness import REPO

pytestmark = pytest.mark.e2e

CASES = '''
import multiprocessing
import subprocess
import threading

import pytest


def _nothing():
    pass


@pytest.mark.unit
def test_unit_popen():
    subprocess.run(["true"], check=True)


@pytest.mark.contract
def test_contract_multiprocessing_spawn():
    p = multiprocessing.get_context("spawn").Process(target=_nothing)
    p.start()
    p.join()


@pytest.mark.unit
def test_unit_popen_in_a_thread():
    t = threading.Thread(target=lambda: subprocess.run(["true"]))
    t.start()
    t.join()


@pytest.mark.e2e
def test_e2e_may_start_processes():
    subprocess.run(["true"], check=True)


@pytest.mark.unit
def test_unit_in_process():
    assert sum(range(4)) == 6
'''


def _run(tmp_path, body: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_cases.py").write_text(body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "--junitxml", str(tmp_path / "out.xml"), *args,
                           str(tmp_path / "test_cases.py")], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_an_in_process_test_that_starts_a_child_process_fails(tmp_path):
    done = _run(tmp_path, CASES)
    outcomes = {}
    for case in ET.parse(tmp_path / "out.xml").getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        outcomes[case.get("name")] = "failed" if failed else "passed"
    assert outcomes == {
        "test_unit_popen": "failed",
        "test_contract_multiprocessing_spawn": "failed",
        "test_unit_popen_in_a_thread": "failed",
        "test_e2e_may_start_processes": "passed",
        "test_unit_in_process": "passed",
    }, done.stdout + done.stderr
    assert "is marked unit or contract (in-process) but started" in done.stdout


def test_a_tier_selects_its_tests_and_a_test_without_one_is_refused(tmp_path):
    done = _run(tmp_path, CASES, "--tier=e2e")
    assert done.returncode == 0 and "1 passed, 4 deselected" in done.stdout, done.stdout + done.stderr
    done = _run(tmp_path, CASES + "\n\ndef test_without_a_tier():\n    pass\n")
    assert done.returncode != 0
    assert "without a tier mark" in done.stdout + done.stderr and "test_without_a_tier" in done.stdout + done.stderr
