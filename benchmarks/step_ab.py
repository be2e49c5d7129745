"""Two versions of the whole CPU step (Python and kernel) side by side in one process.

``kernel_ab.py`` swaps only the C++ library under one optimizer; a change to the Python around
it (the segment table, the factor's pass) needs the whole package of each version. This loads
``gefen_dist/`` and ``csrc/`` at ``--base`` (a git revision) as a second package,
``gefen_dist_base``, next to the working tree's, and gives each optimizer its own copy of the
same parameters. First, 20 steps from the same start must leave parameters and state
bit-identical (gradients rescaled per step), else the script stops; then timed rounds
alternate between the two, as separate processes here disagree by more than such changes gain.
``--method-change`` skips that check, for a change of what the step computes (each row's
``identical`` is then null).

    python benchmarks/step_ab.py --base REV [--sets gpt,100m] [--bits 4,8]
        [--threads 1] [--rounds 7] [--json out.json] [--method-change]
"""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernel_ab import alternate, arguments, report, result_row  # noqa: E402
from step_speed import Feed, make_problem  # noqa: E402

import gefen_dist  # noqa: E402


def load_base(rev: str, tmp: Path):
    """``gefen_dist`` at ``rev`` as the package ``gefen_dist_base`` (its imports are relative),
    with its own ``csrc/`` beside it, so it builds and loads its own kernel library."""
    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "gefen_dist", "csrc"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(tmp, filter="data")
    pkg = tmp / "gefen_dist_base"
    (tmp / "gefen_dist").rename(pkg)
    spec = importlib.util.spec_from_file_location(
        "gefen_dist_base", pkg / "__init__.py", submodule_search_locations=[str(pkg)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gefen_dist_base"] = mod
    spec.loader.exec_module(mod)
    return mod


def pair(pkgs, which: str, bits: int):
    """Each package's optimizer over its own copy of the same parameters and gradients, and
    its feed of the same gradient sequence."""
    out = []
    for pkg in pkgs:
        params, grads = make_problem(which)
        opt = pkg.Gefen(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, bits=bits)
        out.append((params, opt, Feed(params, grads)))
    return out


def identical(pkgs, which: str, bits: int) -> bool:
    runs = pair(pkgs, which, bits)
    for t in range(20):
        for params, opt, _ in runs:
            scale = torch.Generator().manual_seed(t)
            for p in params:
                p.grad = p.grad * (0.5 + torch.rand(p.shape, generator=scale))
            opt.step()
    (pa, oa, _), (pb, ob, _) = runs
    return all(
        torch.equal(a, b)
        and oa.state[a].keys() == ob.state[b].keys()
        and all(torch.equal(oa.state[a][k], ob.state[b][k]) for k in oa.state[a])
        for a, b in zip(pa, pb, strict=True)
    )


def timed(pkgs, which: str, bits: int, rounds: int) -> list[list[float]]:
    runs = pair(pkgs, which, bits)
    for _, opt, feed in runs:
        for _ in range(2):
            opt.step()
            feed()
    return alternate([opt.step for _, opt, _ in runs], which, rounds, [f for _, _, f in runs])


def main() -> None:
    a = arguments("package", method_change=True)
    base_rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", a.base],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pkgs = [load_base(a.base, Path(tmp)), gefen_dist]
        for which in a.sets.split(","):
            for bits in map(int, a.bits.split(",")):
                if not a.method_change and not identical(pkgs, which, bits):
                    sys.exit(f"{which}, {bits} bits: the two versions' results differ")
                times = timed(pkgs, which, bits, a.rounds)
                rows.append(result_row(which, bits, *times, None if a.method_change else True))
    report(rows, a, base=base_rev)


if __name__ == "__main__":
    main()
