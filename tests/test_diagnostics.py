"""The quality diagnostics in benchmarks/ that README's findings rest on do what they say."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from gefen_dist import Gefen
from gefen_dist.method import state

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
