"""The regression guard of issue 43 (Gefen at 3x AdamW's best lr on a recurrent model).

A block's shared v lets an element whose own signal outgrows the block's estimate step further
than AdamW would; at a high lr those steps overshoot, which is how Gefen fell apart on the LSTM
at 3x its best lr (``research/results/high_lr_osc.md``). The update's rule
(``reference.overshoot_denominator``) bounds the step of every element whose gradient has turned
against its m to lr: there the denominator is at least |m_hat|. These tests train the suite's
LSTM at that lr and check the bound on every blocked element of every step, for each backend
that runs here, and that the same run without the rule breaks it (so the guard can fail).
"""

from __future__ import annotations

import pytest
import torch

from gefen_dist import Gefen
from gefen_dist.backends import reference
from gefen_dist.bench import recurrent, tasks
from gefen_dist.method.codes import read_codes
from gefen_dist.method.state import bits_of, segment_views

pytestmark = pytest.mark.unit

LR = 0.1  # 3x AdamW's best lr on the task (research/results/high_lr_rnn.md)
STEPS = 30


def _first_moments(opt: Gefen, params: list[torch.Tensor]) -> dict[int, list]:
    """Per parameter, (offset, numel, m) of each blocked segment: the m the next step starts
    from, as the state stores it (levels[code] * the block's absmax)."""
    out = {}
    for i, p in enumerate(params):
        st = opt.state[p]
        if "layout" not in st:
            continue
        bits, levels = bits_of(st["codebook"]), st["codebook"]
        rows = []
        for offset, seg in segment_views(st):
            if seg.block_size == 1:
                continue
            n, b = seg.numel, seg.block_size
            idx = torch.arange(n)
            block = idx % -b if b < 0 else (seg.start + idx) // b - seg.start // b
            m = levels[read_codes(seg.codes, 0, n, bits).long()] * seg.absmax[block]
            rows.append((offset, n, m))
        out[i] = rows
    return out


def _largest_turned_step(backend: str, bits: int) -> tuple[float, int]:
    """Over STEPS steps of the LSTM at LR: the largest |step| / lr of a blocked element whose
    gradient opposes its m after the step's fold, and how many such elements were seen."""
    task = tasks.TASKS["lstm"]
    inst = tasks.build(task, seed=0)
    params = [p for p in inst.model.parameters() if p.requires_grad]
    opt = Gefen(params, lr=LR, weight_decay=0.1, bits=bits)
    opt.backend = backend
    beta1, decay = opt.param_groups[0]["betas"][0], 1.0 - LR * 0.1
    worst, seen = 0.0, 0
    for _ in range(STEPS):
        loss = inst.loss(inst.model, next(inst.batches))
        opt.zero_grad()
        loss.backward()
        before = [p.detach().clone() for p in params]
        ms = _first_moments(opt, params)
        opt.step()
        for i, rows in ms.items():
            g, p0, p1 = params[i].grad.reshape(-1), before[i].reshape(-1), params[i].reshape(-1)
            for offset, n, m_old in rows:
                sl = slice(offset, offset + n)
                m = torch.lerp(m_old, g[sl].float(), 1.0 - beta1)
                turned = m * g[sl] < 0
                moved = (p1[sl].detach() - p0[sl] * decay).abs() / LR
                seen += int(turned.sum())
                if turned.any():
                    worst = max(worst, float(moved[turned].max()))
    return worst, seen


@pytest.fixture(autouse=True)
def _registered():
    recurrent.register_tasks()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("backend", ["reference", "native"])
def test_an_element_whose_gradient_turned_steps_at_most_lr(backend, bits):
    worst, seen = _largest_turned_step(backend, bits)
    assert seen > 1000, seen  # the run turns plenty of elements: the bound is exercised
    assert worst <= 1.0 + 1e-4, worst


def test_without_the_rule_the_lstm_oversteps(monkeypatch):
    """The guard's control: the shared denominator alone lets turned elements step past lr."""
    monkeypatch.setattr(reference, "overshoot_denominator", lambda s, m, g, keep, h: s + 0.0)
    worst, seen = _largest_turned_step("reference", 8)
    assert seen > 1000, seen
    assert worst > 2.0, worst
