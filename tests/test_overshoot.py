"""The regression guard of issue 43 (Gefen at 3x AdamW's best lr on a recurrent model).

A block's shared v lets an element whose own signal outgrows the block's estimate step further
than AdamW would; at a high lr those steps overshoot, which is how Gefen fell apart on the LSTM
at 3x its best lr (``research/results/high_lr_osc.md``). The update's rule
(``reference.overshoot_denominator``) bounds the step of every element whose gradient has turned
against its m to lr: there the denominator is at least |m_hat|. These tests train the suite's
LSTM at that lr and check the bound on every blocked element of every step, for each backend
that runs here, and that the same run without the rule breaks it (so the guard can fail).

The second bound is AdamW's own floor (``reference.adamw_floor``): AdamW's sqrt(v-hat) is never
below |g| sqrt(1 - b2) / sqrt(1 - b2^t), and neither may Gefen's denominator be. Without it the
factor, read a step late, let a column whose g^2 jumped step as if it had not, which stalled
gru_wide at 3x its best lr (``research/results/rank_v.md``). So every blocked element's step is
at most lr |m_hat| / (that floor): checked on the same runs, and broken without the floor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from gefen_dist import Gefen
from gefen_dist.backends import reference
from gefen_dist.bench import recurrent, tasks
from gefen_dist.method.codes import read_codes
from gefen_dist.method.hyper import Hyper
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


@dataclass
class Bounds:
    """Over one run, for the blocked elements of every step."""

    turned_worst: float
    """The largest |step| / lr of an element whose gradient opposes its m after the fold."""
    turned: int
    """How many such elements were seen."""
    floor_excess: float
    """The largest (|step| - lr |m_hat| / (|g| g_floor)) / lr: above 0, a denominator below
    AdamW's floor."""
    floor_worst: float
    """The largest |step| over that allowance, among elements that moved more than lr / 10."""
    floored: int
    """How many elements the floor bound (a step within 1e-4 lr of its allowance)."""


def _bounds(backend: str, bits: int) -> Bounds:
    """STEPS steps of the LSTM at LR, each blocked element's step measured against both bounds."""
    task = tasks.TASKS["lstm"]
    inst = tasks.build(task, seed=0)
    params = [p for p in inst.model.parameters() if p.requires_grad]
    opt = Gefen(params, lr=LR, weight_decay=0.1, bits=bits)
    opt.backend = backend
    group = opt.param_groups[0]
    beta1, decay = group["betas"][0], 1.0 - LR * 0.1
    out = Bounds(0.0, 0, -1.0, 0.0, 0)
    for t in range(1, STEPS + 1):
        h = Hyper.of(group, t)
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
                out.turned += int(turned.sum())
                if turned.any():
                    out.turned_worst = max(out.turned_worst, float(moved[turned].max()))
                allowed = (m / h.bc1).abs() / (g[sl].float().abs() * h.g_floor)
                excess = moved - allowed
                out.floored += int((excess.abs() < 1e-4).sum())
                out.floor_excess = max(out.floor_excess, float(excess.max()))
                big = moved > 0.1
                if big.any():
                    out.floor_worst = max(out.floor_worst, float((moved / allowed)[big].max()))
    return out


@functools.cache
def _run(backend: str, bits: int) -> Bounds:
    return _bounds(backend, bits)


@pytest.fixture(autouse=True)
def _registered():
    recurrent.register_tasks()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("backend", ["reference", "native"])
def test_an_element_whose_gradient_turned_steps_at_most_lr(backend, bits):
    b = _run(backend, bits)
    assert b.turned > 1000, b  # the run turns plenty of elements: the bound is exercised
    assert b.turned_worst <= 1.0 + 1e-4, b


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("backend", ["reference", "native"])
def test_no_denominator_is_below_adamws_floor(backend, bits):
    b = _run(backend, bits)
    assert b.floored > 1000, b  # the floor binds on plenty of elements: the bound is exercised
    assert b.floor_excess <= 1e-4, b


def test_without_the_rule_the_lstm_oversteps(monkeypatch):
    """The guard's control: the shared denominator alone lets turned elements step past lr."""
    monkeypatch.setattr(reference, "overshoot_denominator", lambda s, m, g, keep, h: s + 0.0)
    b = _bounds("reference", 8)
    assert b.turned > 1000, b
    assert b.turned_worst > 2.0, b


def test_without_the_floor_denominators_fall_below_adamws(monkeypatch):
    """The floor's control: without it, denominators go well below AdamW's floor."""
    monkeypatch.setattr(reference, "adamw_floor", lambda d, g, h: d)
    b = _bounds("reference", 8)
    assert b.floor_worst > 2.0, b
