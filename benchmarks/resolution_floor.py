"""A diagnostic for the factored second moment at 4 bits: does the quantised m's resolution,
amplified where a position's factor is small, cost the MLP its val loss at high lr?

A stored m is off by up to the level gap around it times its block's absmax, an error an exact m
does not have; the step divides it by sqrt(v_b c_j), so where c_j is small (a digit image's
border pixel) it can move the weight many times further than AdamW's ~lr. ``--variant floor``
runs Gefen through the reference update with each element's denominator at least

    s0 * absmax_b / (1 - b1^t)      s0: the widest gap between the levels on either side of 0

(the bias-corrected absmax the code was stored at), so that an error at that resolution moves
the weight by at most ~lr. ``--variant reference`` is the same reference update without the
floor (the control: the reference's rounding of the last bit is not the C++ kernel's).

    python benchmarks/resolution_floor.py --task mlp --optimizer gefen4 --lr-factor 10 \\
        --seeds 20 --variant floor --out results/resolution_floor.jsonl

Records go to the JSONL of ``sharing_ablation.py``, ``second_moment`` = the variant, so
``benchmarks/paired_table.py`` pairs them with AdamW (run ``sharing_ablation.py --optimizer
gefen4`` at the same lr factor into the same file first: it trains AdamW's seeds too). Measured:
``results/mlp_x10_40_seeds.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import sharing_ablation as sa  # noqa: E402


def _zero_gap(levels):
    import torch

    k = int(torch.searchsorted(levels, torch.zeros((), dtype=levels.dtype)))
    gaps = [levels[i + 1] - levels[i] for i in (k - 1, k) if 0 <= i < levels.numel() - 1]
    return float(max(gaps))


def _floored() -> None:
    """The reference's block and column updates with the resolution floor on the denominator:
    each update records its blocks' floor (from the absmax the codes were stored at) before it
    runs, and the denominator takes the larger of its own value and that floor."""
    import torch

    from gefen_dist import optimizer
    from gefen_dist.backends import reference as ref

    update_blocks, column_update = ref._update_blocks, ref.column_update
    denominator = ref.overshoot_denominator
    held = {}

    def blocks(p, g, st, a, b, rows, h, levels, mids, bits, f) -> None:
        floor = st.absmax[rows] * (_zero_gap(levels) / (1.0 - h.beta1**h.step))
        held["floor"] = lambda shape: floor[:, None]
        update_blocks(p, g, st, a, b, rows, h, levels, mids, bits, f)

    def column(p, g, st, h, levels, mids, bits, factor=None):
        floor = st.absmax * (_zero_gap(levels) / (1.0 - h.beta1**h.step))
        held["floor"] = lambda shape: floor[None, : shape[1]]
        column_update(p, g, st, h, levels, mids, bits, factor)

    def floored(shared, m, g, keep, h):
        return torch.maximum(denominator(shared, m, g, keep, h), held["floor"](shared.shape))

    ref._update_blocks = blocks
    ref.column_update = column
    ref.overshoot_denominator = floored
    optimizer.column_update = column


def _child(task: str, optimizer: str, seed: int, lr_factor: float, variant: str) -> None:
    from gefen_dist import optimizer as gopt

    gopt.Gefen._impl = lambda self, p, g: "reference"
    if variant == "floor":
        _floored()
    elif variant != "reference":
        raise SystemExit(f"--variant: unknown {variant!r}")
    sa._child(task, optimizer, seed, "", 1.0, "as-built", "as-built", lr_factor)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        task, optimizer, seed, lr_factor, variant = sys.argv[2:7]
        _child(task, optimizer, int(seed), float(lr_factor), variant)
        return
    ap = sa.labelled_parser(__doc__)
    ap.add_argument("--variant", required=True, choices=("floor", "reference"))
    args = ap.parse_args()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    extra = [args.variant]
    sa.labelled_runs(
        __file__, args.task, args.optimizer, args.lr_factor, seeds, args.variant, args.out, extra
    )


if __name__ == "__main__":
    main()
