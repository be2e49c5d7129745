"""Gefen under DeepSpeed ZeRO on 2 CPU ranks against single-process Gefen (tests/dist/ds_zero.py).

One 2-rank launch trains every configuration and records what each rank saw; a 1-rank launch then
tries to resume its checkpoints. DeepSpeed start-up is slow, so the checks share those launches.
"""

import math

import pytest
from dist_util import deepspeed_run, duplicated_cross_bytes, read_results

pytestmark = pytest.mark.dist

FP32 = ("zero1", "zero2", "zero3", "zero2_offload")
ALL = (*FP32, "bf16_zero1")
WRAPPER = {
    "zero1": "DeepSpeedZeroOptimizer",
    "zero2": "DeepSpeedZeroOptimizer",
    "zero3": "DeepSpeedZeroOptimizer_Stage3",
    "zero2_offload": "DeepSpeedZeroOptimizer",
    "bf16_zero1": "BF16_Optimizer",
}

# Mean loss over the 2 ranks, per step, vs the single-process run. Two things separate them, both
# seen on this model: (1) a block cut by a partition boundary keeps a second moment and scale per
# piece (a cut 4096-element block, when c_attn took 64-row blocks: up to 7e-4 in its parameters
# after one step); (2) ulp-level differences between two CPU runs of the same backward (LayerNorm
# parameter gradients, from run to run). Quantising m turns either into code flips that grow: the
# largest drift measured over 6 steps was 8e-6, and 0 where nothing is cut. 1e-4 is 12x that,
# and a mapping bug exceeds it: leaving the held groups' weights stale for one step already does.
LOSS_TOL = 1e-4
# Where a partition boundary splits a column-blocked tensor (ZeRO-3 splits the 64x64 attention
# c_proj, B = -64), every column keeps v and absmax per piece: after one step that tensor's
# parameters differ by up to 1.9e-3 and the loss drifts 1.4e-4 over 6 steps. 1e-3 is 7x that.
# A mapping bug still fails STEP1_TOL below, which covers every parameter outside the cut ones.
SPLIT_COLUMNS_LOSS_TOL = 1e-3
# After one step, parameters outside cut blocks: only the ulp-level noise of (2) may remain
# (1 ulp of a LayerNorm weight near 1 is 6e-8); a wrong block or codebook moves them by ~lr.
STEP1_TOL = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds")
    ckpt = out / "ckpt"
    deepspeed_run("ds_zero.py", str(out), str(ckpt))
    ranks = read_results(out, ranks=2)
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["world_size"] == 2
    one = tmp_path_factory.mktemp("ds1")
    deepspeed_run("ds_zero.py", str(one), str(ckpt), "resize", nproc=1)
    (resized,) = read_results(one, ranks=1)
    return ranks, resized


@pytest.mark.parametrize("name", ALL)
def test_wrapper_and_partitions(runs, name):
    ranks, _ = runs
    for r in ranks:
        assert r[name]["wrapper"] == WRAPPER[name]
    if name == "zero3":  # several sub-groups: the first step holds all but the last
        assert ranks[0][name]["partitions"] > 2


@pytest.mark.parametrize("name", FP32)
def test_codebook_and_blocks_equal_single_process(runs, name):
    ranks, _ = runs
    ref = ranks[0]["ref"]
    seen = {}
    for r in ranks:
        assert r[name]["codebook"] == ref["codebook"]
        for tensor, bs in r[name]["blocks"].items():
            assert bs == ref["blocks"][tensor], (r["rank"], tensor)
            seen[tensor] = bs
    assert seen == ref["blocks"]  # every tensor has a piece on some rank
    assert any(bs > 1 for bs in seen.values())


def test_bf16_codebook_same_on_all_ranks(runs):
    ranks, _ = runs
    a, b = (r["bf16_zero1"] for r in ranks)
    assert a["codebook"] == b["codebook"] and len(a["codebook"]) == 256
    shared = set(a["blocks"]) & set(b["blocks"])
    assert shared and all(a["blocks"][t] == b["blocks"][t] for t in shared)
    assert all(math.isfinite(x) for x in a["losses"])


@pytest.mark.parametrize("name", FP32)
def test_loss_follows_single_process(runs, name):
    ranks, _ = runs
    ref = ranks[0]["ref"]["losses"]
    for r in ranks:
        got = r[name]["losses"]
        assert got[0] == ref[0]  # same weights, same data: the first forward is bitwise equal
        drift = max(abs(a - b) for a, b in zip(got, ref, strict=True))
        split = {t for t, bs in r[name]["blocks"].items() if bs < 0} & {
            c[0] for c in r[name]["cut_blocks"]
        }
        assert drift <= (SPLIT_COLUMNS_LOSS_TOL if split else LOSS_TOL), (name, got, ref)
        assert r[name]["after1_outside"] <= STEP1_TOL


def test_cut_blocks_are_exercised(runs):
    """ZeRO-3 splits the column-blocked attention c_proj at a partition boundary (whole-column
    absmax for the codebook, per-piece state), so cut blocks are under test; ZeRO-1's boundary
    falls between two rows of row-blocked tensors, so it cuts nothing and its run is the single
    process's bit for bit (the whole-block statistics of cut row blocks are under test with
    FSDP1's flat shards, tests/test_fsdp.py)."""
    ranks, _ = runs
    cuts = ranks[0]["zero3"]["cut_blocks"]
    assert 0 < ranks[0]["zero3"]["after1_inside"] < 1e-2
    split = [c for c in cuts if c[0].endswith("attn.c_proj.weight")]
    assert split and ranks[0]["zero3"]["blocks"]["transformer.h.0.attn.c_proj.weight"] == -64
    assert ranks[0]["zero1"]["cut_blocks"] == []
    assert all(r["zero1"]["losses"] == ranks[0]["ref"]["losses"] for r in ranks)


@pytest.mark.parametrize("name", ALL)
def test_checkpoint_resume_is_exact(runs, name):
    ranks, _ = runs
    for r in ranks:
        o = r[name]
        assert o["resumed_losses"] == o["losses"][3:]
        assert o["resume_exact"]
        assert o["resumed_codebook"] == o["codebook"]


@pytest.mark.parametrize("name", ("zero1", "zero2", "zero3"))
def test_state_bytes_below_adamw_under_same_stage(runs, name):
    ranks, _ = runs
    total = 0
    for r in ranks:
        mem = r[name]["memory"]
        assert mem["adamw_bytes"] == r[name]["adamw_state_bytes"]  # the report's AdamW is real
        assert mem["state_bytes"] < mem["adamw_bytes"]
        total += mem["state_bytes"]
    # The sharded state is the single-process state, plus a few padding elements, the second
    # (v, absmax) entry of each cut block and a copy of v_cross per further piece of a tensor.
    single = ranks[0]["ref"]["memory"]
    copies = duplicated_cross_bytes([r[name]["memory"] for r in ranks])
    if name == "zero3":  # every tensor is split: the v_cross sums are all-reduced each step
        assert copies > 0
    assert single <= total <= single + 1024 + copies


def test_unsupported_configurations_fail_clearly(runs):
    ranks, _ = runs
    refused = ranks[0]["refused"]
    assert "elastic_checkpoint is not supported" in refused["elastic"]
    assert "load_universal_checkpoint is not supported" in refused["universal"]
    assert "saved by ZeRO-2 on rank 0 of 2" in refused["zero2_state_into_zero3"]
    assert "into ZeRO-3" in refused["zero2_state_into_zero3"]
    assert "not saved under DeepSpeed" in refused["plain_state"]
    # ZeRO-2 with round-robin gradients orders tensors differently from ZeRO-1: Gefen's own check
    assert "a different model or sharding" in refused["zero2_into_zero1"]
    # Through the engine a ZeRO-2 checkpoint loads into ZeRO-3: Gefen re-cuts it (DeepSpeed
    # alone would find no file it can read).
    assert refused["zero2_into_zero3_engine"] is None, refused["zero2_into_zero3_engine"]


def test_a_checkpoint_loads_at_another_world_size(runs):
    """Saved on 2 ranks, loaded by 1: Gefen's state is re-cut (tests/test_zero_elastic.py
    measures how close the resumed run stays)."""
    _, resized = runs
    assert resized["world_size"] == 1
    for name in ("zero2", "zero3"):
        assert resized[name] is None, resized[name]


def test_zero_to_fp32_reads_gefen_checkpoints(runs):
    """DeepSpeed's weight consolidation reads the checkpoint's fp32 partitions, which Gefen's
    state must not disturb."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ranks, _ = runs
    ckpt = ranks[0]["ckpt"]
    for name in ("zero1", "zero2", "zero3"):
        sums = ranks[0][name]["saved_sums"]
        sd = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag=name)
        assert set(sums) <= set(sd)
        for n, s in sums.items():
            assert abs(float(sd[n].detach().double().sum()) - s) <= 1e-9 * max(1.0, abs(s)), (
                name,
                n,
            )
