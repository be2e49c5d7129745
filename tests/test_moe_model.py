"""The MoE LM of ``gefen_dist.bench.moe``: its four expert storages run, route top-2, hold the
same experts, and compute the same function and the same per-expert gradients.

Why the last: research/moe_partition.md compares the partition's choices across storages on one
first gradient; that comparison means something only if each storage's expert slice carries the
same numbers as the per-expert ``nn.Linear`` weight, in its own orientation."""

from __future__ import annotations

import math

import pytest
import torch

from gefen_dist import Gefen
from gefen_dist.bench import moe
from gefen_dist.bench.moe import STORAGES, MoEConfig, MoELM

pytestmark = pytest.mark.unit

SMALL = dict(dim=32, n_layers=2, n_heads=2, n_experts=8, top_k=2, hidden=24, seq=16)


def _model(storage: str, seed: int = 0) -> MoELM:
    torch.manual_seed(seed)
    return MoELM(MoEConfig(storage=storage, **SMALL))


def _tokens(batch: int = 4, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(7))


def _loss(model: MoELM, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), idx[:, 1:].reshape(-1))


def _copy_from(ref: MoELM, model: MoELM) -> None:
    """Give ``model`` the weights of ``ref`` (another storage): the same non-expert parameters
    by name, and each expert's gate/up/down written through ``expert_weights`` (views)."""
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name in own and (".moe." not in name or name.endswith("router.weight")):
                own[name].copy_(p)
        for la, lb in zip(ref.layers, model.layers, strict=True):
            for e in range(SMALL["n_experts"]):
                for src, dst in zip(
                    la.moe.expert_weights(e), lb.moe.expert_weights(e), strict=True
                ):
                    dst.copy_(src)


@pytest.mark.parametrize("storage", STORAGES)
def test_forward_backward_routes_top2(storage):
    model = _model(storage)
    idx = _tokens()
    loss = _loss(model, idx)
    assert torch.isfinite(loss)
    loss.backward()
    tokens = idx[:, :-1].numel()
    for layer in model.layers:
        counts = layer.moe.last_counts
        # every token goes to exactly top_k distinct experts
        assert int(counts.sum()) == SMALL["top_k"] * tokens
        assert int(counts.max()) <= tokens
        d, f = SMALL["dim"], SMALL["hidden"]
        for e in range(SMALL["n_experts"]):
            shapes = [tuple(w.shape) for w in layer.moe.expert_weights(e)]
            assert shapes == [(f, d), (f, d), (d, f)], shapes
    routed = [p for n, p in model.expert_parameters() if p.grad is not None]
    assert routed and all(torch.isfinite(p.grad).all() for p in routed)
    assert model.layers[0].moe.router.weight.grad is not None


def test_storages_hold_the_same_experts():
    counts = {s: sum(p.numel() for _, p in _model(s).expert_parameters()) for s in STORAGES}
    e, d, f, layers = SMALL["n_experts"], SMALL["dim"], SMALL["hidden"], SMALL["n_layers"]
    assert set(counts.values()) == {3 * e * d * f * layers}, counts
    totals = {s: sum(p.numel() for p in _model(s).parameters()) for s in STORAGES}
    assert len(set(totals.values())) == 1, totals


@pytest.mark.parametrize("storage", [s for s in STORAGES if s != "grouped"])
def test_storages_compute_the_same_function_and_gradients(storage):
    ref, model = _model("grouped", 0), _model(storage, 1)
    _copy_from(ref, model)
    idx = _tokens()
    lr, lm = _loss(ref, idx), _loss(model, idx)
    torch.testing.assert_close(lm, lr, rtol=1e-5, atol=1e-6)
    lr.backward()
    lm.backward()
    routed = 0
    for la, lb in zip(ref.layers, model.layers, strict=True):
        for e in range(SMALL["n_experts"]):
            routed += int(la.moe.last_counts[e] > 0)
            for ga, gb in zip(_expert_grads(la.moe, e), _expert_grads(lb.moe, e), strict=True):
                torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-7)
    assert routed > SMALL["n_experts"]  # the comparison covered experts with tokens


def _expert_grads(moe, e: int) -> tuple[torch.Tensor, ...]:
    """Expert ``e``'s gate, up and down gradients in ``nn.Linear`` orientation, whatever the
    storage (zeros for an expert that received no token: its Linear weights have no grad)."""
    s, f = moe.storage, moe.hidden
    if s == "grouped":
        return moe.w1.grad[e], moe.w3.grad[e], moe.w2.grad[e]
    if s == "transposed":
        return moe.w1.grad[e].t(), moe.w3.grad[e].t(), moe.w2.grad[e].t()
    if s == "fused":
        return moe.w13.grad[e, :f], moe.w13.grad[e, f:], moe.w2.grad[e]
    x = moe.experts[e]
    ws = (x.gate_proj.weight, x.up_proj.weight, x.down_proj.weight)
    return tuple(torch.zeros_like(w) if w.grad is None else w.grad for w in ws)


def test_unknown_storage_is_refused_by_name():
    with pytest.raises(ValueError, match="storage 'stacked'"):
        MoELM(MoEConfig(storage="stacked", **SMALL))


@pytest.mark.parametrize("storage", ["grouped", "linear"])
def test_bench_task_builds_from_the_seed_and_trains_with_gefen(storage):
    spec = moe.task(storage)
    a, b, c = moe.build(spec, 0), moe.build(spec, 0), moe.build(spec, 1)
    pa, pb, pc = (list(i.model.parameters()) for i in (a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(pa, pc, strict=True))
    batch = next(a.batches)
    assert torch.equal(batch[0], next(b.batches)[0])
    opt = Gefen(a.model.parameters(), lr=3e-3, bits=4)
    before = a.evaluate(a.model)["val_loss"]
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        a.loss(a.model, batch).backward()
        opt.step()
    with torch.no_grad():
        after, untrained = float(a.loss(a.model, batch)), float(b.loss(b.model, batch))
    assert after < untrained  # three steps on one batch fit it
    assert math.isfinite(before)
