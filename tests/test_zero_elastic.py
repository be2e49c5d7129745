"""A DeepSpeed ZeRO checkpoint of Gefen resumes at another data-parallel degree and ZeRO stage.

What the user types is what they type at the same layout: ``engine.load_checkpoint(dir)``
(``gefen_dist.integrations.deepspeed``'s module docstring says how Gefen's state is re-cut).

Runs (tests/dist/zero_elastic.py under torchrun: ``deepspeed.initialize`` reads torchrun's
environment, and the subject here is the checkpoint, not the launcher, which
tests/test_dist_train.py and tests/test_registration.py run; one launch per world size, running
that size's jobs in turn; the tiny GPT, data parallel over
the same global batches of 4 sequences at every degree, 30 steps, a checkpoint after 10, 4-bit
Gefen): ZeRO-1, ZeRO-2 and ZeRO-3 saved on 2 ranks, resumed at 1 and 4 ranks and across the
ZeRO-2 / ZeRO-3 boundary, each compared step by step with the uninterrupted run on 2 ranks.

How close, and why: the master weights come back exact (the saved fp32 partitions put together
and cut again), so the first resumed loss differs only by the ranks' summation order of the loss
(measured: 0 at 1 rank and at 2, 8.6e-8 relative at 4; bound 1e-6). After that, Gefen's block
pieces that one layout cut and the other did not are merged or split (``method.portable``), and
another degree changes the rounding of the gradient average. Measured largest relative loss
difference from the uninterrupted run over the 20 resumed steps: ZeRO-2 2 -> 1 7.7e-5, 2 -> 4
1.8e-5; ZeRO-1 2 -> 4 1.7e-7; ZeRO-2 -> ZeRO-3 (2 ranks) 1.7e-4; ZeRO-3 -> ZeRO-2 1.2e-4; ZeRO-3
2 -> 1 2.1e-4. Bound 1e-3, about 5 times the largest.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from dist_util import read_results, resume_drift, torchrun

from gefen_dist import Gefen, checkpoint
from gefen_dist.demo.model import GPT, GPTConfig

pytestmark = pytest.mark.dist

STEPS, SAVE_AT = 30, 10
FIRST_TOL, DRIFT_TOL = 1e-6, 1e-3
SAVES = {"z1x2": 1, "z2x2": 2, "z3x2": 3}  # name: ZeRO stage, all on 2 ranks
RESUMES = [  # (saved by, ranks, ZeRO stage)
    ("z2x2", 1, 2),
    ("z2x2", 4, 2),
    ("z1x2", 4, 1),
    ("z2x2", 2, 3),
    ("z3x2", 2, 2),
    ("z3x2", 1, 3),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tmp_path_factory.mktemp("zero_elastic")


def _launch(base, world: int, jobs: list[list[str]]) -> None:
    """One torchrun launch of ``world`` ranks running ``jobs`` in turn."""
    spec = base / f"jobs{world}.json"
    spec.write_text(json.dumps([[str(a) for a in j] for j in jobs]))
    torchrun("zero_elastic.py", str(spec), nproc=world)


def _resume_dir(base, src, world, stage):
    return base / f"{src}-to-z{stage}x{world}"


@pytest.fixture(scope="module")
def launches(base):
    """Every launch of the module, one per world size: on 2 ranks the saves, then the resumes
    of them at 2 ranks and the single-process checkpoint's load (``from_one``); then the
    resumes at 1 rank and the refusals, then those at 4. Returns the single process's losses
    (``from_one``'s baseline)."""
    model, opt = _one_process()
    losses = _train(model, opt, 0, SAVE_AT)
    pt = base / "one.pt"
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, pt)
    losses += _train(model, opt, SAVE_AT, STEPS)
    by_world: dict[int, list[list]] = {2: [["save", base / n, s] for n, s in SAVES.items()]}
    for src, world, stage in RESUMES:
        job = ["resume", _resume_dir(base, src, world, stage), base / src / "ckpt", stage]
        by_world.setdefault(world, []).append(job)
    by_world[2].append(["from_one", base / "from_one", pt])
    by_world[1].append(["refuse", base / "refused", base / "z2x2" / "ckpt", 2])
    for world in (2, 1, 4):
        _launch(base, world, by_world[world])
    return losses


@pytest.fixture(scope="module")
def runs(base, launches):
    saved = {name: read_results(base / name, ranks=2) for name in SAVES}
    resumed = {
        (src, world, stage): read_results(_resume_dir(base, src, world, stage), ranks=world)
        for src, world, stage in RESUMES
    }
    (refused,) = read_results(base / "refused", ranks=1)
    return saved, resumed, refused


def _ids(rs):
    return [f"{s}-to-z{t}x{w}" for s, w, t in rs]


def _drift(saved, resumed):
    assert len(resumed[0]["losses"]) == STEPS - SAVE_AT
    return resume_drift(saved[0]["losses"], resumed[0]["losses"], SAVE_AT)


@pytest.mark.parametrize("key", RESUMES, ids=_ids(RESUMES))
def test_the_resumed_engine_is_the_one_asked_for_at_the_saved_step(runs, key):
    _, resumed, _ = runs
    src, world, stage = key
    assert len(resumed[key]) == world
    for r in resumed[key]:
        assert r["world"] == world and r["wrapper"] == f"ZeRO-{stage}"
        assert r["loaded"] and r["global_steps"] == SAVE_AT
        assert "optimizer" not in r["client"] and "ds_version" in r["client"]


@pytest.mark.parametrize("key", RESUMES, ids=_ids(RESUMES))
def test_a_resume_at_another_degree_or_stage_starts_from_the_saved_model(runs, key):
    saved, resumed, _ = runs
    assert _drift(saved[key[0]], resumed[key])[0] <= FIRST_TOL


@pytest.mark.parametrize("key", RESUMES, ids=_ids(RESUMES))
def test_a_resume_at_another_degree_or_stage_stays_within_the_drift_bound(runs, key):
    saved, resumed, _ = runs
    drift = _drift(saved[key[0]], resumed[key])
    assert max(drift) <= DRIFT_TOL, f"max relative loss drift {max(drift):.2e}"


def test_the_resumed_run_keeps_the_saved_block_sizes(runs):
    """Block sizes belong to the tensor, chosen on the saved run's first step: right after the
    load, every resume of one checkpoint holds state of every tensor with the same block sizes
    (a Gefen whose state was not restored would hold none until its next step); each resume
    keeps its own checkpoint's."""
    _, resumed, _ = runs
    by_source: dict[str, dict[str, int]] = {}
    for (src, _, _), rs in resumed.items():
        seen: dict[str, int] = {}
        for r in rs:
            seen.update(r["blocks"])
        assert len(seen) == 16
        assert by_source.setdefault(src, seen) == seen
    assert 1 in by_source["z2x2"].values() and len(set(by_source["z2x2"].values())) >= 3
    assert by_source["z1x2"] == by_source["z2x2"]


def test_a_checkpoint_of_another_model_is_refused_by_name_before_anything_changes(runs):
    _, _, refused = runs
    r = refused["another_model"]
    assert r["error"].startswith("ValueError: ")
    assert "is a checkpoint of another model" in r["error"]
    assert "transformer.h.0.attn.c_attn.bias is (192,) there and (288,) here" in r["error"]
    assert r["untouched"]


def test_a_missing_rank_file_is_refused_by_name_before_anything_changes(runs):
    _, _, refused = runs
    r = refused["deleted"]
    assert r["error"].startswith("FileNotFoundError: ")
    assert "lacks the ZeRO state of data-parallel rank 1 of 2" in r["error"]
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt does not exist" in r["error"]
    assert r["untouched"]


def test_a_truncated_file_or_entry_is_refused_by_name_before_anything_changes(runs):
    _, _, refused = runs
    cut = refused["cut"]
    assert cut["error"].startswith("ValueError: ") and cut["untouched"]
    assert (
        "zero_pp_rank_1_mp_rank_00_optim_states.pt (the ZeRO state of data-parallel rank 1 of 2) "
        "is not a readable checkpoint file" in cut["error"]
    )
    entry = refused["entry"]
    assert entry["error"].startswith("ValueError: ") and entry["untouched"]
    assert (
        "zero_pp_rank_1_mp_rank_00_optim_states.pt: Gefen entry 1 does not fit its recorded "
        "segments: Gefen state of entry 1: 'codes' is torch.uint8 (8320,), expected"
    ) in entry["error"]


def _cli(*args):
    cmd = [sys.executable, "-m", "gefen_dist.checkpoint", *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _one_process():
    """tests/dist/zero_elastic.py's model, param groups and Gefen in one process."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=64))
    named = list(model.named_parameters())
    groups = [
        dict(params=[p for _, p in named if p.dim() < 2], weight_decay=0.0),
        dict(params=[p for _, p in named if p.dim() >= 2], weight_decay=0.1),
    ]
    return model, Gefen(groups, lr=3e-3, bits=4)


def _train(model, opt, start, stop):
    """Steps start .. stop on the whole global batch of each step (the dist script's data)."""
    losses = []
    for s in range(start, stop):
        x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1000 + s))
        loss = model(x, torch.roll(x, -1, dims=1))[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _single_process_resume(tree):
    """One process resumed from the consolidated checkpoint, steps SAVE_AT .. STEPS."""
    model, opt = _one_process()
    model.load_state_dict(tree["model"])
    checkpoint.load_optimizer(opt, model, tree["optim"])
    return _train(model, opt, SAVE_AT, STEPS)


@pytest.mark.parametrize("src", ["z2x2", "z3x2"])
def test_the_command_line_consolidates_a_zero_checkpoint_for_one_process(runs, base, src):
    """``python -m gefen_dist.checkpoint consolidate DS_DIR OUT.pt`` leaves DeepSpeed: one
    process resumes from OUT.pt with ``checkpoint.load_optimizer``. Measured: first resumed
    loss 0 relative, largest drift over the 20 steps 7.7e-5 (ZeRO-2), 1.3e-4
    (ZeRO-3); bounds as above."""
    saved, _, _ = runs
    out = base / f"{src}.pt"
    assert "consolidated the Gefen state of 16 tensors" in _cli(
        "consolidate", base / src / "ckpt", out
    )
    listing = _cli("inspect", base / src / "ckpt")
    assert f"ZeRO-{SAVES[src]} checkpoint saved on 2 data-parallel ranks" in listing
    assert "transformer.wte.weight: (256, 64), block size 64, " in listing
    tree = torch.load(out, weights_only=True)
    st = tree["optim"]["state"]["transformer.wte.weight"]
    assert st["layout"].tolist() == [[0, 256 * 64, 0, 64, 64]] and float(st["step"]) == SAVE_AT
    drift = _drift(saved[src], [{"losses": _single_process_resume(tree)}])
    assert drift[0] <= FIRST_TOL
    assert max(drift) <= DRIFT_TOL, f"max relative loss drift {max(drift):.2e}"


@pytest.fixture(scope="module")
def from_one(base, launches):
    """One process trains STEPS steps, saving ``{"model": ..., "optim": opt.state_dict()}``
    with ``torch.save`` after SAVE_AT; the 2-rank launch loads that file into ZeRO-1, ZeRO-2
    and ZeRO-3 engines in turn and resumes each (``launches``)."""
    return launches, read_results(base / "from_one", ranks=2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_single_process_state_dict_loads_into_zero_at_two_ranks(from_one, stage):
    """``load_optimizer_state(engine, opt.state_dict())``: each rank cuts its partitions from
    the whole tensors' state. Measured against the single process that never stopped: first
    resumed loss 8.6e-8 relative (the ranks' summation order), largest drift over the 20
    steps 6.3e-5 (ZeRO-1 and ZeRO-2), 2.2e-4 (ZeRO-3); bounds as above."""
    losses, ranks = from_one
    for r in ranks:
        got = r[f"z{stage}"]
        assert got["wrapper"] == f"ZeRO-{stage}"
        assert got["blocks"], "no Gefen state was installed"
    drift = resume_drift(losses, ranks[0][f"z{stage}"]["losses"], SAVE_AT)
    assert drift[0] <= FIRST_TOL
    assert max(drift) <= DRIFT_TOL, f"max relative loss drift {max(drift):.2e}"


def test_a_single_process_state_of_another_model_is_refused_by_name(from_one):
    _, ranks = from_one
    r = ranks[0]["another_model"]
    assert r["error"].startswith("ValueError: load_optimizer_state: "), r["error"]
    assert "does not fit its state" in r["error"] and r["untouched"]
