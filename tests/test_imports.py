"""The package's import graph: no cycle, and imports that run one way.

Read from the source (ast), not from ``sys.modules``: imports inside functions count (they run
too, only later), ``if TYPE_CHECKING:`` blocks do not (they never run), and so do
``importlib.import_module("gefen_dist....")`` calls, which an import statement would hide.
"""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "gefen_dist"

INTEGRATIONS = {"gefen_dist.fsdp", "gefen_dist.deepspeed", "gefen_dist.register"}
FRAMEWORKS = {
    "deepspeed": {"gefen_dist.deepspeed"},
    "torch.distributed.fsdp": {"gefen_dist.fsdp", "gefen_dist.bench.capacity"},
}
"""A framework's own imports and the one module that may make them: its integration (and, for
FSDP, the suite's capacity probe, which measures the largest microbatch under FSDP2)."""


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports at run time (absolute names)."""
    me = _module(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module or ""
            if node.module:  # `from . import x` imports x, not the package it is in
                out.add(root)
            for a in node.names:  # x of `from m import x` may be a module
                out.add(f"{root}.{a.name}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.add(node.args[0].value)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module(f): f for f in PKG.rglob("*.py")}
    return {m: {i for i in _imports(f) if i in files and i != m} for m, f in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := dfs(n)):
                return found
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := dfs(m)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_core_imports_no_integration_demo_or_benchmark():
    """Integrations, the demo and the suite import the optimizer, never the reverse: only the
    package's __init__ (the public surface) and the integrations themselves may import an
    integration."""
    graph = _graph()
    for m, deps in graph.items():
        if m == "gefen_dist" or m in INTEGRATIONS:
            continue
        if m.startswith(("gefen_dist.bench", "gefen_dist.train")):
            continue
        assert not deps & INTEGRATIONS, f"{m} imports {deps & INTEGRATIONS}"
        bad = {d for d in deps if d.startswith("gefen_dist.bench") or d == "gefen_dist.train"}
        assert not bad, f"{m} imports {bad}"


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_a_framework_is_imported_only_by_its_integration(framework):
    users = {
        _module(f)
        for f in PKG.rglob("*.py")
        if any(i == framework or i.startswith(framework + ".") for i in _imports(f))
    }
    assert users <= FRAMEWORKS[framework], users - FRAMEWORKS[framework]
