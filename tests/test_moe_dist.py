"""Grouped expert weights under FSDP2 and FSDP1 on 2 gloo ranks, against one process.

One torchrun launch (``tests/dist/moe_layouts.py``). FSDP2 gives each rank whole experts; FSDP1's
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

import subprocess
import sys

import pytest
import torch
from dist_util import DIST, read_results, resume_drift, torchrun

from gefen_dist import Gefen, checkpoint

pytestmark = pytest.mark.dist

FIRST_TOL, NEW_WORLD_TOL, CUT_LOSS_TOL = 1e-6, 5e-4, 2e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    torchrun("moe_layouts.py", str(d), timeout=600)
    return d, read_results(d, ranks=2)


def _experts(blocks: dict[str, int]) -> dict[str, int]:
    return {n: b for n, b in blocks.items() if ".moe.w" in n}


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


def test_dcp_resumes_at_the_same_layout_bit_for_bit(runs):
    _, ranks = runs
    split = ranks[0]["fsdp2/split"]
    save_at = len(split["losses"]) - len(split["resumed"])
    assert split["resumed"] == split["losses"][save_at:]


def test_a_consolidated_checkpoint_resumes_in_one_process(runs, tmp_path):
    sys.path.insert(0, str(DIST))  # the launch's own model, batches and loss
    from moe_layouts import BITS, CONFIG, SAVE_AT, STEPS, batch, build, loss_of

    d, ranks = runs
    whole = tmp_path / "whole.pt"
    cmd = [sys.executable, "-m", "gefen_dist.checkpoint", "consolidate", str(d / "dcp"), str(whole)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    tree = torch.load(whole, weights_only=True)
    w2 = tree["optim"]["state"]["layers.0.moe.w2"]
    assert len(w2["layout"]) == CONFIG.n_experts  # one segment per expert, as one process keeps
    model = build()
    model.load_state_dict(tree["model"])
    opt = Gefen(model.parameters(), bits=BITS, lr=3e-3, weight_decay=0.1)  # fsdp_common.HYPER
    checkpoint.load_optimizer(opt, model, tree["optim"])
    losses = []
    for s in range(SAVE_AT, STEPS):
        opt.zero_grad()
        loss = loss_of(model, batch(s))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    drift = resume_drift(ranks[0]["fsdp2/split"]["losses"], losses, SAVE_AT)
    assert drift[0] <= FIRST_TOL and max(drift) <= NEW_WORLD_TOL, drift
