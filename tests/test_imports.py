"""The package's import graph: no cycle, and imports that run one way.

Read from the source (ast), not from ``sys.modules``: imports inside functions count (they run
too, only later), ``if TYPE_CHECKING:`` blocks do not (they never run), and so do
``importlib.import_module("gefen_dist....")`` calls, which an import statement would hide.
"""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PKG = Path(__file__).resolve().parents[1] / "gefen_dist"

LAYERS = {
    "gefen_dist.method": 0,
    "gefen_dist.distributed": 1,
    "gefen_dist.backends": 2,
    "gefen_dist": 3,
    "gefen_dist.integrations": 4,
    "gefen_dist.demo": 5,
    "gefen_dist.checkpoint": 5,
    "gefen_dist.bench": 6,
}
"""Who may import whom: a module imports only modules of its own layer or a lower one. The method
(how blocks, codebook, codes and state work) knows no backend or framework; the torch.distributed
helpers (a rank's pieces, the first step's agreements) build on it, the backends on both; the
optimizer's own modules (``gefen_dist.*`` at the
top) on those; the framework integrations on the optimizer; the demo and the suite on all."""

FRAMEWORKS = {
    "deepspeed": {"gefen_dist.integrations.deepspeed"},
    "torch.distributed.fsdp": {
        "gefen_dist.integrations.fsdp",
        "gefen_dist.bench.capacity",
        "gefen_dist.bench.dcp_memory",
    },
    "torchtitan": {"gefen_dist.integrations.torchtitan"},
}
"""A framework's own imports and the one module (or package) that may make them: its integration
(and, for FSDP, the suite's capacity probe, which measures the largest microbatch under FSDP2,
and the checkpoint memory benchmark, which loads under FSDP2)."""


def _layer(module: str) -> str:
    """The package a module's layer is named by: a subpackage, or ``gefen_dist`` for the
    optimizer's own top-level modules (and the package's __init__, the public surface)."""
    parts = module.split(".")
    sub = ".".join(parts[:2])
    return sub if sub in LAYERS and len(parts) > 2 or module in LAYERS else "gefen_dist"


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


def test_imports_run_one_way():
    """Integrations, the demo and the suite import the optimizer, never the reverse, and the
    method imports nothing of its users. The package's __init__ (the public surface) may import
    the registration hook, which is how ``import gefen_dist`` binds a loaded DeepSpeed."""
    graph = _graph()
    bad = []
    for m, deps in graph.items():
        for d in deps:
            lm, ld = _layer(m), _layer(d)
            if m == "gefen_dist" and d.startswith("gefen_dist.integrations"):
                continue
            if LAYERS[ld] > LAYERS[lm]:
                bad.append(f"{m} ({lm}) imports {d} ({ld})")
    assert not bad, "\n".join(bad)


def test_the_layer_rule_can_fail():
    assert _layer("gefen_dist.method.codes") == "gefen_dist.method"
    assert _layer("gefen_dist.optimizer") == "gefen_dist"
    assert _layer("gefen_dist.backends") == "gefen_dist.backends"
    assert LAYERS[_layer("gefen_dist.integrations.fsdp")] > LAYERS[_layer("gefen_dist.optimizer")]


def test_every_module_is_in_a_layer():
    """A new subpackage must be placed in LAYERS, not fall into the top level unnoticed."""
    subs = {".".join(("gefen_dist", d.name)) for d in PKG.iterdir() if (d / "__init__.py").exists()}
    assert subs <= set(LAYERS), subs - set(LAYERS)


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_a_framework_is_imported_only_by_its_integration(framework):
    users = {
        _module(f) for f in PKG.rglob("*.py") if any(_within(i, framework) for i in _imports(f))
    }
    stray = {u for u in users if not any(_within(u, m) for m in FRAMEWORKS[framework])}
    assert not stray, stray


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")
