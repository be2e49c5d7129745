"""Gefen under FSDP2 with tensor parallelism: a tiny Llama-style block on 4 gloo ranks as a
(dp=2, tp=2) mesh (tests/dist/tp_common.py), built with ``Gefen(model.parameters())`` and
nothing else.

One launch trains it against single-process Gefen (tests/dist/tp_train.py), one saves and one
resumes its checkpoints (tests/dist/tp_checkpoint.py). A rank's piece of a RowwiseParallel
weight is some columns of every row it holds: one segment per row, in the tensor's coordinates.
Blocks and codebook come from the whole tensor; a block that a piece boundary cuts keeps one v
and absmax per piece, as under FSDP. The o/down weights have column blocks: the rows of a piece
share one v and absmax per column and one v_cross (``state.block_owners``, ``cross_column``),
and step as one piece of R rows x C columns, so the update is FSDP's (a rank's rows of a
column-blocked tensor keep their own column v). Measured on a 2-core x86-64 CPU, torch
2.13.0+cpu, gloo, against the FSDP tests' bounds:

- losses against single process, 5 steps: measured 1.44e-4 relative at most (1-D FSDP2 over
  the same 4 ranks: 1.5e-4); bound TP_LOSS_TOL = test_fsdp's SPLIT_LOSS_TOL; the
  sequence-parallel plan ("sp": norms SequenceParallel, the residual stream Shard(1), o/down
  RowwiseParallel(output_layouts=Shard(1))): 1.43e-4; first step 1.2e-7 (bound FIRST_TOL);
- codebook against single process (the gradients differ by the row-parallel sums' rounding):
  measured 2.1e-5 at most; bound 2e-4;
- "sp" first-step gradients against single process, the norms' (summed over tp)
  included: measured 4.5e-7 relative at most; bound SP_GRAD_TOL = 1e-5. This is the check of
  the loss division by tp: undivided, every gradient is twice the reference (drift 1.0, the
  test fails) but the losses still follow the reference, since Gefen's update, like Adam's,
  does not see a uniform gradient scale; a target sliced to the wrong sequence shard fails the
  loss, codebook, block and gradient tests. Its norm weights: (Shard(dim=0), Replicate()), the
  other placements and the state the first plan's;
- a full state dict loaded at the same mesh, 3 resumed steps: measured 4.7e-5 (bound
  test_fsdp_elastic's SAME_WORLD_TOL); loaded into one process (``checkpoint.load_optimizer``):
  measured 6.3e-5, the first resumed loss within 1.2e-7 (bound 1e-6); bound NEW_WORLD_TOL;
- state per rank: 13760 bytes, 0.20x AdamW's 70144 (single process: 41344 bytes for the whole
  block, 0.15x AdamW's); with a v and absmax per element of o/down's pieces and a v_cross per
  row it was 49472 bytes; bound: below AdamW's, o/down one v per column of the piece, and
  v_cross the single-process length.
"""

from __future__ import annotations

import pytest
import torch
from dist_util import read_results, resume_drift, torchrun
from test_fsdp import SPLIT_LOSS_TOL
from test_fsdp_elastic import NEW_WORLD_TOL, SAME_WORLD_TOL

pytestmark = pytest.mark.dist

STEPS, BITS, WORLD = 5, 8, 4
TP_LOSS_TOL = SPLIT_LOSS_TOL  # the FSDP tests' bounds
FULL_RESUME_TOL, ONE_PROCESS_TOL = SAME_WORLD_TOL, NEW_WORLD_TOL
CODEBOOK_TOL, FIRST_TOL = 2e-4, 1e-6
SP_GRAD_TOL = 1e-5
MODES = ("same", "split", "sp", "tp_attn")


@pytest.fixture(scope="module")
def eq(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_eq")
    torchrun("tp_train.py", str(out), str(STEPS), str(BITS), str(out / "ck"), nproc=WORLD)
    return read_results(out, ranks=WORLD)


@pytest.mark.parametrize("mode", MODES)
def test_block_sizes_are_the_single_process_ones(eq, mode):
    ref = eq[0]["ref"]["blocks"]
    for r in eq:
        assert r[mode]["blocks"] == {n: [bs] for n, bs in ref.items()}
    assert any(bs != 1 for bs in ref.values())  # blocks to agree on, whichever the rule picks


@pytest.mark.parametrize("mode", MODES)
def test_codebook_is_one_on_every_rank_and_the_single_process_one(eq, mode):
    books = [cb for r in eq for cb in r[mode]["codebooks"]]
    assert all(b == books[0] for b in books) and len(books[0]) == 2**BITS
    ref = torch.tensor(eq[0]["ref"]["codebook"])
    assert (torch.tensor(books[0]) - ref).abs().max().item() <= CODEBOOK_TOL


@pytest.mark.parametrize("mode", MODES)
def test_losses_follow_the_single_process_run(eq, mode):
    ref = eq[0]["ref"]["losses"]
    for r in eq:
        losses = r[mode]["losses"]
        assert abs(losses[0] - ref[0]) / ref[0] <= FIRST_TOL
        drift = [abs(a - b) / b for a, b in zip(losses, ref, strict=True)]
        assert max(drift) <= TP_LOSS_TOL, drift
        assert losses == eq[0][mode]["losses"]


def test_pieces_are_strided_and_rowwise_and_the_group_is_the_mesh(eq):
    for r in eq:
        run = r["split"]
        pl, segs = run["placements"], run["segments"]
        assert pl["attn.q.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert pl["attn.o.weight"] == pl["mlp.down.weight"] == "(Shard(dim=0), Shard(dim=1))"
        assert pl["attn_norm.weight"] == "(Shard(dim=0), Replicate())"
        # colwise: this rank's rows are one run of the tensor; rowwise: one run per row
        assert segs["attn.q.weight"] == segs["mlp.gate.weight"] == 1
        assert segs["attn.o.weight"] == segs["mlp.down.weight"] == 64 // 2
        assert run["group"] == [0, 1, 2, 3]


def test_sequence_parallel_norms_are_replicated_on_tp_and_sharded_on_dp(eq):
    for r in eq:
        run = r["sp"]
        pl, segs = run["placements"], run["segments"]
        # SequenceParallel() makes the norm weights Replicate on tp, fully_shard Shard(0) on dp
        assert pl["attn_norm.weight"] == pl["mlp_norm.weight"] == "(Shard(dim=0), Replicate())"
        strided = "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert pl["attn.q.weight"] == pl["mlp.up.weight"] == strided
        assert pl["attn.o.weight"] == pl["mlp.down.weight"] == "(Shard(dim=0), Shard(dim=1))"
        assert segs["attn_norm.weight"] == segs["mlp_norm.weight"] == 1
        assert segs["attn.o.weight"] == segs["mlp.down.weight"] == 64 // 2
        assert run["group"] == [0, 1, 2, 3]


def test_parameters_left_to_fsdp_on_dp_join_the_tp_weights_group(eq):
    # TP on attention only: the norms and the MLP are DTensors on the 1-D dp mesh, 2 of the
    # optimizer's 4 ranks, each tp rank holding a replica. One optimizer agrees over the 4
    # ranks, one replica counts (the MODES tests: blocks, codebook and losses are the
    # single-process ones; the MLP's blocks are in the codebook's histogram)
    ref = eq[0]["ref"]["blocks"]
    assert all(ref[f"mlp.{n}.weight"] != 1 for n in ("gate", "up", "down"))
    for r in eq:
        run = r["tp_attn"]
        pl, segs = run["placements"], run["segments"]
        for n in ("attn_norm", "mlp_norm", "mlp.gate", "mlp.up", "mlp.down"):
            assert pl[f"{n}.weight"] == "(Shard(dim=0),)", n
            assert segs[f"{n}.weight"] == 1
        assert pl["attn.o.weight"] == "(Shard(dim=0), Shard(dim=1))"
        assert run["group"] == [0, 1, 2, 3]


def test_sequence_parallel_gradients_are_the_single_process_ones(eq):
    # each tp rank's loss covers half the sequence: divided by tp, the tp-summed gradients
    # (the norms' included) are the reference ones; undivided they are twice them (drift 1.0),
    # which the losses would not show (Gefen's update does not see a uniform gradient scale)
    for r in eq:
        drift = r["sp"]["grad_drift"]
        assert set(drift) == set(eq[0]["ref"]["blocks"])
        assert max(drift.values()) <= SP_GRAD_TOL, drift


@pytest.mark.parametrize("mode", ("split", "sp", "tp_attn"))
def test_each_rank_keeps_less_state_than_adamw(eq, mode):
    for r in eq:
        mem = r[mode]["memory"]
        assert 0 < mem["state_bytes"] < mem["adamw_bytes"], mem


@pytest.mark.parametrize("mode", ["split", "sp"])
def test_a_rowwise_weight_keeps_one_v_per_column_of_its_piece_not_one_per_element(eq, mode):
    ref = eq[0]["ref"]["v"]
    for r in eq:
        v = r[mode]["memory"]["v"]
        # o/down: column blocks; the piece holds half the columns (tp = 2) of half the rows
        assert v["attn.o.weight"] == ref["attn.o.weight"] // 2
        assert v["mlp.down.weight"] == ref["mlp.down.weight"] // 2


def test_a_rowwise_weight_keeps_one_v_cross_per_rank_not_one_per_row(eq):
    ref = eq[0]["ref"]["cross"]
    assert ref["attn.o.weight"] > 0 and ref["mlp.down.weight"] > 0  # the factor to share
    for r in eq:
        mem = r["split"]["memory"]
        assert mem["v_cross"] == ref, mem["v_cross"]
        # the report counts one copy per spread tensor (every factored tensor here is spread)
        assert sorted(mem["spread_v_cross"].values()) == sorted(k for k in ref.values() if k)


def test_layouts_left_are_refused_by_name(eq):
    errors = eq[0]["errors"]
    # a 3-D mesh runs (tests/test_mesh3d.py); two replicate dims before the first that shards
    # the tensor do not
    assert "'w3'" in errors["two_replicate"] and "3-D mesh" in errors["two_replicate"]
    assert "one replicate dimension" in errors["two_replicate"]
    assert "'wp'" in errors["partial"] and "P(sum) is not supported" in errors["partial"]


def test_groups_that_do_not_nest_are_refused_naming_both(eq):
    # on rank 0: a weight on the dp mesh {0, 2}, then one on the tp mesh {0, 1}
    msg = eq[0]["errors"]["crossing"]
    assert "'on_tp'" in msg and "ranks [0, 1]" in msg and "ranks [0, 2]" in msg, msg
    assert "must nest" in msg


# -- checkpoints ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ck(eq, tmp_path_factory):
    """tp_train.py saved the checkpoints (tp_checkpoint.save_run); a fresh launch resumes."""
    root = tmp_path_factory.mktemp("tp_ck")
    ckdir = sorted(tmp_path_factory.getbasetemp().glob("tp_eq*"))[-1] / "ck"
    torchrun("tp_checkpoint.py", "resume", str(root), str(ckdir), str(BITS), nproc=WORLD)
    return dict(save=[r["ckpt"] for r in eq], resume=read_results(root, ranks=WORLD))


LAYOUTS = ("norms_on_tp", "tp_attn")


def _layout(record: dict, layout: str) -> dict:
    return record["tp_attn"] if layout == "tp_attn" else record


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dcp_resume_at_the_same_mesh_is_bit_for_bit(ck, layout):
    assert len(ck["resume"]) == WORLD
    for saved, resumed in zip(ck["save"], ck["resume"], strict=True):
        saved, resumed = _layout(saved, layout), _layout(resumed, layout)
        got = resumed["dcp"]
        assert got["state_exact"] and got["params_exact"], got["param_diff"]
        assert got["losses"] == saved["losses"][3:]
    # one run id on every rank: the norms' replicas write the same entries
    assert len({_layout(r, layout)["run"] for r in ck["save"]}) == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_state_dict_resumes_at_the_same_mesh_within_bound(ck, layout):
    for saved, resumed in zip(ck["save"], ck["resume"], strict=True):
        saved, resumed = _layout(saved, layout), _layout(resumed, layout)
        drift = resume_drift(saved["losses"], resumed["full"]["losses"], 3)
        assert drift[0] <= FIRST_TOL and max(drift) <= FULL_RESUME_TOL, drift


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_state_dict_resumes_in_one_process_within_bound(ck, eq, layout):
    ref = eq[0]["ref"]["blocks"]
    for saved, resumed in zip(ck["save"], ck["resume"], strict=True):
        saved, resumed = _layout(saved, layout), _layout(resumed, layout)
        got = resumed["one_process"]
        drift = resume_drift(saved["losses"], got["losses"], 3)
        assert drift[0] <= FIRST_TOL and max(drift) <= ONE_PROCESS_TOL, drift
        assert got["blocks"] == sorted(set(ref.values()))


# -- another mesh, with nothing but DCP's own calls ---------------------------------------------
@pytest.fixture(scope="module")
def reshard(ck, tmp_path_factory):
    """After ``ck`` (whose save the equivalence launch made): the (2, 2) checkpoint loaded at
    (dp=1, tp=4) and by FSDP2 alone, and a (1, 4) run's checkpoint loaded at (2, 2)."""
    root = tmp_path_factory.mktemp("tp_reshard")
    ckdir = sorted(tmp_path_factory.getbasetemp().glob("tp_eq*"))[-1] / "ck"
    torchrun("tp_checkpoint.py", "reshard", str(root), str(ckdir), str(BITS), nproc=WORLD)
    return read_results(root, ranks=WORLD)


RESHARDS = ("tp4", "fsdp", "tp4_to_2x2")


def _uninterrupted(ck, reshard, case: str) -> list[float]:
    return reshard[0]["saved_tp4"]["losses"] if case == "tp4_to_2x2" else ck["save"][0]["losses"]


def test_reshard_report(ck, reshard, capsys):
    """The figures docs/checkpoints.md quotes (``pytest tests/test_tp.py -s -k reshard``)."""
    with capsys.disabled():
        print("\nFSDP2 + TP, plain DCP: first, largest relative loss difference; read share")
        for case in RESHARDS:
            d = resume_drift(_uninterrupted(ck, reshard, case), reshard[0][case]["losses"], 3)
            share = max(r[case]["read_bytes"] / r[case]["saved_bytes"] for r in reshard)
            print(f"  {case}: {d[0]:.1e}, {max(d):.1e}; {share:.2f}")


@pytest.mark.parametrize("case", RESHARDS)
def test_plain_dcp_resumes_at_another_mesh_within_the_elastic_bound(ck, reshard, eq, case):
    """(2, 2) -> (1, 4), (2, 2) -> FSDP2 without tensor parallelism, (1, 4) -> (2, 2): each rank
    cuts its pieces from the saved ones (``integrations.dcp``, ``method.portable``). The rows of
    a rowwise weight's piece share their column v; loaded at another tp they are merged or
    split per column, so the drift is the elastic one, against the run that never stopped."""
    ref = eq[0]["ref"]["blocks"]
    for r in reshard:
        got = r[case]
        drift = resume_drift(_uninterrupted(ck, reshard, case), got["losses"], 3)
        assert drift[0] <= FIRST_TOL and max(drift) <= NEW_WORLD_TOL, drift
        assert got["blocks"] == ref  # the single-process blocks, not the template's
        assert got["losses"] == reshard[0][case]["losses"]


def test_the_full_state_dict_resumes_at_another_mesh_within_the_elastic_bound(ck, reshard):
    for r in reshard:
        drift = resume_drift(ck["save"][0]["losses"], r["full_tp4"]["losses"], 3)
        assert drift[0] <= FIRST_TOL and max(drift) <= NEW_WORLD_TOL, drift


@pytest.mark.parametrize("case", RESHARDS)
def test_each_rank_reads_its_share_of_a_tensor_parallel_checkpoint(reshard, case):
    """Its pieces' share of the per-element fields (codes; m and v where B = 1: each tensor's times
    the share of its elements the rank holds), exactly, never the whole; and of the rest (block
    values, and what every rank shares: step, codebook, the factor) at most one copy. Under tensor
    parallelism a saved rank's element range (first to last element held) spans the rows of every tp
    rank, so a new rank may read every saved rank's block values of a rowwise weight: at most 8
    bytes per B elements (a column's, for column blocks) against the codes' one per element."""
    for r in reshard:
        got = r[case]
        assert 0 < got["read_per_element"] == got["share_per_element"], got
        assert got["read_per_element"] < got["saved_per_element"] / 2, got
        rest = got["read_bytes"] - got["read_per_element"]
        assert rest <= got["saved_bytes"] - got["saved_per_element"], got
