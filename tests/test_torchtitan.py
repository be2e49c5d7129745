"""Gefen in torchtitan: its optimizer container builds and steps Gefen, and its checkpoint manager
saves and resumes it (``gefen_dist.integrations.torchtitan``, docs/torchtitan.md).

torchtitan is not in an extra (docs/torchtitan.md: its release pulls datasets, wandb and
tensorboard, none of which these tests use); launch/install.sh installs it with the packages its
components import, so CI runs these tests, and the module skips where it is absent.

How close, and why (``tests/dist/torchtitan_ckpt.py``: the uneven ``Odd`` model under FSDP2,
8 steps, a checkpoint at step 4, its biases in an AdamW group beside Gefen):

- At the same world size each rank loads its own pieces: the resumed losses and the final
  parameters equal the uninterrupted run's bit for bit, through ``GefenCheckpointManager`` and
  through torchtitan's own ``CheckpointManager``.
- At another world size (2 -> 4, 1 -> 2, 2 -> 1; and torchtitan's own manager at 2 -> 1) the
  pieces of blocks that the shard boundaries cut are merged and cut again (``method.portable``)
  and the gradient average rounds differently; bound 5e-4, ``tests/test_fsdp_elastic.py``'s.
- ``python -m gefen_dist.checkpoint consolidate`` of the 2-rank checkpoint, resumed in one
  process through the container: measured 1.9e-4 (the same merge as the manager's 2 -> 1);
  bound 5e-4.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from dist_util import read_results, resume_drift, torchrun

pytest.importorskip("torchtitan.components.optimizer")
pytest.importorskip("torchtitan.components.checkpointer")

from gefen_dist import Gefen  # noqa: E402
from gefen_dist.integrations.torchtitan import (  # noqa: E402
    GefenOptimizersContainer,
    gefen_optimizers,
)

pytestmark = pytest.mark.dist  # most of its tests start ranks

STEPS, SAVE_AT = 8, 4  # tests/dist/torchtitan_ckpt.py's
NEW_WORLD_TOL = 5e-4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 8))


def _steps(model: nn.Module, opts, first: int, n: int) -> list[float]:
    losses = []
    for s in range(first, first + n):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
        opts.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opts.step()
        losses.append(loss.item())
    return losses


def test_the_container_builds_gefen_by_name_beside_torchtitans_optimizers():
    from torchtitan.components.optimizer import ParamGroupConfig

    cfg = gefen_optimizers(lr=1e-3, bits=8, pattern=r"weight$")
    cfg.param_groups.append(
        ParamGroupConfig(pattern=r"bias$", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})
    )
    opts = cfg.build(model_parts=[_model()])
    assert isinstance(opts, GefenOptimizersContainer)
    (gefen,) = [o for o in opts if isinstance(o, Gefen)]
    (adamw,) = [o for o in opts if isinstance(o, torch.optim.AdamW)]
    assert gefen.param_groups[0]["param_names"] == ["0.weight", "2.weight"]
    assert gefen.param_groups[0]["bits"] == 8
    assert adamw.param_groups[0]["param_names"] == ["0.bias", "2.bias"]
    with pytest.raises(NotImplementedError, match="Optimizer Lion not added"):
        type(opts)._resolve_optimizer_factory("Lion")


def test_a_step_pre_hook_on_the_container_runs_before_gefen_steps():
    """What ``post_optimizer_build_fn`` does (torchtitan's MoE models register their
    load-balancing update so): a step pre-hook on the container, run at every step."""
    model = _model()
    opts = gefen_optimizers(lr=1e-2).build(model_parts=[model])
    (gefen,) = list(opts)
    seen = []
    opts.register_step_pre_hook(lambda *a, **k: seen.append(gefen.initialized))
    _steps(model, opts, 0, 2)
    assert seen == [False, True]


def test_a_flat_state_dict_resumes_one_process_bit_for_bit():
    """torchtitan's flat keys (``state.{fqn}.{name}``) back into Gefen's state as saved: the
    stock container reads back only the names the live state has, which under FSDP2 lose the
    per-rank entries (tests below); in one process every tensor must come back too."""
    model = _model()
    opts = gefen_optimizers(lr=1e-2).build(model_parts=[model])
    _steps(model, opts, 0, 3)
    saved = {k: v.clone() if torch.is_tensor(v) else v for k, v in opts.state_dict().items()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    keys = {k.rsplit(".", 1)[-1] for k in saved if k.startswith("state.0.weight.")}
    assert {"codes", "layout", "step", "codebook"} <= keys, keys
    want = _steps(model, opts, 3, 3)

    again = _model()
    with torch.no_grad():
        for n, p in again.named_parameters():
            p.copy_(params[n])
    fresh = gefen_optimizers(lr=1e-2).build(model_parts=[again])
    fresh.load_state_dict(saved)
    assert _steps(again, fresh, 3, 3) == want


def test_importing_the_integration_leaves_torchtitan_unimported():
    code = (
        "import sys, gefen_dist, gefen_dist.integrations.torchtitan as t; "
        "assert 'torchtitan' not in sys.modules, 'imported'; print(t.NAME)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "Gefen", out.stderr[-2000:]


# -- FSDP2 on gloo ranks, torchtitan's CheckpointManager ----------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted runs at 2 ranks and at 1, each with its checkpoint at SAVE_AT."""
    d = tmp_path_factory.mktemp("titan")
    runs = {}
    for world in (2, 1):
        out, folder = d / f"run{world}", d / f"ckpt{world}"
        torchrun("torchtitan_ckpt.py", str(out), "run", "gefen", str(folder), nproc=world)
        runs[world] = (read_results(out, world), folder)
    return d, runs


def _resume(saved, frm: int, to: int, manager: str) -> list[dict]:
    d, runs = saved
    out = d / f"resume{frm}to{to}{manager}"
    torchrun("torchtitan_ckpt.py", str(out), "resume", manager, str(runs[frm][1]), nproc=to)
    return read_results(out, to)


@pytest.mark.dist
@pytest.mark.parametrize("manager", ["gefen", "plain"])
def test_a_resume_at_the_same_world_size_is_bit_for_bit(saved, manager):
    base = saved[1][2][0]
    got = _resume(saved, 2, 2, manager)
    assert base[0]["optimizers"] == ["AdamW", "Gefen"]
    for rank in base:  # global fields (integrations.dcp): no rank in any key
        assert any(k.endswith(".gefen.format") for k in rank["keys"])
        assert not any(".gefen.rank" in k for k in rank["keys"])
    for rank in got:
        assert rank["loaded_steps"] == [float(SAVE_AT)]
        assert rank["losses"] == base[0]["losses"][SAVE_AT:]
        assert rank["params"] == base[0]["params"]
        assert rank["lr"] == base[0]["lr"]


@pytest.mark.dist
@pytest.mark.parametrize("frm,to", [(2, 1), (1, 2), (2, 4)])
def test_the_gefen_manager_resumes_at_another_world_size_within_the_bound(saved, frm, to):
    base = saved[1][frm][0][0]
    got = _resume(saved, frm, to, "gefen")
    for rank in got:
        assert rank["loaded_steps"] == [float(SAVE_AT)]
        drift = resume_drift(base["losses"], rank["losses"], SAVE_AT)
        assert max(drift) < NEW_WORLD_TOL, drift
        assert rank["lr"] == base["lr"]


@pytest.mark.dist
def test_torchtitans_own_manager_resumes_at_another_world_size_within_the_bound(saved):
    """torchtitan's stock ``CheckpointManager`` calls ``dcp.load`` with DCP's default planner,
    which fits Gefen's template to the checkpoint (``integrations.dcp``): nothing of Gefen's."""
    base = saved[1][2][0][0]
    (rank,) = _resume(saved, 2, 1, "plain")
    assert "error" not in rank, json.dumps(rank)[:500]
    assert rank["loaded_steps"] == [float(SAVE_AT)]
    drift = resume_drift(base["losses"], rank["losses"], SAVE_AT)
    assert max(drift) < NEW_WORLD_TOL, drift


@pytest.mark.dist
def test_a_consolidated_checkpoint_resumes_in_one_process_within_the_bound(saved, tmp_path):
    """``python -m gefen_dist.checkpoint consolidate`` reads torchtitan's flat optimizer keys
    and writes them back flat, each parameter's state whole: the container loads it in one
    process, with the model's whole tensors and the scheduler from the same file."""
    import importlib.util

    from dist_util import DIST

    base = saved[1][2][0][0]
    whole = tmp_path / "whole.pt"
    cmd = [
        sys.executable,
        "-m",
        "gefen_dist.checkpoint",
        "consolidate",
        str(saved[1][2][1] / f"step-{SAVE_AT}"),
        str(whole),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "consolidated 2 Gefen parameter entries" in out.stdout, out.stdout
    sys.path.insert(0, str(DIST))
    try:
        spec = importlib.util.spec_from_file_location(
            "torchtitan_ckpt", DIST / "torchtitan_ckpt.py"
        )
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
    finally:
        sys.path.remove(str(DIST))
    from torchtitan.components.optimizer import LRSchedulersContainer

    sd = torch.load(whole, weights_only=False)
    assert not [k for k in sd["optimizer"] if ".gefen." in k]
    model = script.build(script.KIND)
    model.load_state_dict({n: sd[n] for n, _ in model.named_parameters()})
    opts = script.config().build(model_parts=[model])
    scheds = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=opts, training_steps=script.STEPS
    )
    opts.load_state_dict(sd["optimizer"])
    scheds.load_state_dict(sd["lr_scheduler"])
    losses = []
    for s in range(SAVE_AT, STEPS):
        opts.zero_grad()
        x, y = script.batch(script.KIND, s)
        loss = model(x, y)[1]
        loss.backward()
        opts.step()
        scheds.step()
        losses.append(loss.item())
    drift = resume_drift(base["losses"], losses, SAVE_AT)
    assert max(drift) < NEW_WORLD_TOL, drift
