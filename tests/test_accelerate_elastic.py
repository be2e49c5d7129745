"""Accelerate's ``save_state`` and the Hugging Face Trainer's checkpoints on 2 processes,
resumed on 1 and on 4, on CPU.

What the user types is what they type at the same number of processes:
``accelerator.load_state(dir)``, ``trainer.train(resume_from_checkpoint=dir)``. Under DDP
(MULTI_CPU) Gefen's state is the whole model's on every rank, so it loads as it is at any
number; under DeepSpeed (ZeRO-2 from a Gefen JSON) Accelerate and the Trainer call
``engine.load_checkpoint``, which re-cuts the state for the new degree
(tests/test_zero_elastic.py).

Runs (tests/dist/accel_elastic.py under torchrun, one launch per number of processes running
both layouts' jobs in turn; the tiny GPT over the same global batches of
4 sequences at every number of processes, 30 steps, ``save_state`` after 10), each resume
compared step by step with the uninterrupted 2-process run. The first resumed loss is the saved
model's (measured: 0 under DDP, 8.4e-8 relative under DeepSpeed; bound 1e-6); after it only the
gradient average's rounding differs under DDP (Gefen's state is not re-cut), and under DeepSpeed
the re-cut block pieces too. Measured largest relative loss difference over the 20 resumed
steps: DDP 2 -> 1 1.7e-7, 2 -> 4 3.6e-6; DeepSpeed 2 -> 1 4.4e-5, 2 -> 4 2.8e-5; bound 1e-3 (the
ZeRO bound of tests/test_zero_elastic.py). That Gefen's own state came back, not a fresh one,
is checked by its step count right after the load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist_util import read_results, resume_drift, torchrun
from needs import extra

pytestmark = pytest.mark.dist

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
STEPS, SAVE_AT = 30, 10
FIRST_TOL, DRIFT_TOL = 1e-6, 1e-3
LAYOUTS = {
    "ddp": {"ACCELERATE_USE_CPU": "true"},
    "deepspeed": {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(CONFIGS / "ds_zero2_auto_cpu.json"),
    },
}
RESUMES = [("ddp", 1), ("ddp", 4), ("deepspeed", 1), ("deepspeed", 4)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch per number of processes, each running both layouts' jobs in turn: the saves
    on 2, then the resumes on 1 and on 4."""
    extra("accelerate")
    extra("deepspeed")
    d = tmp_path_factory.mktemp("accel_elastic")
    jobs: dict[int, list[dict]] = {2: []}
    for layout, env in LAYOUTS.items():
        ckpt = str(d / f"{layout}-ckpt")
        jobs[2].append(dict(env=env, mode="save", out=str(d / f"{layout}-save"), ckpt=ckpt))
        for lay, n in RESUMES:
            if lay == layout:
                out = str(d / f"{layout}-to-{n}")
                jobs.setdefault(n, []).append(dict(env=env, mode="resume", out=out, ckpt=ckpt))
    for n, specs in jobs.items():
        (d / f"jobs{n}.json").write_text(json.dumps(specs))
        torchrun("accel_elastic.py", str(d / f"jobs{n}.json"), nproc=n)
    saved = {layout: read_results(d / f"{layout}-save", ranks=2) for layout in LAYOUTS}
    resumed = {(lay, n): read_results(d / f"{lay}-to-{n}", ranks=n) for lay, n in RESUMES}
    return saved, resumed


def _drift(saved, resumed):
    assert len(resumed[0]["losses"]) == STEPS - SAVE_AT
    return resume_drift(saved[0]["losses"], resumed[0]["losses"], SAVE_AT)


IDS = [f"{lay}-2-to-{n}" for lay, n in RESUMES]


@pytest.mark.parametrize("key", RESUMES, ids=IDS)
def test_load_state_at_another_number_of_processes_runs_gefen_there(runs, key):
    saved, resumed = runs
    layout, n = key
    want = "MULTI_CPU" if layout == "ddp" else "DEEPSPEED"
    assert [r["world"] for r in saved[layout]] == [2, 2]
    assert [r["world"] for r in resumed[key]] == [n] * n
    for r in resumed[key]:
        assert r["basic"] == "Gefen" and r["distributed_type"].endswith(want)
        assert r["loaded_steps"] == [SAVE_AT]  # Gefen's own state came back, at the saved step


@pytest.mark.parametrize("key", RESUMES, ids=IDS)
def test_load_state_at_another_number_of_processes_starts_from_the_saved_model(runs, key):
    saved, resumed = runs
    assert _drift(saved[key[0]], resumed[key])[0] <= FIRST_TOL


@pytest.mark.parametrize("key", RESUMES, ids=IDS)
def test_load_state_at_another_number_of_processes_stays_within_the_drift_bound(runs, key):
    saved, resumed = runs
    drift = _drift(saved[key[0]], resumed[key])
    assert max(drift) <= DRIFT_TOL, f"max relative loss drift {max(drift):.2e}"


HF_RESUMES = [("object", 1), ("object", 4), ("ds", 1), ("ds", 4)]
HF_IDS = [f"{m}-2-to-{n}" for m, n in HF_RESUMES]


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """tests/dist/accel_elastic_hf.py: ``optimizers=(Gefen(...), None)`` under DDP ("object")
    and Gefen from a ZeRO-2 JSON ("ds"), 30 steps saved every 10 on 2 processes, resumed from
    checkpoint-10 on 1 and 4; one torchrun launch per number of processes runs both modes' jobs
    in turn. Measured first resumed step: 0 (1 process), 9.2e-8 relative (4);
    largest drift over steps 11-30: DDP 9.2e-8 (1 and 4), ZeRO-2 9.2e-8 (2 -> 1), 1.1e-4
    (2 -> 4); the bounds are those above."""
    extra("transformers")
    extra("deepspeed")
    d = tmp_path_factory.mktemp("trainer_elastic")
    env = {"HF_HUB_OFFLINE": "1"}
    jobs: dict[int, list[list[str]]] = {2: []}
    for mode in ("object", "ds"):  # one launch per number of processes, both modes in turn
        ckpt = str(d / f"{mode}-ckpt")
        jobs[2].append([str(d / f"{mode}-train"), ckpt, mode, "train"])
        for m, n in HF_RESUMES:
            if m == mode:
                jobs.setdefault(n, []).append([str(d / f"{mode}-to-{n}"), ckpt, mode, "resume"])
    for n, specs in jobs.items():
        (d / f"jobs{n}.json").write_text(json.dumps(specs))
        torchrun("accel_elastic_hf.py", str(d / f"jobs{n}.json"), nproc=n, env=env)
    saved = {mode: read_results(d / f"{mode}-train", ranks=2) for mode in ("object", "ds")}
    resumed = {(m, n): read_results(d / f"{m}-to-{n}", ranks=n) for m, n in HF_RESUMES}
    return saved, resumed


def _trainer_drift(saved, resumed):
    steps = [str(s) for s in range(SAVE_AT + 1, STEPS + 1)]
    base, got = saved[0]["losses"], resumed[0]["losses"]
    return [abs(got[s] - base[s]) / base[s] for s in steps]


@pytest.mark.parametrize("key", HF_RESUMES, ids=HF_IDS)
def test_trainer_resume_at_another_number_of_processes_runs_gefen_there(trainer_runs, key):
    saved, resumed = trainer_runs
    mode, n = key
    assert [r["world"] for r in saved[mode]] == [2, 2]
    assert [r["world"] for r in resumed[key]] == [n] * n
    for r in resumed[key]:
        assert r["basic"] == "Gefen"
        assert r["gefen_steps"] == [STEPS]  # 20 had Gefen started afresh at the resume
        assert sorted(r["losses"], key=int) == [str(s) for s in range(1, STEPS + 1)]


@pytest.mark.parametrize("key", HF_RESUMES, ids=HF_IDS)
def test_trainer_resume_at_another_number_of_processes_follows_the_uninterrupted_run(
    trainer_runs, key
):
    saved, resumed = trainer_runs
    drift = _trainer_drift(saved[key[0]], resumed[key])
    assert drift[0] <= FIRST_TOL
    assert max(drift) <= DRIFT_TOL, f"max relative loss drift {max(drift):.2e}"
