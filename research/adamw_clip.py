"""AdamW with the sixth study's clip of m (issue 43, ``research/results/high_lr_clip.md``).

Why: the probe's ``mcol,mcol0,cliponly`` clips Gefen's stored m to the envelope |m_ij| <= r_i s_j
(r_i the row's largest |m|, s_j the column's largest share of a row's max |g0|), and that moved
Gefen at 3x AdamW's best lr on lstm by more than its codes cost. Whether it fixes something
Gefen loses or damps any optimizer at a high lr is told by AdamW under the same clip:
``adamw_clip`` (fp32 m and v, torch.optim.AdamW's update; after each step every 2-D or larger
tensor's m, viewed as (rows, row length), clipped so; the step itself moved with the unclipped
m, as Gefen's does). On lstm, gru_wide and the suite's GRU every Gefen block is a row, so the
clip is the probe's; on gpt2 three tensors are blocked otherwise (``transformer.wpe`` in blocks
of two rows, the two ``mlp.c_proj`` in column blocks, which the probe's clip does not reach).

    PYTHONPATH=. python research/high_lr_rnn.py --task lstm --lrs 0.1 --optimizers adamw,adamw_clip
"""

from __future__ import annotations

import torch

from gefen_dist.bench import peers
from research.high_lr_probe import column_scale


class ClipAdamW(torch.optim.AdamW):
    """torch.optim.AdamW, its m clipped after each step to the g0 column envelope."""

    def __init__(self, params, **kw) -> None:
        super().__init__(params, **kw)
        self._scale: dict[torch.Tensor, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dim() >= 2 and p not in self._scale:
                    s = column_scale(p.grad.reshape(p.shape[0], -1).float())
                    # stored as Gefen's probe stores it: bf16, rounded to nearest
                    self._scale[p] = s.to(torch.bfloat16).float()
        loss = super().step(closure)
        for p, s in self._scale.items():
            m = self.state[p].get("exp_avg")
            if m is None:
                continue
            view = m.view(p.shape[0], -1)
            bound = view.abs().amax(dim=1, keepdim=True) * s[None, :]
            torch.maximum(torch.minimum(view, bound), -bound, out=view)
        return loss


def _build(params, model, lr, betas, eps, weight_decay, **_):
    return ClipAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


peers.PEERS.setdefault(
    "adamw_clip", peers.Peer("adamw_clip", "AdamW, m clipped (research)", True, "torch", _build)
)
