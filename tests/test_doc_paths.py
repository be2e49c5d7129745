"""Every file of benchmarks/, results/ and research/ that README and the docs name exists.

Why: the evidence behind README's figures and the research behind the design live in files the
docs point to by path (``docs/evidence.md``, ``research/README.md`` index them). When a file
moves or goes, a stale path still reads as a citation; this finds it. Globs (``cpu_*.json``)
and brace lists (``run{1,2,3}.json``) must match at least one file each.
"""

import glob
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    ROOT / "csrc" / "README.md",
    ROOT / "research" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
PATH = re.compile(
    r"(?<![\w/.-])((?:research/)?(?:results|benchmarks)/[\w./*{},-]*[\w*}]|research/[\w./*{},-]*[\w*}])"
)


def _expand(token: str) -> list[str]:
    if "{" in token and "}" in token:
        head, rest = token.split("{", 1)
        options, tail = rest.split("}", 1)
        return [head + o + tail for o in options.split(",")]
    return [token]


def cited(text: str) -> set[str]:
    """The repository paths under benchmarks/, results/ or research/ that ``text`` names."""
    return {m.group(1) for m in PATH.finditer(text)}


def test_cited_finds_paths_globs_and_brace_lists():
    text = "see `results/step_speed/cpu_*.json` and research/results/run{1,2}.json; benchmarks/"
    assert cited(text) == {"results/step_speed/cpu_*.json", "research/results/run{1,2}.json"}
    assert _expand("a/run{1,2}.json") == ["a/run1.json", "a/run2.json"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc):
    missing = [
        name
        for token in sorted(cited(doc.read_text()))
        for name in _expand(token)
        if not glob.glob(str(ROOT / name))
    ]
    assert not missing, f"{doc.relative_to(ROOT)} names files that are not there: {missing}"
