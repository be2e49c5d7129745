"""The MoE LM as suite tasks (registered, run in the suite's own worker subprocess, kept out of
the default list) and the memory table's MoE row (Qwen1.5-MoE-A2.7B's published shapes, and the
state it counts equal to what optimizers allocate, on a small version of the same model)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
import torch

from gefen_dist import Gefen
from gefen_dist.bench import compare, memory, moe, peers, suite, tasks

pytestmark = pytest.mark.unit

QWEN = memory.MODELS["qwen1.5-moe-a2.7b"]
TINY_MOE = replace(
    QWEN,
    name="tiny-moe",
    d=32,
    n_layer=2,
    n_head=4,
    n_kv_head=2,
    vocab=300,
    n_experts=6,
    top_k=2,
    expert_ffn=24,
    shared_ffn=40,
    ctx=32,
)
"""Qwen2-MoE's structure (q/k/v biases, router, grouped experts, gated shared expert, untied
head) at a size a real Gefen step takes milliseconds on; GQA on, which the real model lacks."""


def _small(name: str) -> tasks.Task:
    """The registered task under its own name, at a few steps and a small width."""
    t = tasks.scaled(tasks.TASKS[name], 0.01, smoke=True)
    sizes = dict(t.sizes, dim=32, hidden=24, n_experts=4, n_heads=2, val_batches=1)
    return replace(t, sizes=sizes)


def test_moe_tasks_are_registered_by_storage_and_not_in_the_default_list():
    for storage in moe.STORAGES:
        t = tasks.TASKS[moe.task_name(storage)]
        assert t.sizes["storage"] == storage and t.kind == "lm"
    assert tasks.TASKS["moe"].sizes["storage"] == "grouped"
    assert not any(n.startswith("moe") for n in tasks.DEFAULT_TASKS)
    assert tasks.DEFAULT_TASKS == ("gpt2", "llama", "resnet", "mlp", "gru")
    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    assert p.parse_args([]).tasks.split(",") == list(tasks.DEFAULT_TASKS)
    moe.register_tasks()  # again: the same tasks, accepted
    with pytest.raises(ValueError, match="task 'moe' is already registered"):
        tasks.register(replace(tasks.TASKS["moe"], label="another"), moe.build)


def test_a_suite_worker_process_finds_the_moe_task_by_name():
    """``suite._spawn`` runs a fresh interpreter, which must find the task by its name (the
    registration in ``gefen_dist.bench``'s ``__init__``)."""
    t = _small("moe")
    rec = suite._spawn(t, "adamw", 0, timeout=300)
    assert rec["status"] == "ok", rec.get("reason")
    assert rec["params"] == sum(p.numel() for p in tasks.build(t, 0).model.parameters())


@pytest.mark.parametrize("name", ["moe", "moe_linear"])
def test_the_suite_trains_the_moe_task_and_counts_its_state(name):
    t = _small(name)
    rec = suite.run_one(t, "gefen4", 0)
    assert rec["status"] == "ok", rec.get("reason")
    assert rec["final"]["val_loss"] < rec["curve"][0]["val_loss"]
    assert rec["params"] == sum(p.numel() for p in tasks.build(t, 0).model.parameters())
    names = [x["name"] for x in rec["gefen"]["tensors"]]
    expert = "'layers.0.moe.w1'" if name == "moe" else "'layers.0.moe.experts.0.gate_proj.weight'"
    assert any(expert in n for n in names), names
    assert rec["bytes_per_param"] < 8
    adamw = suite.run_one(t, "adamw", 0)
    assert adamw["state_bytes"] == 8 * adamw["params"] + 4 * len(names)


def test_qwen_moe_row_has_the_published_parameter_count_and_grouped_experts():
    with torch.device("meta"):
        model, emb, head = memory.build_model(QWEN, 1)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    layer = sum(p.numel() for n, p in model.named_parameters() if memory._is_layer(n))
    rest = sum(p.numel() for n, p in model.named_parameters() if not memory._is_layer(n))
    total = rest + QWEN.n_layer * layer
    assert total == 14_315_784_192
    assert round(total / 1e9, 1) == 14.3  # the model card: "14.3B parameters in total"
    pre = "model.layers.0.mlp."
    assert shapes[pre + "experts.w1"] == shapes[pre + "experts.w3"] == (60, 1408, 2048)
    assert shapes[pre + "experts.w2"] == (60, 2048, 1408)
    assert shapes[pre + "gate.weight"] == (60, 2048)
    assert shapes[pre + "shared_expert.down_proj.weight"] == (2048, 5632)
    assert shapes[pre + "shared_expert_gate.weight"] == (1, 2048)
    assert shapes["model.layers.0.self_attn.q_proj.bias"] == (2048,)
    assert shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"] == (151936, 2048)
    assert emb == ["model.embed_tokens"] and head == ["lm_head"]


def test_grouped_experts_compute_each_chosen_expert_as_a_linear_swiglu():
    torch.manual_seed(0)
    block = memory.QwenMoEBlock(TINY_MOE)
    x = torch.randn(12, TINY_MOE.d)
    weight, chosen = torch.softmax(block.gate(x), -1).topk(TINY_MOE.top_k, -1)
    ex = block.experts
    ref = torch.zeros_like(x)
    for i in range(len(x)):
        for j in range(TINY_MOE.top_k):
            e = chosen[i, j]
            h = torch.nn.functional.silu(ex.w1[e] @ x[i]) * (ex.w3[e] @ x[i])
            ref[i] += weight[i, j] * (ex.w2[e] @ h)
    torch.testing.assert_close(ex(x, chosen, weight), ref)


@pytest.fixture(scope="module")
def tiny_moe_records():
    opts = ["adamw", "gefen4", "gefen8"]
    full = memory.measure_model(TINY_MOE, opts, batch=2, seq=16, full=True)
    one = memory.measure_model(TINY_MOE, opts, batch=2, seq=16, full=False)
    return full, one


def test_moe_row_counts_what_a_real_gefen_step_allocates(tiny_moe_records):
    full, _ = tiny_moe_records
    rows = {t["name"]: t for t in full["tensors"]}
    model, emb, head = memory.build_model(TINY_MOE, TINY_MOE.n_layer)
    assert full["params"] == sum(p.numel() for p in model.parameters())
    ids = memory.tokens(TINY_MOE.vocab, 2, 16)
    grads = memory.first_gradients(model, TINY_MOE, ids, emb, head)
    assert grads["model.layers.0.mlp.experts.w1"].dim() == 3
    for bits, name in ((4, "gefen4"), (8, "gefen8")):
        model, _, _ = memory.build_model(TINY_MOE, TINY_MOE.n_layer)
        opt = Gefen(model.named_parameters(), lr=1e-3, bits=bits)
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        rep = opt.memory_report()
        assert sum(t["state"][name]["proper"] for t in rows.values()) == rep["state_bytes"]
        for t in rep["tensors"]:  # named "parameter '<name>' (<shape>)"
            n = t["name"].split("'")[1]
            assert t["block_sizes"] == rows[n]["state"][name]["blocks"], n
    n_tensors = len(full["tensors"])
    assert full["totals"]["adamw"]["bytes"] == 8 * full["params"] + 4 * n_tensors


def test_moe_row_extrapolates_layer_0_exactly_for_shape_only_state(tiny_moe_records):
    full, one = tiny_moe_records
    assert one["params"] == full["params"]
    assert one["totals"]["adamw"]["bytes"] == full["totals"]["adamw"]["bytes"]
    assert {t["name"] for t in one["tensors"]} <= {t["name"] for t in full["tensors"]}


def test_peers_step_on_a_grouped_expert_weight():
    """Every peer the MoE row counts accepts a 3-D expert weight under its model name (or says
    why not), so the row's cells are measurements, not 'n/a' by accident."""
    g = torch.randn(4, 24, 32)
    for o in ("adamw", "adafactor"):
        assert memory.peer_state("model.layers.0.mlp.experts.w1", o, g, {}) > 0
    assert peers.PEERS["adamw"].lr_scale == 1.0
