"""Where a CPU step's time goes: the Python around the kernel and the update, beside fused
AdamW's whole step and torch's ``p += g`` on the same tensors, in one process.

Why: what to change next depends on which part holds the gap to fused AdamW. The parts come from
the kept tables (``cpu_plan.CpuPlan``): the update's call run alone (for tensors held whole it
takes the factor's sums in its own read of g, so there is no factor pass to time apart), and
the Python is the whole step with the call left out. Each part is timed alone, in a loop of its
own, so the parts need not add up to the whole step (a part repeated finds more of its data in
cache). ``p += g`` (``torch._foreach_add_``) reads p and g and writes p, the update's own
traffic in parameters and gradients without its arithmetic, so its time is what the update
would take here if only those bytes counted; fused AdamW moves m and v as well. Timed rounds
alternate between the five, with ``kernel_ab.alternate``.

    python benchmarks/step_parts.py [--sets gpt,100m] [--bits 4,8] [--threads 1]
        [--rounds 7] [--json out.json]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernel_ab import alternate, arguments  # noqa: E402
from step_speed import Feed, make_problem, save  # noqa: E402

from gefen_dist import Gefen  # noqa: E402

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)  # step_speed.py's
PARTS = ("gefen_step", "update", "python", "adamw_fused", "p_plus_g")


def copies(which: str) -> tuple[list[torch.Tensor], list[torch.Tensor], Feed, Feed]:
    """A second set of the same parameters, for fused AdamW and ``p += g``, and for each set
    its feed of the same gradient sequence."""
    params, grads = make_problem(which)
    out = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for a, p in zip(out, params, strict=True):
        a.grad = p.grad.clone()
    return params, out, Feed(params, grads), Feed(out, grads)


def parts(which: str, bits: int, rounds: int) -> dict:
    params, other, feed, feed_other = copies(which)
    opt = Gefen(params, bits=bits, **HYPER)
    adamw = torch.optim.AdamW(other, fused=True, **HYPER)
    for _ in range(2):
        opt.step()
        adamw.step()
        feed()
        feed_other()
    plan = opt._plan
    if plan is None or len(plan.cross):
        sys.exit(f"{which}, {bits} bits: the step did not run on the kept C++ tables alone")
    grads = [p.grad for p in other]

    @torch.no_grad()
    def p_plus_g():
        torch._foreach_add_(other, grads)

    def python():  # the whole step with the kernel's call left out
        plan.step.run = lambda: None
        try:
            opt.step()
        finally:
            del plan.step.run  # the class's method again

    run = dict(
        gefen_step=opt.step,
        update=plan.step.run,
        python=python,
        adamw_fused=adamw.step,
        p_plus_g=p_plus_g,
    )
    feeds = [feed_other if k in ("adamw_fused", "p_plus_g") else feed for k in PARTS]
    times = dict(zip(PARTS, alternate([run[k] for k in PARTS], which, rounds, feeds), strict=True))
    med = {k: statistics.median(v) for k, v in times.items()}
    row = dict(
        set=which,
        bits=bits,
        params=sum(p.numel() for p in params),
        **{f"{k}_ms": med[k] for k in PARTS},
        ratio_to_adamw=med["gefen_step"] / med["adamw_fused"],
        rounds=times,
    )
    print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
    return row


def main() -> None:
    a = arguments(None)
    rows = [
        parts(which, bits, a.rounds)
        for which in a.sets.split(",")
        for bits in map(int, a.bits.split(","))
    ]
    print("| set | bits | Gefen step | update | Python | fused AdamW | p += g | Gefen / AdamW |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['set']} | {r['bits']} | {r['gefen_step_ms']:.2f} ms | "
            f"{r['update_ms']:.2f} ms | {r['python_ms']:.2f} ms | "
            f"{r['adamw_fused_ms']:.2f} ms | {r['p_plus_g_ms']:.2f} ms | "
            f"{r['ratio_to_adamw']:.2f}x |"
        )
    if a.json:
        save(a.json, rows, threads=a.threads, rounds=a.rounds)


if __name__ == "__main__":
    main()
