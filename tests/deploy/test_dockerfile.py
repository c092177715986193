"""The Dockerfile, checked by reading it (no container engine is needed, or available, where tests run).

A small parser of our own turns the Dockerfile into stages and instructions; the tests then check what
would otherwise only show up at ``docker build`` or at run time: a variable used where it is not declared
(Docker substitutes an empty string without a word), a COPY of a file the build context leaves out, a
shell-form entrypoint that would swallow the kubelet's SIGTERM, build tools in the runtime image.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import pytest

from tests.deploy.podenv import REPO

pytestmark = pytest.mark.unit

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
#: Variables the base image (python:*-slim) defines in its environment.
BASE_IMAGE_ENV = {"PATH", "HOME", "LANG", "PYTHON_VERSION"}
#: Copied into the image but written by other parts of the project (README by the core, examples/ by the
#: training library); `docker build` fails until they exist.
WRITTEN_ELSEWHERE = {"README.md", "examples"}
BUILD_TOOLS = ("build-essential", "gcc", "g++", "clang", "make", "cmake", "python3-dev", "git")


@dataclass
class Instruction:
    keyword: str
    value: str
    line: int


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse_dockerfile(text: str) -> tuple[list[Instruction], list[Stage]]:
    """Global instructions (before the first FROM) and the stages, with continuations joined."""
    instructions: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue  # comments, parser directives and blank lines (also inside a continuation)
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        keyword, _, value = (pending + stripped).partition(" ")
        instructions.append(Instruction(keyword.upper(), value.strip(), start))
        pending = ""
    assert not pending, "the Dockerfile ends inside a line continuation"
    preamble: list[Instruction] = []
    stages: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", ins.value, re.IGNORECASE)
            assert m, f"line {ins.line}: cannot read FROM {ins.value!r}"
            stages.append(Stage(name=m.group(2) or str(len(stages)), base=m.group(1)))
        elif stages:
            stages[-1].instructions.append(ins)
        else:
            preamble.append(ins)
    return preamble, stages


def _var_refs(text: str) -> set[str]:
    return set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text))


def _declared(ins: Instruction) -> list[str]:
    """Names an ARG or ENV instruction declares."""
    if ins.keyword == "ARG":
        return [ins.value.split("=", 1)[0]]
    if ins.keyword == "ENV":
        return re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=", ins.value)
    return []


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def dockerfile() -> tuple[list[Instruction], list[Stage]]:
    return parse_dockerfile(DOCKERFILE.read_text())


def _dockerignore_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def excluded_by_dockerignore(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        regex = _dockerignore_regex(line.lstrip("!").strip("/"))
        if any(regex.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


def test_parser_reads_a_known_dockerfile() -> None:
    """The parser itself: continuations joined, comments skipped, stages and their names found."""
    text = 'ARG B=x\nFROM ${B} AS one\n# note\nRUN a \\\n  # inside\n  b\nFROM one\nCMD ["c"]\n'
    preamble, stages = parse_dockerfile(text)
    assert [(i.keyword, i.value) for i in preamble] == [("ARG", "B=x")]
    assert [(s.name, s.base) for s in stages] == [("one", "${B}"), ("1", "one")]
    assert stages[0].instructions[0].value == "a b"


def test_multi_stage_with_a_separate_runtime(dockerfile) -> None:
    _, stages = dockerfile
    assert len(stages) >= 2
    assert [s.name for s in stages] == ["build", "runtime"]
    # The venv is copied as is: its interpreter symlinks need the same Python at the same path.
    assert stages[0].base == stages[-1].base == "${BASE_IMAGE}"


def test_every_variable_is_declared_where_it_is_used(dockerfile) -> None:
    preamble, stages = dockerfile
    global_args = {ins.value.split("=", 1)[0] for ins in preamble if ins.keyword == "ARG"}
    for stage in stages:
        assert _var_refs(stage.base) <= global_args, f"FROM {stage.base}: undeclared ARG"
        known = set(BASE_IMAGE_ENV)
        for ins in stage.instructions:
            unknown = _var_refs(ins.value) - known
            # A global ARG is not visible inside a stage unless re-declared there (a classic trap).
            assert not unknown, f"line {ins.line}: {sorted(unknown)} not declared in stage {stage.name}"
            known.update(_declared(ins))


def test_cpu_is_the_default_and_the_documented_cuda_build_args_exist(dockerfile) -> None:
    preamble, stages = dockerfile
    args = {}
    for ins in preamble + [i for s in stages for i in s.all("ARG")]:
        name, _, default = ins.value.partition("=")
        args[name] = default.strip('"')
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    header = DOCKERFILE.read_text()
    documented = re.findall(r"--build-arg (\w+)=(\S+)", header)
    assert documented, "the Dockerfile's header shows how to build the CUDA variant"
    for name, _ in documented:
        assert name in args, f"the header documents --build-arg {name}, which the Dockerfile lacks"
    assert any(n == "TORCH_INDEX_URL" and "/whl/cu" in v for n, v in documented)


def test_entrypoint_is_elastrun_in_exec_form_under_an_init(dockerfile) -> None:
    _, stages = dockerfile
    runtime = stages[-1]
    (entry,) = runtime.all("ENTRYPOINT")
    # Exec form (a JSON list): shell form would make /bin/sh PID 1, and sh does not pass on SIGTERM.
    argv = json.loads(entry.value)
    assert argv[-1] == "elastrun"
    assert argv[0].endswith("tini") and argv[1] == "--"
    installs = " ".join(i.value for i in runtime.all("RUN"))
    assert re.search(r"apt-get install\b.*\btini\b", installs), "tini must be installed in the runtime stage"
    (cmd,) = runtime.all("CMD")
    assert isinstance(json.loads(cmd.value), list)
    pyproject = _pyproject()
    assert "elastrun" in pyproject["project"]["scripts"], "the entrypoint is the package's console script"


def test_runtime_stage_is_small_and_unprivileged(dockerfile) -> None:
    _, stages = dockerfile
    runtime = stages[-1]
    for ins in runtime.all("RUN"):
        words = set(re.split(r"[\s;&|]+", ins.value))
        assert not words & set(BUILD_TOOLS), f"line {ins.line}: build tools in the runtime image"
        assert "pip" not in words, f"line {ins.line}: install in the build stage, copy the venv"
        if "apt-get" in words:
            assert "--no-install-recommends" in words and "/var/lib/apt/lists/*" in ins.value
    names = [s.name for s in stages]
    for ins in runtime.all("COPY"):
        m = re.search(r"--from=(\S+)", ins.value)
        if m:
            assert m.group(1) in names[:-1], f"line {ins.line}: COPY --from an unknown stage"
    users = runtime.all("USER")
    assert users and users[-1].value not in ("root", "0")


def test_pip_install_extras_exist_in_pyproject(dockerfile) -> None:
    _, stages = dockerfile
    extras = _pyproject()["project"]["optional-dependencies"]
    used = re.findall(r"/src\[([\w,]+)\]", " ".join(i.value for i in stages[0].all("RUN")))
    assert used, "the build stage installs elastrun with its etcd client"
    for name in ",".join(used).split(","):
        assert name in extras, f"pip install /src[{name}]: pyproject.toml has no such extra"


def test_copy_sources_are_in_the_build_context(dockerfile) -> None:
    _, stages = dockerfile
    sources = []
    for stage in stages:
        for ins in stage.all("COPY"):
            if "--from=" in ins.value:
                continue
            words = [w for w in ins.value.split() if not w.startswith("--")]
            sources += words[:-1]
    assert "elastrun" in sources and "pyproject.toml" in sources
    for src in sources:
        assert not excluded_by_dockerignore(src), f"COPY {src}: .dockerignore leaves it out of the context"
        if src in WRITTEN_ELSEWHERE and not (REPO / src).exists():
            continue
        assert (REPO / src).exists(), f"COPY {src}: no such file in the repository"


@pytest.mark.parametrize(
    ("path", "excluded"),
    [
        ("elastrun/cli/dispatch.py", False),
        ("pyproject.toml", False),
        ("examples/train_imagenet_style.py", False),
        (".venv/bin/python", True),
        (".git/HEAD", True),
        ("tests/deploy/test_dockerfile.py", True),
        ("elastrun/__pycache__/cli.cpython-311.pyc", True),
        ("checkpoints/step_100.pt", True),
    ],
)
def test_dockerignore_keeps_the_context_to_what_is_copied(path: str, excluded: bool) -> None:
    assert excluded_by_dockerignore(path) is excluded
