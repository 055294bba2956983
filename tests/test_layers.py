"""The layering is a contract: `lint-imports` (pyproject.toml's layers contracts) passes, and no two modules of
onboard/, agents/ or runtime/ import each other, directly or around a loop.

The cycle check counts every import, at module level and inside functions: an import deferred into a
function (to start fast, or to dodge an import-order error) is still a dependency, and a loop through one
is the same tangle (demo.py calling back into cli.py was one). `from pkg import name` is an import of the
module pkg.name when that is a module, else of pkg itself (what Python runs, and how import-linter counts).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKED = ("onboard", "agents", "runtime")


def test_lint_imports_keeps_the_layers_contract():
    # PYTHONPATH: the packages of this tree, not those an editable install points at
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([Path(sys.executable).with_name("lint-imports"), "--no-cache"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages."""
    found = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets |= {_known_prefix(alias.name, known) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else _known_prefix(base, known)
                        for a in node.names}
    return targets - {None, name}


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def _known_prefix(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    for start in sorted(graph):
        if start in state:
            continue
        stack, path = [(start, iter(sorted(graph[start])))], [start]
        state[start] = "open"
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = "done"
                stack.pop()
                path.pop()
            elif state.get(child) == "open":
                return path[path.index(child):] + [child]
            elif child not in state:
                state[child] = "open"
                stack.append((child, iter(sorted(graph.get(child, ())))))
                path.append(child)
    return None


def test_no_import_cycle_among_modules():
    known = modules(REPO, CHECKED)
    graph = {name: imported(name, path, known) for name, path in known.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    """The check itself, on a two-module package whose loop closes inside a function."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "top.py").write_text("from pkg import low\n")
    (tmp_path / "pkg" / "low.py").write_text("def main():\n    from pkg.top import run\n")
    known = modules(tmp_path, ("pkg",))
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert find_cycle(graph) == ["pkg.low", "pkg.top", "pkg.low"]
