"""The memory table and the capacity search measure what they say they measure."""

from __future__ import annotations

import json

import pytest
import torch

from gefen_dist import Gefen
from gefen_dist.bench import capacity, memory, peers

pytestmark = pytest.mark.unit

TINY = memory.Shape("tiny-gpt", "gpt2", 64, 2, 4, 300, ctx=32)


@pytest.fixture(scope="module")
def tiny_record():
    return memory.measure_model(TINY, ["adamw", "gefen4", "gefen8"], batch=2, seq=16, full=True)


def test_adamw_row_is_8_bytes_per_param_plus_step_counters(tiny_record):
    n_tensors = len(tiny_record["tensors"])
    model, _, _ = memory.build_model(TINY, TINY.n_layer)
    assert tiny_record["params"] == sum(p.numel() for p in model.parameters())
    # AdamW: exp_avg + exp_avg_sq in fp32, and one fp32 step counter per tensor
    assert tiny_record["totals"]["adamw"]["bytes"] == 8 * tiny_record["params"] + 4 * n_tensors


def test_gefen_count_equals_a_real_step_and_its_memory_report(tiny_record):
    model, emb, head = memory.build_model(TINY, TINY.n_layer)
    ids = memory.tokens(TINY.vocab, 2, 16)
    grads = memory.first_gradients(model, TINY, ids, emb, head)
    model, _, _ = memory.build_model(TINY, TINY.n_layer)  # first_gradients emptied the first
    rows = {t["name"]: t for t in tiny_record["tensors"]}
    assert any(max(t["state"]["gefen4"]["blocks"]) > 1 for t in rows.values())
    for bits, name in ((4, "gefen4"), (8, "gefen8")):
        # per tensor: a real Gefen step on a lone parameter allocates what the table counts
        for n, g in grads.items():
            p = torch.nn.Parameter(torch.zeros_like(g))
            opt = Gefen([p], lr=1e-3, bits=bits)
            p.grad = g.clone()
            opt.step()
            rep = opt.memory_report()
            assert peers.state_bytes(opt) == rows[n]["state"][name]["bytes"], n
            assert rep["tensors"][0]["block_sizes"] == rows[n]["state"][name]["blocks"], n
        # the whole model in one Gefen: its memory_report is the table's sum
        opt = Gefen(model.named_parameters(), lr=1e-3, bits=bits)
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        rep = opt.memory_report()
        assert sum(t["state"][name]["proper"] for t in rows.values()) == rep["state_bytes"]
        assert rep["state_bytes"] < 8 * rep["params"]


def test_vocab_gradients_equal_autograd():
    torch.manual_seed(0)
    model, emb, head = memory.build_model(TINY, 1)
    ids = memory.tokens(TINY.vocab, 2, 16)
    ours = memory.first_gradients(model, TINY, ids, emb, head)
    model2, _, _ = memory.build_model(TINY, 1)
    loss = model2(ids[:, :-1], ids[:, 1:])[1]
    loss.backward()
    for n, p in model2.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, rtol=1e-4, atol=1e-6)


def test_chunked_peer_count_matches_whole_tensor_for_adamw():
    g = torch.randn(64, 128)
    whole = memory.measure_tensor("mlp.c_fc.weight", g, ["adamw"], {})
    parts = memory.measure_tensor("mlp.c_fc.weight", g, ["adamw"], {}, chunk_numel=64 * 32)
    assert parts["adamw"]["chunks"] == 4
    # same moments; the chunks add one 4-byte step counter each
    assert parts["adamw"]["bytes"] == whole["adamw"]["bytes"] + 3 * 4


def test_search_finds_the_largest_fitting_b_with_few_calls():
    for limit in (0, 1, 2, 7, 33, 100):
        for start in (1, 5, 40):
            calls = []

            def fits(b, limit=limit, calls=calls):
                calls.append(b)
                return b <= limit

            assert capacity.search(fits, start, b_max=1000) == limit
            assert len(calls) == len(set(calls))
    calls = []
    assert capacity.search(lambda b: calls.append(b) or b <= 41, start=41) == 41
    assert calls == [41, 42]
    assert capacity.search(lambda b: True, 3, b_max=20) == 20


def test_guess_from_slope():
    one = dict(ok=True, net_peak_bytes=100)
    assert capacity.guess_from(10.0, one, 200) == 11
    assert capacity.guess_from(None, one, 200) == 1


@pytest.mark.slow
def test_smoke_capacity_gefen_fits_at_least_adamw(tmp_path):
    """A real run of the CLI: subprocess probes, a budget, files written."""
    capacity.main(["--smoke", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "capacity.json").read_text())
    best = {r["optimizer"]: r["best"] for r in data["results"]}
    assert best["gefen4"] >= 1 and best["gefen4"] >= (best["adamw"] or 0)
    # the state gap (~24 MiB) is well above the RSS noise of a probe (5-10 MiB)
    at1 = {r["optimizer"]: next(p for p in r["probes"] if p["b"] == 1) for r in data["results"]}
    assert at1["gefen4"]["net_peak_bytes"] < at1["adamw"]["net_peak_bytes"]
    for r in data["results"]:
        for p in r["probes"]:
            assert p["ok"] and p["peak_bytes"] > p["baseline_bytes"] > 0
    assert (tmp_path / "capacity.md").exists() and (tmp_path / "capacity.png").exists()
