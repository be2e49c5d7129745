"""An installed wheel runs the C++ CPU kernel, built from the source it ships, and ships what
users run: the package whole, ``python -m gefen_dist.bench`` included, and nothing else.

Why: the kernel's source lives in the top-level ``csrc/``, outside the package; a wheel once
left it behind, and an installed Gefen then ran a slower fallback (1.7x) with only a
warning to show for it. Every test run from a checkout reads ``csrc/`` directly, so nothing else
would notice. One wheel is built straight from the tree (``pip install .``), one from an sdist
(MANIFEST.in), and the first is installed in a fresh venv outside the repository that sees the
system's torch and numba but not the checkout: the editable install's finder in the system site
must not win, and the kernel must build (into an empty cache) from the wheel's copy. The wheel
keeps ``gefen_dist.bench`` and ``gefen_dist.demo`` (pyproject.toml says why): the comparison's
command must start from the install, and ``import gefen_dist`` must not import either.
"""

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PACKAGED = "gefen_dist/_csrc/gefen_cpu.cpp"
# what a build reads, or may leave behind (a stale build/lib would leak into the wheel)
NOT_COPIED = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "results", "runs"
)

STEP = """
import json, os, sys
import torch
import gefen_dist
from gefen_dist import Gefen
from gefen_dist.backends import native_cpu

torch.manual_seed(0)
model = torch.nn.Linear(64, 32)
before = [p.detach().clone() for p in model.parameters()]
opt = Gefen(model.parameters(), lr=1e-2)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(16, 64)).square().mean().backward()
    opt.step()
cache = os.environ["GEFEN_CACHE_DIR"]
print(json.dumps(dict(
    package=gefen_dist.__file__,
    source=str(native_cpu.SOURCE),
    error=native_cpu.build_error(),
    backend=opt.memory_report()["backend"],
    moved=all(bool((a != p).any()) for a, p in zip(before, model.parameters())),
    finite=all(bool(p.isfinite().all()) for p in model.parameters()),
    built=sorted(os.listdir(cache)) if os.path.isdir(cache) else [],
    loaded=sorted(m for m in sys.modules if m.startswith("gefen_dist")),
)))
"""


def _run(cmd: list[str], cwd: Path, timeout: int = 300, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no checkout on the path
    r = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean, **env},
    )
    assert r.returncode == 0, (
        f"{cmd} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    )
    return r.stdout


def _wheel(source: Path, out: Path, cwd: Path) -> Path:
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    _run([*pip, "-w", out, source], cwd)
    (wheel,) = out.glob("gefen_dist-*.whl")
    return wheel


def test_installed_wheel_builds_and_runs_the_packaged_kernel(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=NOT_COPIED)
    wheel = _wheel(src, tmp_path / "tree", tmp_path)
    sdist_code = (
        "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    )
    (tmp_path / "sdist").mkdir()
    name = _run([sys.executable, "-c", sdist_code, tmp_path / "sdist"], src).split()[-1]
    from_sdist = _wheel(tmp_path / "sdist" / name, tmp_path / "from_sdist", tmp_path)

    names = {}
    for w in (wheel, from_sdist):
        with zipfile.ZipFile(w) as z:
            names[w] = {n for n in z.namelist() if ".dist-info/" not in n}
            assert z.read(PACKAGED) == (ROOT / "csrc" / "gefen_cpu.cpp").read_bytes(), w
        assert not [n for n in names[w] if "gefen_cuda" in n], w
    assert names[wheel] == names[from_sdist]
    # the package and nothing of the repository's own: no benchmarks/, research/, launch/, tests/
    assert {n.split("/")[0] for n in names[wheel]} == {"gefen_dist"}, sorted(names[wheel])
    for shipped in ("gefen_dist/bench/__main__.py", "gefen_dist/demo/model.py"):
        assert shipped in names[wheel], shipped

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], tmp_path)
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site_dir = Path(_run([python, "-c", purelib], tmp_path).strip()).resolve()
    if sys.prefix != sys.base_prefix:  # pytest runs in a venv: torch is in its site, not the base's
        bridge = "".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages())
        (site_dir / "_outer_venv.pth").write_text(bridge)
    # --force-reinstall: pip sees the system's editable gefen_dist as installed; it leaves it
    # alone (outside the venv) and installs the wheel in the venv's site-packages all the same
    install = ["-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", wheel]
    _run([python, *install], tmp_path)

    run, cache = tmp_path / "run", tmp_path / "cache"
    run.mkdir()
    out = _run([python, "-c", STEP], run, timeout=600, GEFEN_CACHE_DIR=str(cache))
    got = json.loads(out.strip().splitlines()[-1])
    assert Path(got["package"]).resolve() == site_dir / "gefen_dist" / "__init__.py", got
    assert Path(got["source"]).resolve() == site_dir / PACKAGED, got
    assert got["error"] is None, got
    assert got["backend"] == "native-cpu", got
    assert got["moved"] and got["finite"], got
    assert [n for n in got["built"] if n.startswith("gefen_cpu_") and n.endswith(".so")], got
    assert not [m for m in got["loaded"] if m.startswith(("gefen_dist.bench", "gefen_dist.demo"))]

    # the documented comparison starts from the install: without a subcommand it lists them
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bench = subprocess.run(
        [str(python), "-m", "gefen_dist.bench"],
        cwd=run,
        capture_output=True,
        text=True,
        env=clean,
        timeout=300,
    )
    assert bench.returncode == 2, bench.stderr[-2000:]
    assert all(c in bench.stderr for c in ("compare", "memory", "capacity")), bench.stderr
