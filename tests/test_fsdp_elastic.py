"""Full and sharded state dicts of FSDP2 and FSDP1, saved on 2 ranks, resumed on 1, 2 and 4.

One torchrun launch saves, then resumes at 2 ranks (``tests/dist/fsdp_elastic.py``: the demo
GPT under FSDP2, FSDP1 with flat and with original parameters, 30 steps data parallel over the
same global batches, checkpoints at step 10); one launch per other world size resumes every
checkpoint through the frameworks' own functions, Gefen built afresh with no configure call:
FSDP2 full state dicts
(``get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)`` saved by rank 0, loaded
with ``set_optimizer_state_dict(full_state_dict=True)``, also ``broadcast_from_rank0=True``, and
a ``dcp.save`` of full state dicts read back with ``checkpoint.read_dcp``); FSDP1
``FSDP.optim_state_dict`` under FULL_STATE_DICT (also ``rank0_only=True``) and under
SHARDED_STATE_DICT with DCP, loaded with ``FSDP.optim_state_dict_to_load``, the full ones also
under ``FullOptimStateDictConfig(rank0_only=True)`` with rank 0 alone passing the dict (what
Accelerate's FULL_STATE_DICT load does): Gefen's entries are ``bytes`` with a ``cpu()``
(``integrations.fsdp.Entry``), which that path calls on every value of rank 0's dict.

How close, and why (4 bits, the 20 resumed steps' losses against the uninterrupted run's):

- The first resumed loss is the saved model's, to the ranks' summation order: measured 8.5e-8
  relative at most; bound 1e-6 (``tests/test_elastic.py``'s).
- FSDP1 at the same world size resumes bit for bit: each rank's entry is its state as saved.
- An FSDP2 full state dict holds the whole tensor's single-process state (block pieces that a
  shard boundary cut merged: ``method.portable``), which each rank cuts again: measured 7.1e-5
  at the same world size; bound 3e-4.
- At another world size the pieces are merged and cut again, and the gradient average rounds
  differently: measured 1.2e-5 (FSDP1 2 -> 1) to 5.7e-5 (FSDP1 2 -> 4), 7.3e-5 (FSDP2 2 -> 4)
  and 1.1e-4 (FSDP2 2 -> 1); bound 5e-4.
"""

from __future__ import annotations

import pytest
import torch
from dist_util import read_results, resume_drift, torchrun

from gefen_dist import Gefen, checkpoint
from gefen_dist.demo.model import GPT, GPTConfig

pytestmark = pytest.mark.dist

TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=64)  # tests/dist/fsdp_common.py's
STEPS, SAVE_AT, BITS = 30, 10, 4
FIRST_TOL, SAME_WORLD_TOL, NEW_WORLD_TOL = 1e-6, 3e-4, 5e-4
WORLDS = (1, 2, 4)
CASES = [  # tests/dist/fsdp_elastic.py's: setup / checkpoint / how it is loaded
    "fsdp2/full/full",
    "fsdp2/full/broadcast",
    "fsdp2/dcp_full/full",
    "fsdp1_flat/full/fsdp1",
    "fsdp1_flat/rank0/fsdp1",
    "fsdp1_flat/sharded/fsdp1",
    "fsdp1_orig/full/fsdp1",
    "fsdp1_orig/rank0/fsdp1",
    "fsdp1_orig/sharded/fsdp1",
    "fsdp1_flat/rank0/fsdp1_rank0",
    "fsdp1_orig/rank0/fsdp1_rank0",
]
RESUMES = [(case, world) for case in CASES for world in WORLDS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp_elastic")
    ck = d / "ck"

    def resume(world):
        return ("resume", str(d / f"resume{world}"), str(ck), str(SAVE_AT), str(STEPS), str(BITS))

    save = ("save", str(d / "save"), str(ck), str(STEPS), str(SAVE_AT), str(BITS))
    torchrun("fsdp_elastic.py", *save, "+", *resume(2), timeout=900)  # the save, then at 2
    for world in WORLDS:
        if world != 2:
            torchrun("fsdp_elastic.py", *resume(world), nproc=world, timeout=900)
    saved = read_results(d / "save", ranks=2)
    resumed = {world: read_results(d / f"resume{world}", ranks=world) for world in WORLDS}
    return saved, resumed, ck


def _drift(runs, case, world):
    saved, resumed, _ = runs
    got = resumed[world][0]["losses"][case]
    assert len(got) == STEPS - SAVE_AT
    return resume_drift(saved[0][case.split("/")[0]], got, SAVE_AT)


@pytest.mark.parametrize("case,world", RESUMES, ids=[f"{c}-to-{w}" for c, w in RESUMES])
def test_a_resume_starts_from_the_saved_model_and_stays_within_the_drift_bound(runs, case, world):
    drift = _drift(runs, case, world)
    assert drift[0] <= FIRST_TOL
    if world == 2 and case.startswith("fsdp1"):
        assert max(drift) == 0.0  # each rank's entry is its state as saved
        return
    bound = SAME_WORLD_TOL if world == 2 else NEW_WORLD_TOL
    assert max(drift) <= bound, f"max relative loss drift {max(drift):.2e}"


def test_an_fsdp2_full_state_dict_holds_each_tensors_single_process_state(runs):
    _, _, ck = runs
    tree = torch.load(ck / "fsdp2_full.pt", weights_only=True)
    state = tree["optim"]["state"]
    assert len(state) == 16
    assert not any(str(k).startswith("gefen.") for st in state.values() for k in st)
    qkv = state["transformer.h.0.attn.c_attn.weight"]
    assert [seg[:3] for seg in qkv["layout"].tolist()] == [[0, 192 * 64, 0]]  # whole
    dcp_tree = checkpoint.read_dcp(ck / "fsdp2_dcp_full")
    for name, st in state.items():
        for k, v in st.items():
            assert torch.equal(v, dcp_tree["optim"]["state"][name][k]), (name, k)


def test_an_fsdp2_full_state_dict_loads_into_one_process_and_steps(runs):
    _, _, ck = runs
    tree = torch.load(ck / "fsdp2_full.pt", weights_only=True)
    torch.manual_seed(0)
    model = GPT(TINY)
    model.load_state_dict(tree["model"])
    opt = Gefen(model.parameters(), bits=BITS, lr=3e-3, weight_decay=0.1)
    checkpoint.load_optimizer(opt, model, tree["optim"])
    w = model.transformer.wte.weight
    assert int(opt.state[w]["step"]) == SAVE_AT
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(x, x)[1].backward()
    before = w.detach().clone()
    opt.step()
    assert not torch.equal(before, w) and torch.isfinite(w).all()


def test_an_fsdp1_full_state_dict_carries_every_ranks_entry(runs):
    _, _, ck = runs
    for setup in ("fsdp1_flat", "fsdp1_orig"):
        for saved in ("full", "rank0"):
            tree = torch.load(ck / f"{setup}_{saved}.pt", weights_only=True)
            for st in tree["optim"]["state"].values():
                assert {"gefen.rank0", "gefen.rank1", "gefen.run", "step"} <= set(st)


@pytest.mark.parametrize("world", (1, 4))
def test_another_model_and_a_missing_rank_are_refused_by_name(runs, world):
    _, resumed, _ = runs
    errors = resumed[world][0]["errors"]
    assert "transformer.wte.weight (256, 96)" in errors["fsdp1_flat/other_model"]
    assert "'transformer.wte.weight': (256, 64)" in errors["fsdp1_flat/other_model"]
    assert "a different model" in errors["fsdp1_orig/other_model"]
    assert "(256, 96)" in errors["fsdp2/other_model"]
    assert "a different model" in errors["fsdp2/other_model"]
    for setup in ("fsdp1_flat", "fsdp1_orig"):
        msg = errors[f"{setup}/missing_rank"]
        assert "transformer.wte.weight" in msg
        assert "saved by 2 ranks, and the checkpoint lacks the entries of rank(s) [1]" in msg
        assert f"of {world} needs to cut its piece" in msg


@pytest.mark.parametrize("setup", ("fsdp1_flat", "fsdp1_orig"))
def test_an_fsdp1_full_state_dict_consolidates_into_one_process(runs, setup):
    """A flat parameter's entries hold pieces of all its unit's tensors, copied to each FQN:
    consolidating takes each FQN's own tensor."""
    _, _, ck = runs
    tree = torch.load(ck / f"{setup}_full.pt", weights_only=True)
    whole, done = checkpoint.consolidate(tree)
    assert len(done) == 16
    qkv = whole["optim"]["state"]["transformer.h.0.attn.c_attn.weight"]
    assert [seg[:3] for seg in qkv["layout"].tolist()] == [[0, 192 * 64, 0]]
    torch.manual_seed(0)
    model = GPT(TINY)
    model.load_state_dict(whole["model"])
    by_name = dict(model.named_parameters())
    order = whole["optim"]["param_groups"][0]["params"]  # FSDP1's: the units' flat order
    opt = Gefen([by_name[n] for n in order], bits=BITS, lr=3e-3, weight_decay=0.1)
    checkpoint.load_optimizer(opt, model, whole["optim"])
    assert int(opt.state[model.transformer.wte.weight]["step"]) == SAVE_AT
