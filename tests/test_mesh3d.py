"""Gefen on meshes of three dimensions, built with ``Gefen(model.parameters())`` and nothing else
(tests/dist/tp3d.py, 4 gloo ranks):

- HSDP with tensor parallelism: the tiny Llama-style block of the TP tests, TP on mesh["tp"],
  ``fully_shard`` over mesh["replicate", "shard"], at (2, 1, 2) and (1, 2, 2). Each replica's
  (shard, tp) ranks agree; the replicas keep identical copies. Against one process: the same
  blocks, the codebook and losses within the TP tests' bounds, and a DCP checkpoint resumed bit
  for bit.
- A grouped expert weight (E, F, D) placed (Shard(0), Shard(0), Shard(1)) on a
  (dp_mod_ep, ep, tp) mesh, as expert parallelism with tensor-parallel experts lays it out,
  stepped with given gradients: the same blocks and codebook as one process on the whole tensor,
  and its parameters within the bound of the blocks that the tp cut splits (each piece of a
  column keeps its own v and absmax, as under FSDP).

Measured on a 2-core x86-64 CPU, torch 2.13.0+cpu, gloo: losses within 1.44e-4 of one process
over 5 steps at (1, 2, 2) and 3.6e-5 at (2, 1, 2), the codebook within 2.1e-5 (HSDP+TP); the
expert weight's codebook exact, its parameters within 0.038 of their scale.
"""

from __future__ import annotations

import pytest
import torch
from dist_util import read_results, resume_drift, torchrun
from test_fsdp_elastic import NEW_WORLD_TOL
from test_tp import CODEBOOK_TOL, FIRST_TOL, TP_LOSS_TOL

pytestmark = pytest.mark.dist

STEPS, BITS, WORLD = 5, 8, 4
SHAPES = ("2x1x2", "1x2x2")
EXPERT_TOL = 0.1
SAVE_AT = 3  # tests/dist/tp3d.py's
"""The expert weight's max |param - one process| over max |param|, after 5 steps: its column
blocks are cut in two by the tp split of F, each half with its own v and absmax (measured
0.038)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh3d")
    torchrun("tp3d.py", str(out), str(STEPS), str(BITS), nproc=WORLD)
    return read_results(out, ranks=WORLD)


@pytest.mark.parametrize("shape", SHAPES)
def test_hsdp_with_tp_follows_one_process(runs, shape):
    ref = runs[0]["reference"]
    for r in runs:
        run = r[shape]
        assert run["blocks"] == {n: [bs] for n, bs in ref["blocks"].items()}
        book = torch.tensor(run["codebooks"][0])
        assert (book - torch.tensor(ref["codebook"])).abs().max().item() <= CODEBOOK_TOL
        assert all(b == run["codebooks"][0] for b in run["codebooks"])
        losses = run["losses"]
        assert abs(losses[0] - ref["losses"][0]) / ref["losses"][0] <= FIRST_TOL
        drift = [abs(a - b) / b for a, b in zip(losses, ref["losses"], strict=True)]
        assert max(drift) <= TP_LOSS_TOL, drift
        assert losses == runs[0][shape]["losses"]


def test_each_replica_agrees_over_its_own_shard_and_tp_ranks(runs):
    # (2, 1, 2): replicas {0, 1} and {2, 3}; (1, 2, 2): one replica, the 4 ranks
    for rank, r in enumerate(runs):
        assert r["2x1x2"]["group"] == ([0, 1] if rank < 2 else [2, 3])
        assert r["1x2x2"]["group"] == [0, 1, 2, 3]
        pl = r["2x1x2"]["placements"]
        assert pl["attn.q.weight"] == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert pl["attn_norm.weight"] == "(Replicate(), Shard(dim=0), Replicate())"


@pytest.mark.parametrize("shape", SHAPES)
def test_dcp_resume_on_a_3d_mesh_is_bit_for_bit(runs, shape):
    for r in runs:
        got = r[shape]["resume"]
        assert got["state_exact"] and got["params_exact"]
        assert got["losses"] == r[shape]["losses"][3:]


def test_an_expert_weight_on_a_dp_ep_tp_mesh_is_blocked_as_one_process_blocks_it(runs):
    for r in runs:
        ep = r["ep_tp"]
        assert ep["placements"] == "(Shard(dim=0), Shard(dim=0), Shard(dim=1))"
        assert ep["group"] == [0, 1, 2, 3]
        assert ep["blocks"] == ep["ref_blocks"] == [-64]  # columns inside each expert
        assert ep["codebook_drift"] == 0.0
        assert ep["param_drift"] <= EXPERT_TOL * ep["param_scale"], ep


@pytest.mark.parametrize(
    "move", [("2x1x2", "1x2x2"), ("1x2x2", "2x1x2")], ids=lambda m: "->".join(m)
)
def test_plain_dcp_resumes_a_3d_mesh_checkpoint_at_the_other_mesh(runs, move):
    """Gefen's state of every DTensor is saved in global coordinates (``integrations.dcp``), so
    an HSDP + TP checkpoint loads at another (replicate, shard, tp) mesh through DCP alone,
    within the elastic bound of the uninterrupted run (each data-parallel rank trains on the
    same rows at both shapes)."""
    src, dst = move
    saved = runs[0][src]["losses"]
    got = runs[0][f"{src}->{dst}"]["losses"]
    drift = resume_drift(saved, got, SAVE_AT)
    assert drift[0] <= FIRST_TOL and max(drift) <= NEW_WORLD_TOL, drift
    assert all(r[f"{src}->{dst}"]["losses"] == got for r in runs)
