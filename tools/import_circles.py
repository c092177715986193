"""Import circles and crossings in the elastrun package: ``python tools/import_circles.py [PACKAGE_DIR]``.

Reads every module's imports (module level and inside functions; ``if TYPE_CHECKING`` blocks are
left out) and prints:

- the circles among modules;
- the function-level imports that close one (an import moved into a function only to hide a circle);
- the imports that cross a worker's process boundary: the agent's side (:data:`AGENT_SIDE`:
  ``elastrun.agent``, ``elastrun.rendezvous``, ``elastrun.launcher``) and the worker's side
  (:data:`WORKER_SIDE`: ``elastrun.worker``, ``elastrun.train``) import nothing of each other;
- the modules outside :data:`SHARED` (``elastrun.shared``) that both sides reach: a module either
  side imports, directly or through modules of neither side (``elastrun.config``, ``elastrun.observe``
  ...), is loaded in that side's process; one loaded by both must live in ``elastrun.shared``, the
  only code both sides import;
- the imports of ``elastrun.shared`` from outside it (it stays a leaf that both sides can load).

Exit status 1 when there is any of them.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

#: Packages whose code runs in the agent process, and packages whose code runs inside a worker.
AGENT_SIDE = ("elastrun.agent", "elastrun.rendezvous", "elastrun.launcher")
WORKER_SIDE = ("elastrun.worker", "elastrun.train")
#: The only code both sides import.
SHARED = "elastrun.shared"


def side(name: str) -> str | None:
    """``"agent"``, ``"worker"``, ``"shared"`` or None (neither: the CLI, config, observe...)."""
    if name == SHARED or name.startswith(SHARED + "."):
        return "shared"
    for label, packages in (("agent", AGENT_SIDE), ("worker", WORKER_SIDE)):
        if any(name == p or name.startswith(p + ".") for p in packages):
            return label
    return None


def module_names(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> dict[str, bool]:
    """Package modules that ``name`` imports -> whether only inside functions."""
    edges: dict[str, bool] = {}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package[: len(package) - child.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in child.names]
            for target in targets:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[target] = edges.get(target, True) and nested
            visit(child, nested)

    visit(ast.parse(path.read_text()), False)
    return edges


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else Path(__file__).resolve().parents[1] / "elastrun")
    known = module_names(root)
    edges = {name: imports(name, path, known) for name, path in known.items()}
    found = circles({name: set(targets) for name, targets in edges.items()})
    top = {name: {t for t, late in targets.items() if not late} for name, targets in edges.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(top.get(node, ()))
        return False

    hiding = sorted((name, t) for name, targets in edges.items() for t, late in targets.items()
                    if late and reaches(t, name))  # fmt: skip
    crossing = sorted((name, t) for name, targets in edges.items() for t in targets
                      if {side(name), side(t)} == {"agent", "worker"})  # fmt: skip
    leaving = sorted((name, t) for name, targets in edges.items() for t in targets
                     if side(name) == "shared" and side(t) != "shared")  # fmt: skip

    def loaded_by(label: str) -> set[str]:
        """Modules of neither side that code of side ``label`` imports, directly or through others of neither side."""
        out: set[str] = set()
        todo = [t for name, targets in edges.items() if side(name) == label for t in targets]
        while todo:
            node = todo.pop()
            if side(node) is None and node not in out and node != "elastrun":  # the root: lazy, loaded by all
                out.add(node)
                todo.extend(edges.get(node, ()))
        return out

    both = sorted(loaded_by("agent") & loaded_by("worker"))
    print(f"circles: {found or 'none'}")
    print(f"function-level imports that close a circle: {hiding or 'none'}")
    print(f"imports across a worker's process boundary (agent side <-> worker side): {crossing or 'none'}")
    print(f"modules outside {SHARED} that both sides import: {both or 'none'}")
    print(f"imports from {SHARED} of modules outside it: {leaving or 'none'}")
    return 1 if found or hiding or crossing or both or leaving else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
