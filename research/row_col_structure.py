"""Where the bench tasks' fallback tensors keep their structure: rows or columns.

Gefen's blocks are runs of consecutive elements (rows, or divisors of a row). For the tensors the
partition leaves at B = 1 in the quality suite (Llama down_proj, the MLP's hidden weight), this
prints, from the first batch's gradient of each seed, the within-row and within-column
heterogeneity of g0^2 (mean Bessel-corrected variance inside a row / column over the tensor's
variance; lower = more alike inside): a clearly lower column figure is structure that contiguous
blocks cannot express. Neighbouring tensors with row structure are printed for contrast.

    python research/row_col_structure.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gefen_dist.bench import tasks  # noqa: E402

TENSORS = {
    "llama": (
        "layers.0.self_attn.q_proj",
        "layers.0.self_attn.k_proj",
        "layers.0.mlp.gate_proj",
        "layers.0.mlp.down_proj",
    ),
    "mlp": ("1.weight", "3.weight"),
    "gru": ("rnn.weight_ih_l0", "rnn.weight_hh_l0", "head.weight"),
}


def heterogeneity(x: torch.Tensor, dim: int) -> float:
    return (x.var(dim=dim, unbiased=True).mean() / x.var(unbiased=True)).item()


def main() -> None:
    print("| task | tensor | shape | seed | within rows | within columns |")
    print("|---|---|---|---|---|---|")
    for name, keys in TENSORS.items():
        for seed in (0, 1, 2):
            inst = tasks.build(tasks.TASKS[name], seed)
            inst.loss(inst.model, next(inst.batches)).backward()
            for n, p in inst.model.named_parameters():
                if p.dim() == 2 and any(n.startswith(k) for k in keys):
                    g2 = p.grad.double() ** 2
                    print(
                        f"| {name} | {n} | {tuple(p.shape)} | {seed} | "
                        f"{heterogeneity(g2, 1):.2f} | {heterogeneity(g2, 0):.2f} |"
                    )


if __name__ == "__main__":
    main()
