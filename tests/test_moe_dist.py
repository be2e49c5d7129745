"""Grouped expert weights under FSDP2 and FSDP1 on 2 gloo ranks, and expert parallel on 4, against
one process.

Two torchrun launches: ``tests/dist/moe_layouts.py`` (2 ranks) and ``tests/dist/moe_ep.py`` (4
ranks, torchtitan's expert-parallel layout). FSDP2 gives each rank whole experts; FSDP1's
flat shard cuts an expert's matrix, so the per-matrix statistics, the per-matrix column absmax
and the cut of segments at each matrix all meet pieces held by two ranks. Tolerances are
``tests/test_fsdp.py``'s and ``tests/test_elastic.py``'s, for the same reasons:

- "same" runs (every rank on the whole batch): block sizes and codebooks are exactly the single
  process's; losses within 2e-3, as where a shard boundary cuts blocks (here the column blocks
  of attention weights that both FSDPs split by rows).
- the DCP checkpoint resumes at the same layout bit for bit;
- consolidated and resumed in one process: first loss within 1e-6 relative, the rest 5e-4.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
from dist_util import DIST, read_results, resume_drift, torchrun

from gefen_dist import Gefen, checkpoint

pytestmark = pytest.mark.dist

FIRST_TOL, NEW_WORLD_TOL, CUT_LOSS_TOL = 1e-6, 5e-4, 2e-3


@pytest.fixture(scope="module")
def ep(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_ep")
    torchrun("moe_ep.py", str(d), nproc=4, timeout=600)
    return d, read_results(d, ranks=4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    torchrun("moe_layouts.py", str(d), timeout=600)
    return d, read_results(d, ranks=2)


def _experts(blocks: dict[str, int]) -> dict[str, int]:
    return {n: b for n, b in blocks.items() if n.rsplit(".", 1)[-1] in ("w1", "w2", "w3")}


@pytest.mark.parametrize("setup", ["fsdp2", "fsdp1_flat"])
def test_blocks_and_codebook_are_the_single_process_ones(runs, setup):
    _, ranks = runs
    ref = ranks[0]["ref"]
    experts = _experts(ref["blocks"])
    assert len(experts) == 6 and 1 not in experts.values() and len(set(experts.values())) == 2
    for r in ranks:
        run = r[f"{setup}/same"]
        for name, bs in run["blocks"].items():
            assert bs == ref["blocks"][name], (name, bs)
        assert run["codebooks"] == ref["codebooks"]


@pytest.mark.parametrize("setup", ["fsdp2", "fsdp1_flat"])
def test_losses_follow_the_single_process(runs, setup):
    _, ranks = runs
    ref = ranks[0]["ref"]["losses"]
    got = [r[f"{setup}/same"] for r in ranks]
    cut = sum(g["cut_blocks"] for g in got)
    drift = max(abs(a - b) for a, b in zip(got[0]["losses"], ref, strict=True))
    assert cut > 0  # column-blocked attention weights, split by rows: each piece its own v
    assert drift <= CUT_LOSS_TOL, drift


def _resumed_bit_for_bit(run: dict) -> None:
    save_at = len(run["losses"]) - len(run["resumed"])
    assert run["resumed"] == run["losses"][save_at:]


def test_dcp_resumes_at_the_same_layout_bit_for_bit(runs):
    _resumed_bit_for_bit(runs[1][0]["fsdp2/split"])


def _resume_consolidated(d, script, saved: list[float], tmp_path) -> dict:
    """Consolidate ``d/dcp`` with the command line, resume it in one process with ``script``'s
    model, batches and loss, and return the state and the resumed losses' drift."""
    sys.path.insert(0, str(DIST))
    mod = importlib.import_module(script)
    whole = tmp_path / "whole.pt"
    cmd = [sys.executable, "-m", "gefen_dist.checkpoint", "consolidate", str(d / "dcp"), str(whole)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    tree = torch.load(whole, weights_only=True)
    model = mod.build()
    model.load_state_dict(tree["model"])
    opt = Gefen(model.parameters(), bits=mod.BITS, lr=3e-3, weight_decay=0.1)  # the launches'
    checkpoint.load_optimizer(opt, model, tree["optim"])
    losses = []
    for s in range(mod.SAVE_AT, mod.STEPS):
        opt.zero_grad()
        loss = mod.loss_of(model, mod.batch(s))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return dict(state=tree["optim"]["state"], drift=resume_drift(saved, losses, mod.SAVE_AT))


def test_a_consolidated_checkpoint_resumes_in_one_process(runs, tmp_path):
    d, ranks = runs
    got = _resume_consolidated(d, "moe_layouts", ranks[0]["fsdp2/split"]["losses"], tmp_path)
    # one segment per expert, as one process keeps
    assert len(got["state"]["layers.0.moe.w2"]["layout"]) == 8
    drift = got["drift"]
    assert drift[0] <= FIRST_TOL and max(drift) <= NEW_WORLD_TOL, drift


def test_expert_parallel_chooses_the_single_process_blocks_and_one_codebook(ep):
    """torchtitan's layout: experts (_StridedShard(0), Shard(0)) on (dp_mod_ep, ep), the rest
    FSDP2 on the flattened dp mesh, in one Gefen with no extra call. Data parallel, so the
    codebook is held to being one on all ranks (tests/test_fsdp.py: why not to the bit)."""
    _, ranks = ep
    ref = ranks[0]["ref"]
    experts = _experts(ref["blocks"])
    assert len(experts) == 6 and 1 not in experts.values()
    for r in ranks:
        assert r["ep"]["placements"] == ["_S(0, 2)", "S(0)"]
        assert r["ep"]["blocks"] == ref["blocks"]
        assert r["ep"]["codebooks"] == ranks[0]["ep"]["codebooks"]
        assert len(r["ep"]["codebooks"]) == 1
    # each rank holds 2 whole experts of 8, one segment each, blocked by their own columns:
    # rank 1 (dp_mod_ep 0, ep 1) experts 4 and 5 (ep 1's half, dp_mod_ep 0's quarter of it)
    assert [row[1:4] for row in ranks[1]["ep"]["w2_layout"]] == [
        [5120, 4 * 5120, -80],
        [5120, 5 * 5120, -80],
    ]


def test_expert_parallel_follows_the_single_process(ep):
    _, ranks = ep
    ref, got = ranks[0]["ref"]["losses"], ranks[0]["ep"]["losses"]
    assert abs(got[0] - ref[0]) / ref[0] <= FIRST_TOL  # the same model, computed in parts
    drift = max(abs(a - b) for a, b in zip(got, ref, strict=True))
    assert drift <= CUT_LOSS_TOL, drift


def test_expert_parallel_resumes_from_dcp_bit_for_bit(ep):
    _resumed_bit_for_bit(ep[1][0]["ep"])


def test_an_expert_parallel_checkpoint_resumes_on_another_mesh_with_plain_dcp(ep):
    """Saved on (dp_mod_ep=2, ep=2), loaded on (1, 4) with get_state_dict, dcp.load and
    set_state_dict: the expert weights' state is in global coordinates
    (``integrations.dcp``), and each expert is its own matrix, so no block is cut."""
    _, ranks = ep
    got, saved = ranks[0]["ep"]["other_mesh"], ranks[0]["ep"]["losses"]
    drift = resume_drift(saved, got, len(saved) - len(got))
    assert drift[0] <= FIRST_TOL and max(drift) <= NEW_WORLD_TOL, drift


def test_an_expert_parallel_checkpoint_resumes_in_one_process(ep, tmp_path):
    d, ranks = ep
    drift = _resume_consolidated(d, "moe_ep", ranks[0]["ep"]["losses"], tmp_path)["drift"]
    assert drift[0] <= FIRST_TOL and max(drift) <= NEW_WORLD_TOL, drift
