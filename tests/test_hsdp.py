"""Gefen under HSDP on 4 gloo ranks as a 2 x 2 (replicate, shard) mesh: FSDP2 on a 2-D mesh,
FSDP1 HYBRID_SHARD and _HYBRID_SHARD_ZERO2.

Each fixture is one torchrun launch (tests/dist/hsdp*.py) whose ranks write their measurements;
the tests below assert on them. Tolerances are tests/test_fsdp.py's, for the same reasons:
"same" runs (every rank on the whole batch) must choose the single-process block sizes and
codebook exactly, and reproduce its losses bit for bit where no shard boundary cuts a block,
within CUT_LOSS_TOL where one does; "split" runs (data parallel over all 4 ranks) hold codebooks
to being identical on every rank and losses within SPLIT_LOSS_TOL. HSDP's replicas see the same
averaged gradient, so each replica group must hold the same bits as every other, and as FSDP2
on the shard mesh dimension alone (the same shard boundaries, no replicas).
"""

from __future__ import annotations

import pytest
import torch
from dist_util import duplicated_cross_bytes, read_results, torchrun
from test_fsdp import CUT_LOSS_TOL, SPLIT_LOSS_TOL

pytestmark = pytest.mark.dist

STEPS, BITS, WORLD = 5, 8, 4
RUNS = [
    ("gpt", "hsdp2", "same"),
    ("gpt", "hsdp2", "split"),
    ("gpt", "hybrid", "same"),
    ("gpt", "hybrid", "split"),
    ("gpt", "hybrid_orig", "same"),
    ("gpt", "hybrid_zero2", "same"),
    ("odd", "hsdp2", "same"),
    ("odd", "hybrid", "same"),
]
# mesh [[0, 1], [2, 3]]: a row is a shard group, a column a replicate group
SHARD_GROUPS = [[0, 1], [0, 1], [2, 3], [2, 3]]


@pytest.fixture(scope="module")
def eq(tmp_path_factory):
    out = tmp_path_factory.mktemp("hsdp_eq")
    torchrun("hsdp.py", str(out), str(STEPS), str(BITS), nproc=WORLD)
    return read_results(out, ranks=WORLD)


def _ids(runs):
    return ["/".join(r) for r in runs]


def _runs(eq, kind, setup, mode):
    return [r[f"{kind}/{setup}/{mode}"] for r in eq]


@pytest.mark.parametrize("kind,setup,mode", RUNS, ids=_ids(RUNS))
def test_blocks_reduce_over_the_shard_group_only(eq, kind, setup, mode):
    assert [run["shard_group"] for run in _runs(eq, kind, setup, mode)] == SHARD_GROUPS


@pytest.mark.parametrize("kind,setup,mode", RUNS, ids=_ids(RUNS))
def test_block_sizes_are_the_single_process_ones(eq, kind, setup, mode):
    ref = eq[0][f"{kind}/ref"]["blocks"]
    seen = {}
    for run in _runs(eq, kind, setup, mode):
        for name, bs in run["blocks"].items():
            assert bs == ref[name], (name, bs, ref[name])
            seen[name] = bs
    assert set(seen) == set(ref)
    assert any(bs > 1 or bs < 0 for bs in seen.values())  # some tensor shares v


@pytest.mark.parametrize("kind,setup,mode", RUNS, ids=_ids(RUNS))
def test_codebooks_identical_on_all_ranks_and_single_process(eq, kind, setup, mode):
    ref = torch.tensor(eq[0][f"{kind}/ref"]["codebooks"][0])
    books = [cb for run in _runs(eq, kind, setup, mode) for cb in run["codebooks"]]
    assert all(b == books[0] for b in books)
    assert len(books[0]) == 2**BITS
    if mode == "same":
        assert torch.equal(torch.tensor(books[0]), ref)


@pytest.mark.parametrize("kind,setup,mode", RUNS, ids=_ids(RUNS))
def test_loss_follows_single_process(eq, kind, setup, mode):
    ref = eq[0][f"{kind}/ref"]["losses"]
    runs = _runs(eq, kind, setup, mode)
    assert all(run["losses"] == runs[0]["losses"] for run in runs)
    cut = sum(run["cut_blocks"] for run in runs)
    drift = max(abs(a - b) for a, b in zip(runs[0]["losses"], ref, strict=True))
    if mode == "same" and not cut:
        assert drift == 0.0
        assert max(max(run["param_drift"].values()) for run in runs) == 0.0
    else:
        assert drift <= (CUT_LOSS_TOL[kind] if cut else SPLIT_LOSS_TOL), drift


@pytest.mark.parametrize("kind,setup,mode", RUNS, ids=_ids(RUNS))
def test_replica_groups_hold_the_same_bits(eq, kind, setup, mode):
    """Ranks 0 and 2 (and 1 and 3) hold the same piece in the two replica groups: the same
    state and parameters; the two ranks of a shard group hold different pieces."""
    runs = _runs(eq, kind, setup, mode)
    for key in ("state_digest", "param_digest"):
        assert runs[0][key] == runs[2][key] and runs[1][key] == runs[3][key], key
        assert runs[0][key] != runs[1][key], key


@pytest.mark.parametrize("kind", ["gpt", "odd"])
def test_hsdp_is_fsdp2_on_the_shard_dimension_bit_for_bit(eq, kind):
    """The same shard boundaries and, in a "same" run, the same gradient: HSDP must add
    nothing but the replicas, so each rank's state and parameters are those of FSDP2 on the
    mesh's shard dimension alone."""
    hsdp, flat = _runs(eq, kind, "hsdp2", "same"), _runs(eq, kind, "fsdp2_shard", "same")
    for h, f in zip(hsdp, flat, strict=True):
        assert h["losses"] == f["losses"]
        assert h["state_digest"] == f["state_digest"]
        assert h["param_digest"] == f["param_digest"]
        assert h["memory"] == f["memory"]


def test_split_hsdp_follows_1d_fsdp2_over_the_world(eq):
    """Data parallel over 4 ranks either way; the shard boundaries differ (2 pieces, 4)."""
    hsdp, world = _runs(eq, "gpt", "hsdp2", "split"), _runs(eq, "gpt", "fsdp2_world", "split")
    drift = max(abs(a - b) for a, b in zip(hsdp[0]["losses"], world[0]["losses"], strict=True))
    assert drift <= CUT_LOSS_TOL["gpt"], drift
    assert world[0]["blocks"] == hsdp[0]["blocks"]


def test_the_layouts_exercise_cut_blocks_and_padding(eq):
    """Guards the tests above against a model change that would leave nothing to check."""
    assert sum(run["cut_blocks"] for run in _runs(eq, "odd", "hsdp2", "same")) > 0
    assert sum(run["cut_blocks"] for run in _runs(eq, "gpt", "hsdp2", "same")) == 0
    assert sum(run["padding"] for run in _runs(eq, "odd", "hybrid", "same")[:2]) == 1
    for setup in ("hsdp2", "hybrid", "hybrid_orig"):
        assert eq[0][f"gpt/{setup}/same"]["memory"]["spread_v_cross"], setup


@pytest.mark.parametrize("kind,setup,mode", RUNS, ids=_ids(RUNS))
def test_each_rank_reports_its_state_beside_adamws(eq, kind, setup, mode):
    """Each rank keeps the state of its piece: one shard group together holds the single-
    process bytes (plus a v and absmax per cut piece, B = 1 padding and the v_cross copies),
    each replica group as much again; AdamW would keep 8 bytes per element each rank holds."""
    runs = _runs(eq, kind, setup, mode)
    ref = eq[0][f"{kind}/ref"]["state_bytes"]
    for group in ([0, 1], [2, 3]):
        members = [runs[r] for r in group]
        total = sum(run["memory"]["state_bytes"] for run in members)
        extra = sum(8 * run["cut_blocks"] + 8 * run["padding"] for run in members)
        extra += duplicated_cross_bytes([run["memory"] for run in members])
        assert ref <= total <= ref + extra
    for run in runs:
        mem = run["memory"]
        assert mem["adamw_bytes"] == 8 * mem["params"] == 8 * mem["local_numel"]
        assert mem["state_bytes"] < mem["adamw_bytes"] / 4
    assert [r["memory"] for r in runs[:2]] == [r["memory"] for r in runs[2:]]  # the replicas


def test_inner_dim_and_2d_sharding_accepted_two_replicate_dims_refused_by_name(eq):
    errors = eq[0]["errors"]
    # sharding on an inner dim, on both mesh dims and strided: pieces in the tensor's coordinates
    # (tensor parallelism, tests/test_tp.py)
    assert errors["hsdp_dim1"] == errors["tp_2d"] == errors["strided"] == "accepted"
    assert "'h.0.w3'" in errors["mesh_3d"] and "3-D mesh" in errors["mesh_3d"]
    # 3-D meshes run (tests/test_mesh3d.py); two replicate dims before the sharding one do not
    assert "one replicate dimension" in errors["mesh_3d"]


# -- checkpoints ---------------------------------------------------------------------------------
CASES = ["gpt/hsdp2/dcp", "odd/hsdp2/dcp", "gpt/hybrid/sharded", "gpt/hybrid_orig/dcp"]


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp_ck")
    out = {}
    for mode in ("save", "resume"):
        torchrun("hsdp_checkpoint.py", mode, str(root / mode), str(root / "ck"), "4", nproc=WORLD)
        out[mode] = read_results(root / mode, ranks=WORLD)
    out["dir"] = root / "ck"
    return out


@pytest.mark.parametrize("case", CASES)
def test_resume_equals_the_uninterrupted_run_bit_for_bit(ck, case):
    assert len(ck["resume"]) == WORLD
    for saved, resumed in zip(ck["save"], ck["resume"], strict=True):
        assert resumed[case]["state_exact"]
        assert resumed[case]["params_exact"], resumed[case]["param_diff"]
        assert resumed[case]["losses"] == saved[case]["losses"][3:]


@pytest.mark.parametrize("case", CASES)
def test_every_rank_agrees_on_the_run_id(ck, case):
    """Both replica groups write the same keys, and DCP keeps one copy of each: the run id in
    a rank's entry and the checkpoint's must be the same whichever replica wrote which."""
    assert len({r[case]["run"] for r in ck["save"]}) == 1


def test_dcp_keys_name_no_rank_and_one_shard_groups_pieces(ck):
    """FSDP2's HSDP writes each parameter's state in global coordinates: its block values by
    the element ranges of the shard group's two pieces, the same from both replica groups;
    FSDP1 HYBRID_SHARD keeps one entry per rank of the shard group."""
    from torch.distributed.checkpoint import FileSystemReader

    head = "optim.state.transformer.h.0.attn.c_attn.weight."
    meta = FileSystemReader(str(ck["dir"] / "gpt-hsdp2-dcp" / "dcp")).read_metadata()
    keys = [k[len(head) :] for k in meta.state_dict_metadata if k.startswith(head)]
    assert not any(k.startswith("gefen.rank") for k in keys)
    ranges = sorted(k[len("pieces.") :] for k in keys if k.startswith("pieces."))
    numel = 192 * 64
    assert ranges == [f"0.{numel // 2}", f"{numel // 2}.{numel // 2}"]
    meta = FileSystemReader(str(ck["dir"] / "gpt-hybrid_orig-dcp" / "dcp")).read_metadata()
    ranks = sorted(
        k[len(head + "gefen.rank") :]
        for k in meta.state_dict_metadata
        if k.startswith(head + "gefen.rank")
    )
    assert ranks == ["0", "1"]


def test_an_hsdp_checkpoint_loads_into_other_shard_boundaries(ck):
    """FSDP2 over all 4 ranks reads the 2-piece HSDP checkpoint with plain DCP (how close:
    tests/test_dcp_reshard.py)."""
    for r in ck["resume"]:
        assert r["other_layout"] is None, r["other_layout"]
