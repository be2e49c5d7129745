"""The quality diagnostics in benchmarks/ that README's findings rest on do what they say."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from gefen_dist import Gefen
from gefen_dist.method import state

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(make, steps=6):
    """Final parameter after ``steps`` steps of ``make(params)`` on rank-1 g^2: g_ij = a_i b_j s_ij
    with random signs s, rows far apart in scale and columns less so."""
    torch.manual_seed(0)
    a = torch.exp(1.5 * torch.randn(96, 1))
    b = torch.exp(0.6 * torch.randn(1, 64))
    p = torch.nn.Parameter(torch.zeros(96, 64))
    opt = make([p])
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        signs = torch.randint(0, 2, (96, 64), generator=gen).float() * 2 - 1
        p.grad = a * b * signs
        opt.step()
    return p.detach().clone(), opt


def test_cross_factor_is_exact_on_rank_one_squares(monkeypatch):
    """Where g^2 is exactly rank one, AdamW's v is too: Gefen's factored v must then track AdamW
    to within m's quantisation, while the shared-v diagnostic (one v per row, the seeds' rule)
    cannot, its columns differing."""
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    adamw, _ = _run(lambda ps: torch.optim.AdamW(ps, **hyper))
    factored, opt = _run(lambda ps: Gefen(ps, **hyper, bits=8))
    assert opt.memory_report()["tensors"][0]["block_sizes"] == [64]  # one row per block
    assert opt.state[opt.param_groups[0]["params"][0]]["v_cross"].numel() == 64
    monkeypatch.setattr(state, "cross_length", state.cross_length)  # restored after the test
    _script("sharing_ablation")._force_shared()
    shared, opt = _run(lambda ps: Gefen(ps, **hyper, bits=8))
    assert opt.state[opt.param_groups[0]["params"][0]]["v_cross"].numel() == 0
    err_shared = (shared - adamw).norm() / adamw.norm()
    err_factored = (factored - adamw).norm() / adamw.norm()
    assert err_shared > 0.05, err_shared
    assert err_factored < 0.2 * err_shared, (err_factored, err_shared)


@pytest.mark.parametrize("blocks", ["rows", "columns"])
def test_resolution_floor_only_shortens_steps(monkeypatch, blocks):
    """``resolution_floor.py --variant floor`` raises a denominator only where the factor would
    divide m's resolution by less than it: on the same gradients (m, v and the codes do not
    depend on the denominator, so both runs keep the same state) no element steps further than
    through the plain reference update, the rare position's steps are shorter, and nearly all
    the others' are the reference's. Row blocks get a factor per column, column blocks one per
    row; the gradients' scales make the partition choose each."""
    from gefen_dist import optimizer
    from gefen_dist.backends import reference

    hyper = dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0, bits=4)
    torch.manual_seed(2)
    if blocks == "rows":  # rows far apart, columns less so: a block per row, c per column
        scale = torch.exp(1.5 * torch.randn(96, 1)) * torch.exp(0.6 * torch.randn(1, 64))
        rare = (slice(None), 7)
    else:  # the other way round: a block per column, c per row
        scale = torch.exp(0.6 * torch.randn(96, 1)) * torch.exp(1.5 * torch.randn(1, 64))
        rare = (7, slice(None))
    scale[rare] = 1e-3  # a rarely lit input: its factor sits at CROSS_FLOOR

    def steps(floored: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(96, 64))
        opt = Gefen([p], **hyper)
        opt._impl = lambda p, g: "reference"
        if floored:
            for mod, name in (
                (reference, "_update_blocks"),
                (reference, "column_update"),
                (reference, "overshoot_denominator"),
                (optimizer, "column_update"),
            ):
                monkeypatch.setattr(mod, name, getattr(mod, name))
            _script("resolution_floor")._floored()
        gen = torch.Generator().manual_seed(1)
        moved = []
        for _ in range(8):
            before = p.detach().clone()
            p.grad = torch.randn(96, 64, generator=gen) * scale
            opt.step()
            moved.append((p.detach() - before).abs())
        want = 64 if blocks == "rows" else -64
        assert opt.memory_report()["tensors"][0]["block_sizes"] == [want]
        return moved

    plain, floored = steps(False), steps(True)
    others = torch.ones(96, 64, dtype=torch.bool)
    others[rare] = False
    ulp = 2e-6  # a step is read as a difference of parameters of up to ~4: a few of their ulps
    for a, b in zip(plain, floored, strict=True):
        assert (b <= a + ulp).all()
        assert ((b - a).abs() <= ulp)[others].float().mean() > 0.95  # the floor rarely binds
    shorter = [
        float((b[rare] < 0.9 * a[rare]).float().mean()) for a, b in zip(plain, floored, strict=True)
    ]
    assert max(shorter) > 0.5, shorter
