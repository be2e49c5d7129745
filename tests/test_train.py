import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gefen_dist.demo.corpus import get_batch, load_corpus
from gefen_dist.demo.model import GPT, GPTConfig
from gefen_dist.demo.train import full_config, lr_lambda, run

pytestmark = pytest.mark.unit

torch.set_num_threads(1)

TINY = dict(
    n_layer=1,
    n_head=4,
    n_embd=32,
    batch_size=8,
    block_size=32,
    steps=30,
    eval_every=10,
    eval_batches=4,
    max_bytes=2**20,
    lr=3e-3,
    quiet=True,
)


def test_corpus_deterministic_and_split_disjoint():
    train, val = load_corpus(max_bytes=2**20)
    assert train.dtype == torch.uint8 and len(train) > 0 and len(val) > 0
    assert len(train) + len(val) == 2**20
    assert abs(len(val) / 2**20 - 0.1) < 0.01
    train2, val2 = load_corpus(max_bytes=2**20)
    assert torch.equal(train, train2) and torch.equal(val, val2)
    # val is exactly the tail of the stream, so no byte position is in both
    (whole, empty) = load_corpus(max_bytes=2**20, val_frac=0.0)
    assert len(empty) == 0 and torch.equal(torch.cat([train, val]), whole)
    assert b"def " in bytes(train[:100_000].tolist())


def test_get_batch_shift_and_seed():
    train, _ = load_corpus(max_bytes=2**16)
    x, y = get_batch(train, 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = get_batch(train, 4, 16, torch.Generator().manual_seed(0))
    x3, _ = get_batch(train, 4, 16, torch.Generator().manual_seed(1))
    assert torch.equal(x, x2) and not torch.equal(x, x3)


def test_model_init_loss_is_uniform():
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=32)
    model = GPT(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    idx = torch.randint(256, (8, 32))
    logits, loss = model(idx, torch.randint(256, (8, 32)))
    assert logits.shape == (8, 32, 256)
    assert abs(loss.item() - math.log(256)) < 0.15
    assert model(idx)[1] is None


def test_lr_schedule():
    f = lr_lambda(full_config(dict(steps=100, warmup=10)))
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 100))


@pytest.fixture(scope="module")
def tiny_runs():
    return run({**TINY, "seed": 0}), run({**TINY, "seed": 0}), run({**TINY, "seed": 1})


def test_tiny_adamw_learns(tiny_runs):
    r = tiny_runs[0]
    assert [c["step"] for c in r["curve"]] == [0, 10, 20, 30]
    assert r["final_val_loss"] < r["curve"][0]["val_loss"] - 0.3
    assert r["bytes_per_param"] == pytest.approx(8.0)  # fp32 exp_avg + exp_avg_sq
    assert r["state_bytes"] == r["adamw_bytes"] == 8 * r["n_params"]


def test_same_seed_same_result_other_seed_differs(tiny_runs):
    a, b, c = tiny_runs
    assert a["curve"] == b["curve"]
    assert a["curve"][0] != c["curve"][0]  # different init
    assert a["final_val_loss"] != c["final_val_loss"]


@pytest.mark.slow
def test_cli_end_to_end(tmp_path):
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-m",
        "gefen_dist.demo.train",
        "--optimizer",
        "adamw",
        "--steps",
        "6",
        "--eval-every",
        "3",
        "--eval-batches",
        "2",
        "--batch-size",
        "4",
        "--block-size",
        "16",
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--n-embd",
        "16",
        "--max-bytes",
        "65536",
        "--seed",
        "3",
        "--json",
        str(out),
    ]
    root = Path(__file__).resolve().parent.parent
    p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "final val" in p.stdout and "ms/step" in p.stdout
    r = json.loads(out.read_text())
    for k in [
        "config",
        "curve",
        "final_train_loss",
        "final_val_loss",
        "wall_time_s",
        "step_time_median_ms",
        "n_params",
        "state_bytes",
        "bytes_per_param",
    ]:
        assert k in r, k
    assert r["config"]["seed"] == 3 and r["config"]["steps"] == 6
    assert [c["step"] for c in r["curve"]] == [0, 3, 6]
    assert set(r["curve"][-1]) == {"step", "train_loss", "val_loss"}


def test_tiny_gefen_run_uses_memory_report():
    r = run({**TINY, "optimizer": "gefen", "gefen_kwargs": {"bits": 4}, "seed": 0})
    assert r["memory_report"] is not None
    assert r["state_bytes"] == r["memory_report"]["state_bytes"] < r["adamw_bytes"]
    assert r["final_val_loss"] < r["curve"][0]["val_loss"] - 0.3
