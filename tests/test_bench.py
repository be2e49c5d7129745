"""The comparison harness: state counting, lr setting, the resumable store, goals, and the smoke
comparison end to end in its own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from needs import extra
from torch import nn

from gefen_dist.bench import peers, store, suite, tasks

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 256)).square().sum().backward()
    opt.step()


def test_state_bytes_counts_bnb_storage_and_shares_maps_once():
    extra("bitsandbytes")
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Linear(256, 256, bias=False))
    opt = peers.build("bnb_adamw8bit", model, 1e-3)
    _step(model, opt)
    a, b = (opt.state[p] for p in model.parameters())
    assert a["qmap1"].data_ptr() == b["qmap1"].data_ptr()  # the shared map the count must dedupe
    n = peers.trainable_numel(model)
    maps = sum(a[k].numel() * a[k].element_size() for k in ("qmap1", "qmap2"))
    absmax = sum(s[k].numel() * s[k].element_size() for s in (a, b) for k in ("absmax1", "absmax2"))
    assert peers.state_bytes(opt) == 2 * n + absmax + maps  # uint8 m and v, maps once


@pytest.mark.slow
def test_state_bytes_unpacks_torchao_quantised_tensors():
    extra("torchao")
    model = nn.Sequential(nn.Linear(256, 256, bias=False))
    opt = peers.build("torchao_adamw8bit", model, 1e-3)
    _step(model, opt)
    n = peers.trainable_numel(model)
    logical = sum(
        t.numel() * t.element_size()
        for st in opt.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    )
    assert logical >= 8 * n  # what a naive count of the subclass would claim
    assert 2 * n <= peers.state_bytes(opt) < 2.2 * n  # what is stored: 1 byte per moment


def test_state_bytes_counts_a_shared_storage_once():
    class Fake(torch.optim.Optimizer):
        def step(self, closure=None):
            pass

    p = nn.Parameter(torch.zeros(10))
    opt = Fake([p], {})
    buf = torch.zeros(100)
    opt.state[p] = dict(a=buf[:50], b=buf[50:], c=[buf], step=torch.tensor(1.0))
    assert peers.state_bytes(opt) == 400 + 4


@pytest.mark.parametrize("name", ["gefen4", "adamw"])
def test_set_lr_scales_from_the_initial_lr_and_keeps_a_tensor_lr_a_tensor(name):
    model = nn.Linear(8, 8)
    opt = peers.build(name, model, 1e-3)
    opt.param_groups[0]["lr"] = lr = torch.tensor(2e-3)
    opt.param_groups[0].pop("initial_lr", None)
    peers.set_lr(opt, 0.5)
    peers.set_lr(opt, 0.25)  # from the initial lr, not compounded
    assert opt.param_groups[0]["lr"] is lr
    assert float(lr) == pytest.approx(5e-4)
    opt2 = peers.build(name, model, 1e-3)
    peers.set_lr(opt2, 0.1)
    peers.set_lr(opt2, 0.2)
    assert opt2.param_groups[0]["lr"] == pytest.approx(2e-4)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    h = tasks.Hyper(steps=100, lr=1.0, warmup_frac=0.1, min_lr_frac=0.1)
    f = [tasks.lr_factor(s, h) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[9:], f[10:], strict=False))
    assert tasks.lr_factor(100, h) == pytest.approx(0.1)


def test_tasks_are_deterministic_per_seed_and_differ_across_seeds():
    t = tasks.scaled(tasks.TASKS["mlp"], 0.02)
    a, b, c = tasks.build(t, 0), tasks.build(t, 0), tasks.build(t, 1)
    wa, wb, wc = (next(i.model.parameters()) for i in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    xa, xb, xc = next(a.batches)[1], next(b.batches)[1], next(c.batches)[1]
    assert torch.equal(xa, xb) and not torch.equal(xa, xc)


def _fake_spawn(calls):
    def spawn(task, opt, seed, timeout):
        calls.append((task.name, opt, seed))
        if opt == "sm3":
            return dict(status="skipped", reason="pytorch_optimizer does not import: test")
        loss = 2.0 + 0.01 * seed + (0.05 if opt == "gefen4" else 0.0)
        bpp = dict(adamw=8.0, gefen4=0.6, bnb_adamw8bit=0.5)[opt]
        curve = [dict(step=0, val_loss=3.0), dict(step=10, val_loss=loss)]
        return dict(
            status="ok",
            curve=curve,
            final=curve[-1],
            state_bytes=int(bpp * 100),
            params=100,
            bytes_per_param=bpp,
            step_ms_median=1.0,
            step_ms_first=1.0,
        )

    return spawn


def test_revision_follows_the_kernel_source_and_not_the_docs(tmp_path):
    """The C++ kernel is the update on the CPU, so an edit to csrc/ must key new records."""

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    def commit(path: str, text: str) -> str:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
        git("add", path)
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", path)
        return store.revision(tmp_path)["code"]

    git("init", "-q")
    first = commit("gefen_dist/a.py", "x = 1\n")
    assert first == commit("docs/a.md", "text\n")  # a report or a doc keys nothing new
    kernel = commit("csrc/k.cpp", "int f() { return 1; }\n")
    assert kernel != first
    (tmp_path / "csrc/k.cpp").write_text("int f() { return 2; }\n")
    dirty = store.revision(tmp_path)["code"]
    assert dirty.startswith(kernel + "-dirty-")
    (tmp_path / "csrc/k.cpp").write_text("int f() { return 3; }\n")
    assert store.revision(tmp_path)["code"] not in (dirty, kernel)  # the diff's own hash
    git("checkout", "-q", "--", "csrc")
    (tmp_path / "csrc/new.cpp").write_text("int g();\n")  # an untracked kernel file counts
    assert store.revision(tmp_path)["code"].startswith(kernel + "-dirty-")


def test_store_skips_done_runs_and_does_not_reuse_other_revisions(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(suite, "_spawn", _fake_spawn(calls))
    monkeypatch.setattr(store, "revision", lambda: dict(code="rev-a", head="h"))
    opts = ["adamw", "gefen4", "bnb_adamw8bit", "sm3"]
    out = tmp_path / "rep"
    suite.compare(out, ["mlp"], opts, [0, 1], scale=0.02, jobs=1, quiet=True)
    assert len(calls) == 8
    suite.compare(out, ["mlp"], opts, [0, 1], scale=0.02, jobs=1, quiet=True)
    assert len(calls) == 8  # everything was stored
    suite.compare(out, ["mlp"], opts, [0, 1, 2], scale=0.02, jobs=1, quiet=True)
    assert sorted(calls[8:]) == sorted(("mlp", o, 2) for o in opts)  # only the new seed
    suite.compare(out, ["mlp"], opts, [0, 1], scale=0.03, jobs=1, quiet=True)
    assert len(calls) == 20  # other settings: run again
    monkeypatch.setattr(store, "revision", lambda: dict(code="rev-b", head="h"))
    suite.compare(out, ["mlp"], opts, [0, 1], scale=0.02, jobs=1, quiet=True)
    assert len(calls) == 28  # another revision: nothing reused
    text = (out / "report.md").read_text()
    assert "`rev-b`" in text and "rev-a" in text  # says which revision it used and ignored
    res = json.loads((out / "results.json").read_text())
    assert res["ignored_other_revisions"] == {"rev-a": 20}
    cells = res["summary"]["mlp"]
    assert cells["sm3"]["status"] == "skipped" and "does not import" in cells["sm3"]["reason"]
    # gefen4 is +0.05 on every seed (t infinite would be degenerate: the seeds differ equally)
    assert cells["gefen4"]["val_loss"]["diff"] == pytest.approx(0.05)
    g = res["goals"]
    miss_a = [x for x in g["a"] if x["gefen"] == "gefen4"][0]
    assert not miss_a["ok"] and "bnb_adamw8bit" in miss_a["below"]
    assert "missed on mlp: gefen4" in text


@pytest.mark.slow
def test_smoke_compare_end_to_end_lists_a_missing_peer_as_skipped(tmp_path):
    fake = tmp_path / "fake"
    (fake / "bitsandbytes").mkdir(parents=True)
    (fake / "bitsandbytes" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    out = tmp_path / "rep"
    env = {"PYTHONPATH": f"{fake}:{ROOT}", "PATH": "/usr/bin:/bin"}
    cmd = [
        sys.executable,
        "-m",
        "gefen_dist.bench",
        "compare",
        "--smoke",
        "--tasks",
        "mlp,gru",
        "--optimizers",
        "adamw,gefen4,bnb_adamw8bit",
        "--out",
        str(out),
    ]
    import os

    p = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **env}
    )
    assert p.returncode == 0, p.stderr[-2000:]
    text = (out / "report.md").read_text()
    for label in ("AdamW", "Gefen 4-bit"):
        assert sum(line.startswith(f"| {label} |") for line in text.splitlines()) == 2
    skipped = [line for line in text.splitlines() if line.startswith("| bitsandbytes")]
    assert len(skipped) == 2 and all("hidden by the test" in s for s in skipped)
    res = json.loads((out / "results.json").read_text())
    for task in ("mlp", "gru"):
        cells = res["summary"][task]
        assert cells["adamw"]["status"] == cells["gefen4"]["status"] == "ok"
        assert cells["adamw"]["bytes_per_param"] == pytest.approx(8.0, abs=0.01)
        assert cells["gefen4"]["tensors"]  # per-tensor block sizes for the fallback analysis
    for png in ("loss_curves.png", "state_bytes.png", "step_time.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert len((out / "runs.jsonl").read_text().splitlines()) == 6


@pytest.mark.slow
def test_bench_main_lists_subcommands_and_rejects_unknown():
    p = subprocess.run(
        [sys.executable, "-m", "gefen_dist.bench", "nope"], cwd=ROOT, capture_output=True, text=True
    )
    assert p.returncode == 2
    for cmd in ("compare", "memory", "capacity"):
        assert cmd in p.stderr


@pytest.mark.slow
def test_state_bytes_counts_fsdp2_state_by_local_shard(tmp_path):
    """FSDP2 keeps DTensor state: count what this rank holds (its shard), not fail."""
    code = (
        "import os, torch, torch.distributed as dist\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29541')\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from gefen_dist.bench.peers import state_bytes\n"
        "m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))\n"
        "fully_shard(m)\n"
        "opt = torch.optim.AdamW(m.parameters())\n"
        "m(torch.randn(4, 64)).sum().backward(); opt.step()\n"
        "n = sum(p.numel() for p in m.parameters())\n"
        "print(state_bytes(opt) - 8 * n)\n"
        "dist.destroy_process_group()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "16"  # m and v, plus four fp32 step counters


def test_state_goal_is_not_met_by_default_when_no_momentum_peer_ran():
    """A comparison of AdamW and Gefen alone says nothing about goal (a)."""
    from gefen_dist.bench import report, tasks

    metric = dict(diff=0.0, rel=0.0, t=None, n_paired=3)
    cells = {
        "adamw": dict(status="ok", bytes_per_param=8.0, val_loss=metric),
        "adafactor": dict(status="ok", bytes_per_param=0.1, val_loss=metric),  # no momentum
        "gefen4": dict(status="ok", bytes_per_param=0.6, val_loss=metric),
        "gefen8": dict(status="ok", bytes_per_param=1.15, val_loss=metric),
    }
    g = report.goals({"gru": cells}, [tasks.TASKS["gru"]])
    assert not g["a_met"]
    assert all("not evaluated" in x["note"] for x in g["a"])
    assert "(a) " in "\n".join(report._goal_lines(g))
    assert "NOT EVALUATED" in "\n".join(report._goal_lines(g))
    cells["torchao_adamw4bit"] = dict(status="ok", bytes_per_param=1.1, val_loss=metric)
    g = report.goals({"gru": cells}, [tasks.TASKS["gru"]])
    assert {x["gefen"]: x["ok"] for x in g["a"]} == {"gefen4": True, "gefen8": False}
