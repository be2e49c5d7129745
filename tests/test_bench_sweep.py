"""The lr sweep (``compare --lr-sweep``): its grid, best-lr choice, bracketing warning and grid
extension, the highest-lr-that-trains rule, the paired confirm seeds, store keys that never
collide with fixed-lr records, the report, and one tiny sweep through the real subprocesses."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gefen_dist.bench import compare, store, suite, sweep, sweep_report, tasks

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


# -- the grid ---------------------------------------------------------------------------------
def test_grid_is_sorted_unique_and_needs_four_positive_factors():
    assert sweep.parse_factors("10, 1,0.33,3,1") == [0.33, 1.0, 3.0, 10.0]
    for bad in ("1,3,10", "1,1,3,10", "0,1,3,10", "-1,1,3,10", "1,3,x,10", "1,3,10,inf"):
        with pytest.raises(ValueError):
            sweep.parse_factors(bad)


def test_spacing_note_only_for_a_grid_not_about_three_apart():
    assert sweep.spacing_note([0.33, 1, 3, 10]) is None
    assert sweep.spacing_note([0.1, 0.3, 1, 3, 10, 30]) is None
    note = sweep.spacing_note([1, 1.2, 1.5, 10])
    assert note and "not about 3x" in note


@pytest.mark.parametrize("side", ["low", "high"])
def test_extension_adds_one_step_of_the_grids_own_width_on_that_side(side):
    grid = [0.33, 1.0, 3.0, 10.0]
    ext = sweep.extended(grid, side)
    assert len(ext) == len(grid) + 1 and ext == sorted(ext)
    new, old = (ext[-1], grid[-1]) if side == "high" else (ext[0], grid[0])
    step = grid[-1] / grid[-2] if side == "high" else grid[1] / grid[0]
    assert max(new, old) / min(new, old) == pytest.approx(step, rel=0.05)
    assert set(grid) < set(ext) and sweep.spacing_note(ext) is None


def _ok(x):
    return dict(status="ok", mean=x, values=[x])


def test_best_lr_is_the_lowest_eligible_loss_and_ties_go_to_the_smaller_lr():
    pts = {0.33: _ok(2.5), 1.0: _ok(2.1), 3.0: _ok(2.3), 10.0: _ok(2.9)}
    assert sweep.best_factor(pts) == 1.0
    pts[3.0] = dict(status="diverged", reason="loss became nan at step 9")
    pts[10.0] = _ok(1.0)  # lower, but above an lr that diverged: still the lowest eligible
    assert sweep.best_factor(pts) == 10.0
    assert sweep.best_factor({1.0: _ok(2.0), 3.0: _ok(2.0), 10.0: _ok(2.5)}) == 1.0
    assert sweep.best_factor({1.0: dict(status="failed", reason="x")}) is None


def test_a_factor_with_any_failed_sweep_seed_is_not_eligible():
    ok = dict(status="ok", final=dict(val_loss=2.0))
    assert sweep.point([ok, ok])["status"] == "ok"
    nan = dict(status="ok", final=dict(val_loss=float("nan")))
    assert sweep.point([ok, nan])["status"] == "diverged"
    blew = dict(status="failed", reason="loss became inf at step 4")
    assert sweep.point([blew, ok])["status"] == "diverged"
    crash = dict(status="failed", reason="RuntimeError: boom")
    assert sweep.point([ok, crash]) == dict(status="failed", reason="RuntimeError: boom")
    assert sweep.point([ok, None])["status"] == "missing"


def test_edge_says_which_end_holds_the_best():
    grid = [0.33, 1.0, 3.0, 10.0]
    assert sweep.edge(grid, 10.0) == "high" and sweep.edge(grid, 0.33) == "low"
    assert sweep.edge(grid, 3.0) is None and sweep.edge(grid, None) is None


def test_highest_lr_that_trains_is_finite_and_within_20_percent_of_the_own_best():
    best = 2.0
    pts = {
        0.33: _ok(2.6),
        1.0: _ok(best),
        3.0: _ok(best * (1 + sweep.TRAINS_WITHIN) * 0.99),  # just inside
        10.0: _ok(best * (1 + sweep.TRAINS_WITHIN) * 1.01),  # finite but just outside
        30.0: dict(status="diverged", reason="loss became nan at step 3"),
    }
    x = sweep.highest_trains(pts)
    assert x["factor"] == 3.0 and not x["top_of_grid"]
    assert x["rel"] == pytest.approx((1 + sweep.TRAINS_WITHIN) * 0.99 - 1)
    assert x["next"]["factor"] == 10.0 and x["next"]["rel"] > sweep.TRAINS_WITHIN
    del pts[10.0]
    x = sweep.highest_trains(pts)
    assert x["next"]["status"] == "diverged" and "nan" in x["next"]["reason"]
    del pts[30.0]
    assert sweep.highest_trains(pts)["top_of_grid"]
    assert sweep.highest_trains({1.0: dict(status="failed", reason="x")}) is None


def test_half_point_is_the_evaluation_nearest_the_middle_of_every_task():
    for name, t in tasks.TASKS.items():
        h = t.hyper
        steps = sorted({max(1, round(h.steps * (i + 1) / h.evals)) for i in range(h.evals)})
        curve = [dict(step=0)] + [dict(step=s) for s in steps]
        p = sweep.half_point(curve, h.steps)
        assert p is not None and abs(p["step"] - h.steps / 2) <= 1, name
    assert sweep.half_point([dict(step=0), dict(step=100)], 100) is None


def test_a_best_lr_won_by_a_lucky_sweep_seed_is_flagged():
    sweep_pts = {"adamw": {1.0: _ok(0.10), 3.0: _ok(0.073), 10.0: _ok(0.037)}}
    best = {"adamw": 10.0}
    lucky = {"adamw": dict(val_loss=dict(mean=0.080, values=[0.037, 0.106, 0.097]))}
    x = sweep.selection(sweep_pts, best, lucky)["adamw"]
    assert x["runner_up"] == 3.0 and x["holds"] is False
    text = "\n".join(sweep_report._selection_lines(dict(selection={"adamw": x}), 1))
    assert "AdamW's best lr ×10 rests on a lucky sweep draw" in text
    fine = {"adamw": dict(val_loss=dict(mean=0.066, values=[0.037, 0.105, 0.055]))}
    x = sweep.selection(sweep_pts, best, fine)["adamw"]
    assert x["holds"] is True
    lines = sweep_report._selection_lines(dict(selection={"adamw": x}), 1)
    assert "every best lr holds" in lines[0]


def test_sweep_keys_never_collide_with_fixed_lr_keys():
    t = tasks.TASKS["gru"]
    rev = dict(code="r", head="h")
    fixed = store.key(t.name, "adamw", 0, suite.settings_of(t, "adamw"), rev)
    h = store.settings_hash(suite.settings_of(t, "adamw"))
    assert fixed == f"gru|adamw|0|{h}|r"  # the fixed-lr format, so stored records stay valid
    keys = {sweep.key(t, "adamw", f, 0, rev) for f in (0.33, 1.0, 3.0)}
    assert fixed not in keys and len(keys) == 3
    assert sweep.key(t, "adamw", 1.0, 0, rev) != sweep.key(t, "adamw", 1.0, 1, rev)
    assert sweep.key(t, "adamw", 1.0, 0, rev) != sweep.key(t, "gefen8", 1.0, 0, rev)
    short = tasks.scaled(t, 0.5)
    assert sweep.key(t, "adamw", 1.0, 0, rev) != sweep.key(short, "adamw", 1.0, 0, rev)


# -- the orchestration on synthetic runs ------------------------------------------------------
def _fake_spawn(calls, best_at, offset, half_offset=None, diverge_above=None):
    """Final val loss a parabola in log(lr) with its minimum at ``best_at[opt]`` (a factor of
    the task's lr), shifted by ``offset[opt]``; the mid-run loss by ``half_offset[opt]``."""
    half_offset = half_offset or {}

    def spawn(task, opt, seed, timeout):
        f = task.hyper.lr / tasks.TASKS[task.name].hyper.lr
        calls.append((task.name, opt, round(f, 6), seed))
        steps = task.hyper.steps
        if diverge_above is not None and f > diverge_above:
            curve = [dict(step=0, val_loss=5.0)]
            return dict(status="failed", reason="loss became nan at step 3", curve=curve)
        x = math.log(f / best_at[opt])
        noise = 0.002 * ((seed * 3 + len(opt)) % 4)
        final = 2.0 + 0.05 * x * x + 0.01 * seed + offset.get(opt, 0.0) + noise
        half = final + 0.5 + half_offset.get(opt, 0.0)
        extra = dict(val_acc=0.9 - final / 100) if task.kind == "cls" else {}
        curve = [
            dict(step=0, val_loss=5.0, **extra),
            dict(step=steps // 2, val_loss=half, **extra),
            dict(step=steps, val_loss=final, **extra),
        ]
        return dict(
            status="ok",
            curve=curve,
            final=curve[-1],
            state_bytes=800,
            params=100,
            bytes_per_param=8.0 if opt == "adamw" else 1.0,
            step_ms_median=1.0,
            step_ms_first=1.0,
        )

    return spawn


OPTS = ["adamw", "gefen8", "gefen4", "adafactor"]
GRID = [0.33, 1.0, 3.0, 10.0]


def _run(tmp_path, monkeypatch, calls, spawn, rev="rev-a", **kw):
    monkeypatch.setattr(suite, "_spawn", spawn)
    monkeypatch.setattr(store, "revision", lambda: dict(code=rev, head="h"))
    out = tmp_path / "sweep"
    args = dict(sweep_seeds=1, seeds=3, scale=0.02, jobs=1, quiet=True, cmd="test")
    args.update(kw)
    path = sweep.lr_sweep(out, ["gru"], OPTS, GRID, **args)
    return path, json.loads((out / "lr_sweep.json").read_text())["analyses"]["gru"]


def test_sweep_confirms_at_each_best_and_at_adamws_best_and_reuses_done_runs(tmp_path, monkeypatch):
    calls: list = []
    best_at = dict(adamw=3.0, gefen8=1.0, gefen4=3.0, adafactor=1.0)
    offset = dict(gefen8=-0.05, gefen4=0.02)
    spawn = _fake_spawn(calls, best_at, offset, half_offset=dict(gefen8=0.2))
    path, a = _run(tmp_path, monkeypatch, calls, spawn)
    # sweep: every optimizer at every factor, seed 0
    sweep_calls = [c for c in calls if c[3] == 0]
    assert sorted(sweep_calls) == sorted(("gru", o, f, 0) for o in OPTS for f in GRID)
    # the best lr of each, found from the sweep
    assert a["best"] == best_at and a["adamw_best"] == 3.0 and not a["edges"]
    # confirm: 3 paired seeds at each best; the drop-ins (lr scale 1) also at AdamW's best
    want = {(o, best_at[o], s) for o in OPTS for s in range(3)}
    want |= {(o, 3.0, s) for o in ("adamw", "gefen8", "gefen4") for s in range(3)}
    assert {(o, f, s) for _, o, f, s in calls} == want | {(o, f, 0) for o in OPTS for f in GRID}
    assert len(calls) == len(set(calls))  # nothing ran twice
    n = sweep.plan([tasks.TASKS["gru"]], OPTS, GRID, 1, 3)
    assert len(calls) - n["sweep"] <= n["confirm_at_most"]
    assert a["at_adamw_best"]["gefen8"]["val_loss"]["n_paired"] == 3
    assert a["best_vs_best"]["gefen8"]["val_loss"]["n_paired"] == 3
    # best against best: gefen8 at its own best (offset -0.05) against AdamW at its best
    assert a["best_vs_best"]["gefen8"]["val_loss"]["diff"] == pytest.approx(-0.05, abs=0.01)
    # at AdamW's best, gefen8 is one factor of 3 from its own best: worse than at its best
    at_a = a["at_adamw_best"]["gefen8"]["val_loss"]["diff"]
    assert at_a > a["best_vs_best"]["gefen8"]["val_loss"]["diff"]
    # the mid-run check: gefen8 is behind at half length (+0.2) but ahead at the end
    g8 = a["ranking"]["best_vs_best"]["gefen"]["gefen8"]
    assert g8["half"] == "behind" and g8["full"] == "ahead" and g8["changed"]
    assert not a["ranking"]["best_vs_best"]["gefen"]["gefen4"]["changed"]
    text = path.read_text()
    assert "gru: bracketed" in text and "NOT BRACKETED" not in text
    assert "Gefen 8-bit vs AdamW: behind at step" in text and "ranking CHANGED" in text
    assert (path.parent / "lr_sweep.png").read_bytes()[:4] == b"\x89PNG"
    # a rerun reuses every run; a fixed-lr comparison in the same store shares none
    n_calls = len(calls)
    _run(tmp_path, monkeypatch, calls, spawn)
    assert len(calls) == n_calls
    suite.compare(
        tmp_path / "fixed",
        ["gru"],
        OPTS,
        [0],
        scale=0.02,
        jobs=1,
        quiet=True,
        store_path=tmp_path / "sweep" / "runs.jsonl",
    )
    assert len(calls) == n_calls + len(OPTS)  # the factor-1 sweep records were not reused
    _run(tmp_path, monkeypatch, calls, spawn)
    assert len(calls) == n_calls + len(OPTS)  # nor the fixed-lr records by the sweep
    _run(tmp_path, monkeypatch, calls, spawn, rev="rev-b")
    assert len(calls) > n_calls + len(OPTS)  # another revision reuses nothing


def test_adamw_best_at_the_grid_end_is_reported_and_extend_grid_brackets_it(tmp_path, monkeypatch):
    calls: list = []
    best_at = dict(adamw=30.0, gefen8=30.0, gefen4=3.0, adafactor=0.1)
    spawn = _fake_spawn(calls, best_at, {})
    path, a = _run(tmp_path, monkeypatch, calls, spawn)
    assert a["edges"]["adamw"] == "high" and a["adamw_best"] == 10.0
    assert a["edges"]["adafactor"] == "low"
    text = path.read_text()
    assert "**gru: NOT BRACKETED. AdamW's best lr is the highest of the grid" in text
    assert "--extend-grid" in text
    calls.clear()
    path, a = _run(tmp_path, monkeypatch, calls, spawn, extend_grid=1)
    new = a["grid"][-1]
    assert a["grid"][:-1] == GRID and new > GRID[-1] and a["extended"] == [new]
    assert {(o, f, s) for _, o, f, s in calls if f == new and s == 0} == {
        (o, new, 0) for o in OPTS
    }  # every optimizer at the new factor, so the table stays rectangular
    assert a["adamw_best"] == new  # 33 is nearer 30 than 10 is
    calls.clear()
    path, a = _run(tmp_path, monkeypatch, calls, spawn, extend_grid=3)
    assert a["adamw_best"] not in (a["grid"][0], a["grid"][-1])  # bracketed after two
    assert "adamw" not in a["edges"]
    text = path.read_text()
    assert "gru: bracketed" in text and "grid extended to" in text


def test_extend_grid_also_brackets_a_gefen_best_but_not_another_peers(tmp_path, monkeypatch):
    calls: list = []
    best_at = dict(adamw=3.0, gefen8=3.0, gefen4=0.1, adafactor=30.0)
    spawn = _fake_spawn(calls, best_at, {})
    _, a = _run(tmp_path, monkeypatch, calls, spawn, extend_grid=1)
    assert "adamw" not in a["edges"]
    assert a["grid"][1:] == GRID and a["grid"][0] < GRID[0]  # gefen4's low end, once
    assert a["best"]["gefen4"] == a["grid"][0] and a["edges"]["gefen4"] == "low"
    assert a["edges"]["adafactor"] == "high"  # reported, not extended for


def test_report_renders_every_section_and_names_runs_that_did_not_train(tmp_path, monkeypatch):
    calls: list = []
    best_at = dict(adamw=1.0, gefen8=1.0, gefen4=1.0, adafactor=1.0)
    spawn = _fake_spawn(calls, best_at, dict(gefen4=0.5), diverge_above=5.0)
    path, a = _run(tmp_path, monkeypatch, calls, spawn)
    text = path.read_text()
    for heading in (
        "Command: `test`",
        "Code revision (last commit touching `gefen_dist/` or `csrc/`): `rev-a`",
        "### (a) Final val loss against lr",
        "### (b) Each optimizer at its own best lr",
        "### (c) Gefen and the other drop-ins at AdamW's best lr",
        "### (d) Highest lr that still trains",
        "![final val loss against lr](lr_sweep.png)",
    ):
        assert heading in text, heading
    table = [ln for ln in text.splitlines() if ln.startswith("| AdamW | ")]
    assert "diverged" in table[0] and "**" in table[0]  # (a): ×10 diverged, best in bold
    assert a["sweep"]["adamw"]["10"]["status"] == "diverged"
    trains = {o: x["factor"] for o, x in a["trains"].items()}
    assert max(trains.values()) <= 3.0
    assert "×10: diverged (loss became nan" in text
    # gefen4 is 0.5 behind (25 %): the 4-bit tolerance (2 %) is missed, and says why
    assert "Goal (b) at AdamW's best lr, Gefen 4-bit: +2" in text and "MISSED" in text
    assert "Goal (b) at AdamW's best lr, Gefen 8-bit" in text
    # Adafactor's lr column shows its own scale on top of the grid factor
    assert "Adafactor (torch, no momentum) [lr × 30]" in text


def test_cli_rejects_sweep_flags_without_lr_sweep_and_a_sweep_without_adamw(capsys):
    for argv in (
        ["--lr-factors", "0.33,1,3,10"],
        ["--sweep-seeds", "2"],
        ["--extend-grid"],
        ["--dry-run"],
        ["--lr-sweep", "--optimizers", "gefen8,gefen4"],
        ["--lr-sweep", "--lr-factors", "1,3,10"],
        ["--lr-sweep", "--seeds", "0"],
    ):
        with pytest.raises(SystemExit) as e:
            compare.main(argv)
        assert e.value.code == 2, argv
    compare.main(["--lr-sweep", "--dry-run", "--tasks", "gru,mlp", "--optimizers", "adamw,gefen8"])
    out = capsys.readouterr().out
    n = sweep.plan([tasks.TASKS["gru"], tasks.TASKS["mlp"]], ["adamw", "gefen8"], GRID, 1, 3)
    assert f"= {n['sweep']} sweep runs" in out and f"at most {n['confirm_at_most']}" in out


# -- one tiny sweep through the real subprocesses ---------------------------------------------
@pytest.mark.slow  # 8 to 11 worker processes: about 30 s on two idle cores
def test_tiny_sweep_end_to_end_through_the_worker_subprocesses(tmp_path):
    out = tmp_path / "rep"
    cmd = [
        sys.executable,
        "-m",
        "gefen_dist.bench",
        "compare",
        "--lr-sweep",
        "--smoke",
        "--tasks",
        "mlp",
        "--optimizers",
        "adamw,gefen8",
        "--lr-factors",
        "0.1,1,10,100",
        "--seeds",
        "2",
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((out / "lr_sweep.json").read_text())
    a = res["analyses"]["mlp"]
    assert a["grid"] == [0.1, 1.0, 10.0, 100.0]
    for o in ("adamw", "gefen8"):
        assert set(a["sweep"][o]) == {"0.1", "1", "10", "100"}
        assert a["best"][o] in a["grid"]
    assert a["best_vs_best"]["gefen8"]["val_loss"]["n_paired"] == 2
    assert a["at_adamw_best"]["gefen8"]["val_loss"]["n_paired"] == 2
    assert a["half_step"] is not None and "best_vs_best_half" in a
    recs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert all("|lr*" in r["key"] and r["settings"]["lr_factor"] == r["lr_factor"] for r in recs)
    lrs = {
        (r["optimizer"], r["lr_factor"]): r["settings"]["hyper"]["lr"]
        for r in recs
        if r["optimizer"] == "adamw"
    }
    assert lrs[("adamw", 10.0)] == pytest.approx(10 * tasks.TASKS["mlp"].hyper.lr)
    assert len(recs) == len({r["key"] for r in recs})
    text = (out / "lr_sweep.md").read_text()
    assert "Is AdamW's best lr bracketed?" in text and "| Gefen 8-bit |" in text
    assert (out / "lr_sweep.png").read_bytes()[:4] == b"\x89PNG"
    # a rerun starts no run, unless gefen_dist/ changed in between (a new revision: then it
    # must reuse nothing; other people's edits in a shared checkout can do that)
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    recs2 = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    text = (out / "lr_sweep.md").read_text()
    if {r["revision"] for r in recs2} == {r["revision"] for r in recs}:
        assert len(recs2) == len(recs) and "This invocation ran 0 run(s)" in text
    else:
        assert f"This invocation ran {len(recs2) - len(recs)} run(s)" in text
        assert "and reused 0." in text and recs[0]["revision"] in text  # named as ignored
