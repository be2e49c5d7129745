"""The quality diagnostics in benchmarks/ that README's findings rest on do what they say."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from gefen_dist import Gefen, reference
from gefen_dist import optimizer as gopt

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


def test_factored_second_moment_is_exact_on_rank_one_squares(monkeypatch):
    """Where g^2 is exactly rank one, AdamW's v is too: the factored diagnostic must then track
    AdamW to within m's quantisation, while row sharing cannot (its columns differ)."""
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    adamw, _ = _run(lambda ps: torch.optim.AdamW(ps, **hyper))
    shared, opt = _run(lambda ps: Gefen(ps, **hyper, bits=8))
    assert opt.memory_report()["tensors"][0]["block_sizes"] == [64]  # one row per block
    for name in ("block_update", "column_update"):
        monkeypatch.setattr(gopt, name, getattr(gopt, name))  # restored after the test
    monkeypatch.setattr(gopt.Gefen, "_impl", gopt.Gefen._impl)
    _script("sharing_ablation")._force_factored(gopt, reference)
    factored, _ = _run(lambda ps: Gefen(ps, **hyper, bits=8))
    err_shared = (shared - adamw).norm() / adamw.norm()
    err_factored = (factored - adamw).norm() / adamw.norm()
    assert err_shared > 0.05, err_shared
    assert err_factored < 0.2 * err_shared, (err_factored, err_shared)
