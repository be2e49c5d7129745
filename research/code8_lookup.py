"""The 8-bit coding's level lookup alone, beside fused AdamW's whole step, per element, one core.

Why: the 8-bit step stays above fused AdamW on one thread, and most of the gap is the coding
(the nearest of 256 levels). This asks whether a lookup without memory gathers could close it.
``code8_lookup.cpp``, built with the kernel's compiler and flags, times three passes over
block-sized slices of x = g / absmax from the demo GPT's first gradients (rows of each matrix,
as Gefen's g0 histogram sees them), with an 8-bit codebook learned from their histogram:

- ``gathers``: the kernel's own ``requantize_range`` (its source is built in): two 8-lane
  gathers of (base, next midpoint) per 16 elements from the 8192-cell grid;
- ``search``: a branch-free binary search over the midpoints held in registers, no memory
  lookups;
- ``floor``: the same load, cell arithmetic and store with no lookup at all.

The first two must give ``codes.quantize``'s codes for every element, else the script stops.
Then fused AdamW steps the 100M set (``step_speed.py``'s) in this process, for its time per
element. Needs AVX-512 (the kernel's 8-bit gathers are AVX-512's).

    python research/code8_lookup.py [--elements 32768] [--rounds 15] [--json out.json]
"""

from __future__ import annotations

import argparse
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

from step_speed import Feed, make_problem, save  # noqa: E402

from gefen_dist.backends import native_cpu  # noqa: E402
from gefen_dist.method import codebook  # noqa: E402
from gefen_dist.method.codes import midpoints, quantize  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "code8_lookup.cpp"
WAYS = ("gathers", "search", "floor")


def block_values(elements: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The demo GPT's first gradients, each matrix row divided by its absmax: all of them (for
    the histogram) and ``elements`` drawn from them (to code)."""
    params, _ = make_problem("gpt", 1)
    rows = [p.grad.reshape(p.shape[0], -1) for p in params if p.dim() == 2]
    x = torch.cat(
        [(r / r.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)).flatten() for r in rows]
    )
    pick = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))[:elements]
    return x, x[pick].contiguous()


def lookups(
    levels: torch.Tensor, mids: torch.Tensor, x: torch.Tensor, rounds: int
) -> tuple[dict, torch.Tensor]:
    cxx = native_cpu._compiler()
    if cxx is None:
        sys.exit("no C++ compiler")
    flags = [f for f in native_cpu._flags() if f not in ("-shared", "-fPIC")]
    flags.append(f"-I{native_cpu.SOURCE.parent}")
    with tempfile.TemporaryDirectory() as tmp:
        exe, data, out = (Path(tmp) / n for n in ("code8", "in.bin", "out.bin"))
        build = subprocess.run(
            [cxx, *flags, str(SOURCE), "-o", str(exe)], capture_output=True, text=True
        )
        if build.returncode:
            sys.exit(f"{SOURCE.name} did not build:\n{build.stderr[-2000:]}")
        n = torch.tensor([x.numel()], dtype=torch.int32)
        data.write_bytes(
            b"".join(t.float().numpy().tobytes() for t in (levels, mids))
            + n.numpy().tobytes()
            + x.numpy().tobytes()
        )
        run = subprocess.run(
            [str(exe), str(data), str(out), str(rounds)], capture_output=True, text=True
        )
        if run.returncode:
            sys.exit(f"{SOURCE.name} failed: {run.stderr.strip()}")
        times = {name: float(ns) for name, ns in (ln.split() for ln in run.stdout.splitlines())}
        codes = torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.int32).view(len(WAYS), -1)
    return times, codes


def adamw_ns(rounds: int) -> float:
    """Fused AdamW's step on the 100M set, ns per element (median of rounds of two steps)."""
    params, grads = make_problem("100m", 2)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    feed = Feed(params, grads)
    opt.step()
    n = sum(p.numel() for p in params)
    out = []
    for _ in range(rounds):
        total = 0.0
        for _ in range(2):
            feed()
            t0 = time.perf_counter()
            opt.step()
            total += time.perf_counter() - t0
        out.append(total / 2 / n * 1e9)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=32768, help="a multiple of 16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.elements <= 0 or a.elements % 16:
        ap.error(f"--elements must be a positive multiple of 16, got {a.elements}")
    torch.set_num_threads(1)
    if native_cpu.isa() not in ("avx512", "avx512vbmi"):
        sys.exit(f"the kernel's 8-bit gathers are AVX-512's; this build is {native_cpu.isa()}")
    every, x = block_values(a.elements)
    levels = codebook.learn_codebook(codebook.histogram(every), 8)
    mids = midpoints(levels)
    times, codes = lookups(levels, mids, x, a.rounds)
    want = quantize(x, mids).to(torch.int32)
    for k, name in enumerate(WAYS[:2]):
        wrong = int((codes[k] != want).sum())
        if wrong:
            sys.exit(f"{name}: {wrong} of {x.numel()} codes differ from codes.quantize")
    adamw = adamw_ns(a.rounds)
    rows = [dict(way=w, ns_per_element=times[w], of_adamw_step=times[w] / adamw) for w in WAYS]
    rows.append(dict(way="adamw_fused_step_100m", ns_per_element=adamw, of_adamw_step=1.0))
    for r in rows:
        print(f"{r['way']:>22} {r['ns_per_element']:7.3f} ns/element  {r['of_adamw_step']:.2f}x")
    if a.json:
        save(a.json, rows, elements=a.elements, rounds=a.rounds, threads=1)


if __name__ == "__main__":
    main()
