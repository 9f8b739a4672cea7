"""The house points one way: import-linter's contracts in pyproject.toml hold, and no module of
quantlab takes part in an import cycle (function-level and TYPE_CHECKING imports count too)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint_imports = Path(sys.executable).with_name("lint-imports")
    command = str(lint_imports) if lint_imports.exists() else shutil.which("lint-imports")
    assert command, "lint-imports is not installed (pip install -e '.[test]')"
    result = subprocess.run([command, "--no-cache", "--no-logo"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


def _cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(imports.get(module, ())):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(imports):
        if module not in index:
            visit(module)
    return found


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_is_in_an_import_cycle():
    graph = grimp.build_graph("quantlab", cache_dir=None)
    imports = {module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules}
    assert _cycles(imports) == []


def test_a_global_statement_lives_only_in_a_module_that_says_why():
    """State that outlives a call belongs to an object that is handed on (host_share.HostShare); a module that
    keeps one anyway (what its process holds, once per process) says so in its docstring, naming `global`."""
    import ast

    unexplained = []
    for path in sorted((REPO / "quantlab").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(node, ast.Global) for node in ast.walk(tree)) and "`global`" not in (
            ast.get_docstring(tree) or ""
        ):
            unexplained.append(str(path.relative_to(REPO)))
    assert unexplained == []
