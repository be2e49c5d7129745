"""Every launch under tests/dist ends through ``teardown.finish()``.

A gloo rank whose process group is left to interpreter exit can abort there ("terminate called
without an active exception", rc -6) after its results are written, and a whole module's runs
then error in CI (``tests/dist/teardown.py`` says why). A script that forgets the call passes
its own tests nearly always, so the rule is checked here, on the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
DIST = Path(__file__).parent / "dist"


def _launched() -> list[Path]:
    """The scripts torchrun or a launcher runs: those with a ``__main__`` guard."""
    return sorted(p for p in DIST.glob("*.py") if _main_guard(ast.parse(p.read_text())))


def _main_guard(tree: ast.Module) -> ast.If | None:
    for node in tree.body:
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__"
        ):
            return node
    return None


def _ends_with_finish(guard: ast.If) -> bool:
    last = guard.body[-1]
    return (
        isinstance(last, ast.Expr)
        and isinstance(last.value, ast.Call)
        and isinstance(last.value.func, ast.Name)
        and last.value.func.id == "finish"
    )


def test_the_launched_scripts_are_found():
    names = {p.name for p in _launched()}
    assert {"torchtitan_ckpt.py", "reg_accel.py", "fsdp_elastic.py"} <= names, names


@pytest.mark.parametrize("script", _launched(), ids=lambda p: p.name)
def test_a_launched_script_ends_through_finish(script: Path):
    guard = _main_guard(ast.parse(script.read_text()))
    assert _ends_with_finish(guard), (
        f"{script.name}: its __main__ block must end with teardown.finish(), after main()"
    )
    assert "destroy_process_group" not in script.read_text(), (
        f"{script.name}: destroys its group itself; teardown.finish() does, after a collect"
    )
