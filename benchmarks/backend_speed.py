"""Gefen's step under each CPU update backend (the C++ kernel, the reference) in one process.

Why one process, the backends taking turns step by step: a machine busy with other work then
slows them alike, and the ratio to the reference holds where absolute times do not. Each
backend steps its own copy of the same parameters over the same gradients
(``step_speed.py``'s sets); the last backend named is the one the others are divided by. It
decided that the numba update did not earn its place beside the C++ kernel (1.6-1.9x the
reference where the kernel is 34-59x: ``results/step_speed/backends_gpt_*bit.json``, from a
revision that still had it; ``docs/history.md``), and it times the kernel against the
reference the kernel falls back to.

    python benchmarks/backend_speed.py [--set gpt] [--bits 4] [--rounds 40] [--threads 1]
        [--backends native,reference] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from step_speed import Feed, make_problem  # noqa: E402

from gefen_dist import Gefen  # noqa: E402
from gefen_dist.backends.dispatch import BACKENDS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", default="gpt")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--backends",
        default="native,reference",
        help=f"comma list of {', '.join(BACKENDS)}; the last is the one the others divide",
    )
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    names = a.backends.split(",")
    if any(b not in BACKENDS for b in names) or len(set(names)) != len(names):
        ap.error(f"--backends {a.backends!r}: each of {', '.join(BACKENDS)} at most once")
    warnings.simplefilter("ignore")
    torch.set_num_threads(a.threads)
    base, grads = make_problem(a.set)
    runs = {}
    for b in names:
        params = [torch.nn.Parameter(p.detach().clone()) for p in base]
        for p, q in zip(params, base, strict=True):
            p.grad = q.grad.clone()
        opt = Gefen(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, bits=a.bits)
        opt.backend = b
        runs[b] = opt, Feed(params, grads), []
    del base
    for _ in range(3):  # the state, the codebook, the kernel's build
        for opt, feed, _ in runs.values():
            opt.step()
            feed()
    for _ in range(a.rounds):
        for opt, feed, times in runs.values():
            feed()
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    last = list(runs)[-1]
    ref = runs[last][2]
    rows = []
    for b, (opt, _, t) in runs.items():
        rows.append(
            dict(
                set=a.set,
                bits=a.bits,
                threads=a.threads,
                asked=b,
                ran=opt.memory_report()["backend"],
                median_ms=round(1e3 * statistics.median(t), 2),
                min_ms=round(1e3 * min(t), 2),
                **{
                    f"{last}_over_this": round(
                        statistics.median(r / x for r, x in zip(ref, t, strict=True)), 2
                    )
                },
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    if a.json:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        meta = dict(
            command="python " + " ".join(sys.argv),
            revision=rev,
            cpu=platform.processor() or platform.machine(),
            cores=os.cpu_count(),
            torch=torch.__version__,
            load_after=round(os.getloadavg()[0], 2),
        )
        a.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
