"""``sharing_ablation.py --second-moment shared`` for chosen tensors only: Gefen as built, but
the tensors whose name contains one of ``--no-factor`` patterns keep no cross factor (one v per
block, ``_force_shared`` applied to them alone). Says which tensor's factor costs what.

    python benchmarks/factor_off.py --task mlp --optimizer gefen4 --lr-factor 10 --seeds 20 \\
        --no-factor 1.weight --out results/mlp_high_lr.jsonl

Records go to the same JSONL as ``sharing_ablation.py``'s, with ``second_moment`` =
``no factor: PATTERNS``, so ``benchmarks/paired_table.py`` pairs them with AdamW (which this
script does not train: run ``sharing_ablation.py`` at the same lr factor first). The factor is
switched off by the tensor's size, the one thing ``state.cross_length`` sees, after checking
that no other parameter of the model has that size.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import sharing_ablation as sa  # noqa: E402


def _child(task: str, optimizer: str, seed: int, lr_factor: float, patterns: list[str]) -> None:
    from gefen_dist.bench import sweep, tasks
    from gefen_dist.method import state

    spec = sweep.swept(tasks.TASKS[task], lr_factor)
    params = [(n, p.numel()) for n, p in tasks.build(spec, seed).model.named_parameters()]
    off = {k for n, k in params if any(pat in n for pat in patterns)}
    clash = [n for n, k in params if k in off and not any(pat in n for pat in patterns)]
    if clash:
        raise SystemExit(f"sizes not unique: {clash} share a size with {patterns}")
    keep = state.cross_length
    state.cross_length = lambda b, numel: 0 if numel in off else keep(b, numel)
    sa._child(task, optimizer, seed, "", 1.0, "as-built", "as-built", lr_factor)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        task, optimizer, seed, lr_factor, pats = sys.argv[2:7]
        _child(task, optimizer, int(seed), float(lr_factor), pats.split(","))
        return
    ap = sa.labelled_parser(__doc__)
    ap.add_argument("--no-factor", required=True, help="comma-separated name patterns")
    args = ap.parse_args()
    label = f"no factor: {args.no_factor}"
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    sa.labelled_runs(
        __file__,
        args.task,
        args.optimizer,
        args.lr_factor,
        seeds,
        label,
        args.out,
        [args.no_factor],
    )


if __name__ == "__main__":
    main()
