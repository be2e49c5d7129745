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

import argparse
import json
import subprocess
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="mlp")
    ap.add_argument("--optimizer", default="gefen4")
    ap.add_argument("--lr-factor", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--no-factor", required=True, help="comma-separated name patterns")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    label = f"no factor: {args.no_factor}"
    src = sa.source_hash()
    done = set()
    if Path(args.out).exists():
        done = {json.loads(line)["key"] for line in Path(args.out).read_text().splitlines()}
    for seed in range(args.seeds):
        key = "|".join(
            map(
                str,
                (args.task, args.optimizer, seed, "", 1.0, args.lr_factor, "as-built", label, src),
            )
        )
        if key in done:
            continue
        cmd = [sys.executable, __file__, "--child", args.task, args.optimizer, str(seed)]
        cmd += [str(args.lr_factor), args.no_factor]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rec = json.loads(out.strip().splitlines()[-1])
        row = dict(
            key=key,
            task=args.task,
            optimizer=args.optimizer,
            seed=seed,
            config="",
            scale=1.0,
            lr_factor=args.lr_factor,
            rounding="as-built",
            second_moment=label,
            src=src,
            **rec,
        )
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(seed, rec["final"]["val_loss"], flush=True)


if __name__ == "__main__":
    main()
