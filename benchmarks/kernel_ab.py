"""Two versions of the C++ CPU kernel side by side in one process: same results, which is faster.

Separate processes disagree here by tens of percent, so a kernel change is measured in one
process: the working tree's ``csrc/gefen_cpu.cpp`` and the one at ``--base`` (a git revision)
are built as two libraries, and the optimizer's calls go to one or the other, timed rounds
alternating. First, from the same parameters, 20 steps on each must leave parameters and state
bit-identical (gradients rescaled per step, so the state moves), else the script stops: a
faster kernel that rounds differently is a different optimizer.

    python benchmarks/kernel_ab.py --base REV [--sets gpt,100m] [--bits 4,8]
        [--threads 1] [--rounds 7] [--json out.json]

REV must be later than bdfe59e (before it the kernel had no gefen_cpu_cross_table, which the
optimizer calls); ``step_ab.py`` compares the whole step with older revisions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from step_speed import Feed, make_params, make_problem, save  # noqa: E402

from gefen_dist import Gefen  # noqa: E402
from gefen_dist.backends import native_cpu  # noqa: E402


def build(source: str, tmp: Path, name: str):
    path = tmp / f"{name}.cpp"
    path.write_text(source)
    native_cpu.SOURCE = path
    return native_cpu._build()


def run_steps(lib, which: str, bits: int, steps: int):
    native_cpu._lib = lib
    params = make_params(which)
    opt = Gefen(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, bits=bits)
    for t in range(steps):
        scale = torch.Generator().manual_seed(t)
        for p in params:
            p.grad = p.grad * (0.5 + torch.rand(p.shape, generator=scale))
        opt.step()
    return params, opt


def identical(libs, which: str, bits: int) -> bool:
    (pa, oa), (pb, ob) = (run_steps(lib, which, bits, 20) for lib in libs)
    return all(
        torch.equal(a, b) and all(torch.equal(oa.state[a][k], ob.state[b][k]) for k in oa.state[a])
        for a, b in zip(pa, pb, strict=True)
    )


def timed(libs, which: str, bits: int, rounds: int) -> list[list[float]]:
    params, grads = make_problem(which)
    feed = Feed(params, grads)
    opt = Gefen(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, bits=bits)
    native_cpu._lib = libs[0]
    for _ in range(2):
        opt.step()
        feed()

    def on(lib):
        def step():
            native_cpu._lib = lib
            opt.step()

        return step

    return alternate([on(lib) for lib in libs], which, rounds, [feed] * len(libs))


def alternate(steppers: list, which: str, rounds: int, feeds: list) -> list[list[float]]:
    """Each stepper's step time (ms) per round, the rounds alternating between them; before each
    step, untimed, its feed (step_speed.Feed) puts the next gradients in place."""
    steps = 20 if which == "gpt" else 2
    out: list[list[float]] = [[] for _ in steppers]
    for _ in range(rounds):
        for i, step in enumerate(steppers):
            total = 0.0
            for _ in range(steps):
                feeds[i]()
                t0 = time.perf_counter()
                step()
                total += time.perf_counter() - t0
            out[i].append(1e3 * total / steps)
    return out


def arguments(what: str | None, method_change: bool = False) -> argparse.Namespace:
    """The options the A/B scripts and step_parts take (``--base``, the revision of ``what`` to
    compare with, where ``what`` is given; ``--method-change`` where ``method_change``); sets
    torch's thread count."""
    ap = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.split("\n")[0])
    if what is not None:
        ap.add_argument("--base", required=True, help=f"git revision of the {what} to compare with")
    if method_change:
        ap.add_argument(
            "--method-change",
            action="store_true",
            help="the versions differ in what they compute by design: skip the identity check",
        )
    ap.add_argument("--sets", default="gpt,100m")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    return a


def main() -> None:
    a = arguments("kernel")
    base = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{a.base}:csrc/gefen_cpu.cpp"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if "gefen_cpu_cross_table" not in base:
        sys.exit(
            f"--base {a.base}: its kernel lacks gefen_cpu_cross_table, which the optimizer here "
            "calls (since the commit after bdfe59e). Compare the whole step with "
            "benchmarks/step_ab.py instead."
        )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        libs = [
            build(base, Path(tmp), "base"),
            build((ROOT / "csrc" / "gefen_cpu.cpp").read_text(), Path(tmp), "here"),
        ]
        for which in a.sets.split(","):
            for bits in map(int, a.bits.split(",")):
                if not identical(libs, which, bits):
                    sys.exit(f"{which}, {bits} bits: the two kernels' results differ")
                rows.append(result_row(which, bits, *timed(libs, which, bits, a.rounds)))
    report(rows, a, base=a.base, isa=native_cpu.isa())


def result_row(
    which: str, bits: int, base_ms: list[float], here_ms: list[float], identical: bool | None = True
) -> dict:
    """``identical``: None where the results were not compared (``--method-change``)."""
    b, h = statistics.median(base_ms), statistics.median(here_ms)
    row = dict(
        set=which,
        bits=bits,
        base_ms=b,
        here_ms=h,
        ratio=h / b,
        base_rounds=base_ms,
        here_rounds=here_ms,
        identical=identical,
    )
    print(json.dumps(row), flush=True)
    return row


def report(rows: list[dict], a: argparse.Namespace, base: str, **meta) -> None:
    """The table of medians, and the JSON (``--json``) with how and where it was measured."""
    print(f"| set | bits | {base} | this tree | ratio | rounds' ranges |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['set']} | {r['bits']} | {r['base_ms']:.2f} ms | {r['here_ms']:.2f} ms | "
            f"{r['ratio']:.2f}x | {min(r['base_rounds']):.2f}-{max(r['base_rounds']):.2f} / "
            f"{min(r['here_rounds']):.2f}-{max(r['here_rounds']):.2f} |"
        )
    if a.json:
        save(a.json, rows, base=base, threads=a.threads, rounds=a.rounds, **meta)


if __name__ == "__main__":
    main()
