"""What the factored second moment costs a CPU step: Gefen as built against Gefen without
``v_cross`` (the seeds' shared v), in one process, on the same parameters and gradients.

Separate processes are too noisy on this machine for a difference of this size (the same
revision's demo-GPT step measured 9.7 and 17.2 ms in two runs of ``step_speed.py``), so the
three optimizers live in one process and their timed rounds alternate; the medians over rounds
are compared.

    python benchmarks/factor_cost.py [--sets gpt,100m] [--bits 4,8] [--rounds 7] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)  # step_speed.py's
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _shared(params: list[torch.nn.Parameter], bits: int):
    """A Gefen whose tensors keep no v_cross: its state is allocated under
    ``sharing_ablation._force_shared``, which is undone afterwards."""
    from sharing_ablation import _force_shared

    from gefen_dist import Gefen
    from gefen_dist.method import state

    real = state.cross_length
    _force_shared()
    try:
        opt = Gefen(params, bits=bits, **HYPER)
        opt.step()  # the state is allocated at the first step
    finally:
        state.cross_length = real
    return opt


def measure(which: str, bits: int, rounds: int, steps: int) -> dict:
    from step_speed import make_params

    from gefen_dist import Gefen

    built = make_params(which)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in built]
    for a, b in zip(built, twin, strict=True):
        b.grad = a.grad.clone()
    opts = {"factored": Gefen(built, bits=bits, **HYPER), "shared": _shared(twin, bits)}
    opts["factored"].step()
    times: dict[str, list[float]] = {k: [] for k in opts}
    for _ in range(rounds):
        for name, opt in opts.items():
            t = time.perf_counter()
            for _ in range(steps):
                opt.step()
            times[name].append((time.perf_counter() - t) / steps * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    mem = {k: o.memory_report() for k, o in opts.items()}
    return dict(
        set=which,
        bits=bits,
        factored_ms=med["factored"],
        shared_ms=med["shared"],
        ratio=med["factored"] / med["shared"],
        factored_bytes_per_param=mem["factored"]["bytes_per_param"],
        shared_bytes_per_param=mem["shared"]["bytes_per_param"],
        backend=mem["factored"]["backend"],
        rounds=times,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="gpt")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = []
    print("| set | bits | as built (factored) | shared v | ratio | B/param factored | shared |")
    print("|---|---|---|---|---|---|---|")
    for which in args.sets.split(","):
        for bits in (int(b) for b in args.bits.split(",")):
            r = measure(which, bits, args.rounds, args.steps)
            out.append(r)
            print(
                f"| {which} | {bits} | {r['factored_ms']:.1f} ms | {r['shared_ms']:.1f} ms | "
                f"{r['ratio']:.2f}x | "
                f"{r['factored_bytes_per_param']:.3f} | "
                f"{r['shared_bytes_per_param']:.3f} |",
                flush=True,
            )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(threads=args.threads, runs=out), indent=1))


if __name__ == "__main__":
    main()
