"""``python -m gefen_dist.bench compare --lr-sweep``: every optimizer at its own best lr.

Why: the fixed-lr comparison runs every optimizer at one lr per task, and nothing says that lr
is AdamW's best (torch Adafactor at 30 x it was 16 to 28 % ahead on the LMs). Users tune
AdamW's lr and then swap Gefen in, so the comparisons that count are each optimizer at its own
best lr, and Gefen at AdamW's best lr. A lead of Gefen over an AdamW run at a poor lr says
nothing about either.

How, in three phases, each a pool of the suite's subprocess runs (``suite._spawn``):

1. sweep: every (task, optimizer, grid factor) for ``--sweep-seeds`` seeds (default 1). The lr
   is factor x the task's lr x the peer's own lr scale (Adafactor 30, SM3 10), so the grid
   brackets the scaled peers' best as it does AdamW's.
2. with ``--extend-grid N``: where AdamW's or a Gefen's best factor is at an end of a task's
   grid (EXTEND_FOR: the optimizers the report's conclusions are about), one more factor on
   that side, for every optimizer (the table stays rectangular), at most N times; otherwise
   the report says plainly that AdamW's best was not bracketed.
3. confirm: ``--seeds`` paired seeds (default 3) at each optimizer's best factor, and at
   AdamW's best factor for every optimizer whose lr means AdamW's (lr scale 1: the drop-ins).
   Seeds the sweep already ran are the same runs (same key) and are not run again.

The best factor is the one with the lowest final validation loss, mean over the sweep seeds;
a factor at which a sweep seed failed or ended non-finite is not eligible (an lr that
sometimes diverges is not a usable lr). Selecting on sweep seeds that the confirm phase reuses
favours every optimizer alike (each gets its own best draw), so the paired differences stay
fair. Records are keyed with their lr factor (``store.key``): they never collide with
fixed-lr records and a rerun reuses every finished run. The report it ends with (lr_sweep.md,
.json, .png) is ``sweep_report``'s.
"""

from __future__ import annotations

import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path
from typing import Any

from gefen_dist.bench import peers, report, store, suite, sweep_report, tasks

DEFAULT_FACTORS = "0.33,1,3,10"
MIN_POINTS = 4
STEP_RANGE = (2.0, 5.0)
"""Ratios between neighbouring factors outside this are reported: a grid about 3 apart
resolves the best lr to within sqrt(3) without spending runs on near-duplicates."""
TRAINS_WITHIN = 0.20
"""Rule (d): an lr still trains when every sweep seed ends finite and the mean final val loss
is within 20 % of the optimizer's own best (relative, for every task alike)."""
EXTEND_FOR = ("adamw", "gefen8", "gefen4")
"""Whose best at an end of the grid ``--extend-grid`` acts on; the others' is only reported."""
METRIC = "val_loss"
"""Selection metric for every task: the digits accuracy saturates near 100 % and ties."""

Lookup = Any  # callable (task, optimizer, factor, seed) -> record or None


# -- the grid ---------------------------------------------------------------------------------
def parse_factors(text: str) -> list[float]:
    """The grid from ``--lr-factors``: sorted and unique, so "the ends" mean something; raises
    ValueError for fewer than MIN_POINTS positive factors, which cannot bracket a best lr and
    say which side of it the others lie."""
    try:
        fs = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError as e:
        raise ValueError(f"--lr-factors: not a comma list of numbers: {text!r}") from e
    if any(not (f > 0 and math.isfinite(f)) for f in fs):
        raise ValueError(f"--lr-factors: factors must be positive and finite: {text!r}")
    if len(fs) < MIN_POINTS:
        raise ValueError(
            f"--lr-factors: at least {MIN_POINTS} distinct factors (about 3 apart), got {fs}"
        )
    return fs


def spacing_note(grid: list[float]) -> str | None:
    """A sentence for the report when the grid is not about a factor of 3 apart."""
    ratios = [b / a for a, b in zip(grid, grid[1:], strict=False)]
    odd = [r for r in ratios if not STEP_RANGE[0] <= r <= STEP_RANGE[1]]
    if not odd:
        return None
    return (
        "neighbouring factors are "
        + ", ".join(f"{r:.2g}x" for r in ratios)
        + f" apart, not about 3x (outside {STEP_RANGE[0]:g}x to {STEP_RANGE[1]:g}x): the "
        "best lr is resolved unevenly"
    )


def _nice(x: float) -> float:
    return float(f"{x:.2g}")


def extended(grid: list[float], side: str) -> list[float]:
    """One more factor beyond ``side`` ('low' or 'high'), a step as wide as the grid's own step
    at that end, so an extended grid stays evenly spaced."""
    if side == "high":
        return grid + [_nice(grid[-1] * grid[-1] / grid[-2])]
    if side == "low":
        return [_nice(grid[0] * grid[0] / grid[1])] + grid
    raise ValueError(side)


def edge(grid: list[float], best: float | None) -> str | None:
    """'low' or 'high' when ``best`` is at that end of the grid: the true best may lie beyond."""
    if best is None:
        return None
    if best == grid[-1]:
        return "high"
    if best == grid[0]:
        return "low"
    return None


def swept(task: tasks.Task, factor: float) -> tasks.Task:
    """The task with its lr times ``factor``: what the worker trains (peers.build applies the
    peer's lr scale on top)."""
    return replace(task, hyper=replace(task.hyper, lr=task.hyper.lr * factor))


def settings_of(task: tasks.Task, optimizer: str, factor: float) -> dict[str, Any]:
    """The swept task's settings (so the stored hyper lr is the lr the run used, before the
    peer's lr scale) and the factor."""
    return dict(suite.settings_of(swept(task, factor), optimizer), lr_factor=factor)


def key(task: tasks.Task, optimizer: str, factor: float, seed: int, rev: dict) -> str:
    return store.key(
        task.name, optimizer, seed, settings_of(task, optimizer, factor), rev, lr_factor=factor
    )


# -- reading the records ----------------------------------------------------------------------
def final_loss(rec: dict | None) -> float | None:
    """The final val loss of a run that trained, None for any other."""
    if not rec or rec.get("status") != "ok":
        return None
    x = rec.get("final", {}).get(METRIC)
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def point(recs: list[dict | None]) -> dict[str, Any]:
    """One (optimizer, factor) cell of the sweep from its sweep-seed records."""
    if not recs or any(r is None for r in recs):
        return dict(status="missing", reason="no stored run")
    xs = [final_loss(r) for r in recs]
    if all(x is not None for x in xs):
        return dict(status="ok", mean=statistics.fmean(xs), values=xs)
    bad = next(r for r, x in zip(recs, xs, strict=True) if x is None)
    reason = bad.get("reason", "")
    if bad["status"] == "skipped":
        status = "skipped"
    elif bad["status"] == "ok" or reason.startswith("loss became"):
        status = "diverged"
        reason = reason or f"final {METRIC} {bad.get('final', {}).get(METRIC)}"
    else:
        status = "failed"
    return dict(status=status, reason=reason)


def best_factor(points: dict[float, dict]) -> float | None:
    """The factor with the lowest mean final val loss; ties go to the smaller lr."""
    ok = [(c["mean"], f) for f, c in points.items() if c["status"] == "ok"]
    return min(ok)[1] if ok else None


def highest_trains(points: dict[float, dict], within: float = TRAINS_WITHIN) -> dict | None:
    """Rule (d): the highest factor whose sweep runs all end finite with a mean final val loss
    within ``within`` of the optimizer's own best; with what happens one step above it."""
    best = best_factor(points)
    if best is None:
        return None
    limit = points[best]["mean"] * (1 + within)
    top = max(f for f, c in points.items() if c["status"] == "ok" and c["mean"] <= limit)
    out: dict[str, Any] = dict(
        factor=top,
        loss=points[top]["mean"],
        rel=points[top]["mean"] / points[best]["mean"] - 1,
        top_of_grid=top == max(points),
    )
    above = sorted(f for f in points if f > top)
    if above:
        c = points[above[0]]
        out["next"] = dict(factor=above[0], status=c["status"], reason=c.get("reason", ""))
        if c["status"] == "ok":
            out["next"]["rel"] = c["mean"] / points[best]["mean"] - 1
    return out


def half_point(curve: list[dict], steps: int) -> dict | None:
    """The evaluation nearest half the run (never step 0 nor the last); None when the curve has
    none within a tenth of the run of the middle."""
    mids = [p for p in curve if 0 < p["step"] < steps]
    if not mids:
        return None
    p = min(mids, key=lambda p: (abs(p["step"] - steps / 2), p["step"]))
    return p if abs(p["step"] - steps / 2) <= 0.1 * steps else None


# -- the analysis -----------------------------------------------------------------------------
def analyse(
    task: tasks.Task,
    optimizers: list[str],
    grid: list[float],
    sweep_seeds: list[int],
    seeds: list[int],
    get: Lookup,
) -> dict[str, Any]:
    """Everything the report says about one task, from the records ``get`` finds."""
    sweep = {
        o: {f: point([get(task, o, f, s) for s in sweep_seeds]) for f in grid} for o in optimizers
    }
    best = {o: best_factor(sweep[o]) for o in optimizers}
    a_best = best.get("adamw")
    edges = {o: edge(grid, b) for o, b in best.items() if edge(grid, b)}

    def rows_at(which: dict[str, float | None]) -> list[dict]:
        return [
            dict(r, lr_factor=f)
            for o, f in which.items()
            if f is not None
            for r in (get(task, o, f, s) for s in seeds)
            if r is not None
        ]

    at_best = {o: f for o, f in best.items() if f is not None}
    dropins = [o for o in optimizers if peers.PEERS[o].lr_scale == 1.0]
    at_adamw = {o: a_best for o in dropins} if a_best is not None else {}
    best_rows, adamw_rows = rows_at(at_best), rows_at(at_adamw)
    done = [r for r in best_rows if r["status"] == "ok"]
    h = half_point(done[0]["curve"], task.hyper.steps) if done else None
    half_step = h["step"] if h else None

    def halved(rows: list[dict]) -> list[dict]:
        out = []
        for r in rows:
            p = next((p for p in r.get("curve", []) if p["step"] == half_step), None)
            if r["status"] == "ok" and p is not None:
                out.append(dict(r, final=p))
        return out

    opts_best = [o for o in optimizers if o in at_best]
    opts_adamw = [o for o in optimizers if o in at_adamw]
    res: dict[str, Any] = dict(
        grid=grid,
        sweep=sweep,
        best=best,
        adamw_best=a_best,
        edges=edges,
        trains={o: highest_trains(sweep[o]) for o in optimizers},
        half_step=half_step,
        best_vs_best=_strip(report.summarize(best_rows, [task], opts_best)[task.name]),
        at_adamw_best=_strip(report.summarize(adamw_rows, [task], opts_adamw)[task.name]),
    )
    if half_step is not None:
        res["best_vs_best_half"] = _strip(
            report.summarize(halved(best_rows), [task], opts_best)[task.name]
        )
        res["at_adamw_best_half"] = _strip(
            report.summarize(halved(adamw_rows), [task], opts_adamw)[task.name]
        )
    res["selection"] = selection(sweep, best, res["best_vs_best"])
    res["ranking"] = ranking(res)
    res["goals_at_adamw_best"] = [
        x
        for x in report.goals({task.name: res["at_adamw_best"]}, [task])["b"]
        if x["gefen"] in res["at_adamw_best"]
    ]
    return res


def selection(sweep: dict, best: dict, at_best: dict) -> dict[str, dict]:
    """Does each best lr hold on the paired seeds? Chosen on few sweep seeds, a lucky draw at
    one lr can win (high lrs spread most); it is flagged when the paired-seed mean there is
    worse than the runner-up factor's sweep value, so the choice rests on that draw alone."""
    out = {}
    for o, b in best.items():
        c = at_best.get(o, {}).get(METRIC)
        if b is None or not c:
            continue
        ranked = sorted((p["mean"], f) for f, p in sweep[o].items() if p["status"] == "ok")
        x = dict(factor=b, sweep=sweep[o][b]["mean"], paired=c["mean"], n=len(c["values"]))
        if len(ranked) > 1:
            x.update(runner_up=ranked[1][1], runner_up_sweep=ranked[1][0])
            x["holds"] = c["mean"] <= ranked[1][0]
        out[o] = x
    return out


def _strip(cells: dict) -> dict:
    """summarize()'s cells without the per-tensor table and curve, which the sweep report does
    not show (the fixed-lr report does) and which would make the JSON large."""
    return {
        o: {k: v for k, v in c.items() if k not in ("tensors", "curve")} for o, c in cells.items()
    }


def _mean(cell: dict | None) -> float | None:
    c = (cell or {}).get(METRIC)
    return c["mean"] if c else None


def ranking(res: dict) -> dict[str, Any]:
    """Does a shorter run tell the same story? Ranks at the full and the half length, and per
    Gefen whether it is ahead of or behind AdamW at both."""
    out: dict[str, Any] = {}
    for comp in ("best_vs_best", "at_adamw_best"):
        full, half = res.get(comp, {}), res.get(comp + "_half")
        order_full = sorted(
            (o for o in full if _mean(full[o]) is not None), key=lambda o: _mean(full[o])
        )
        entry: dict[str, Any] = dict(order_full=order_full)
        if half is not None:
            order_half = sorted(
                (o for o in half if _mean(half[o]) is not None), key=lambda o: _mean(half[o])
            )
            entry["order_half"] = order_half
            entry["order_unchanged"] = order_full == order_half
        gefen = {}
        for g in report.GEFEN:
            c_full = full.get(g, {}).get(METRIC, {})
            c_half = (half or {}).get(g, {}).get(METRIC, {})
            if "diff" not in c_full:
                continue
            side_full = _side(c_full["diff"])
            x = dict(full=side_full, diff_full=c_full["diff"], t_full=c_full.get("t"))
            if "diff" in c_half:
                side_half = _side(c_half["diff"])
                x.update(
                    half=side_half,
                    diff_half=c_half["diff"],
                    t_half=c_half.get("t"),
                    changed=side_half != side_full,
                )
            gefen[g] = x
        entry["gefen"] = gefen
        out[comp] = entry
    return out


def _side(d: float) -> str:
    return "ahead" if d < 0 else ("behind" if d > 0 else "tied")


# -- running ----------------------------------------------------------------------------------
def edges_of(
    task: tasks.Task, optimizers: list[str], grid: list[float], sweep_seeds: list[int], get
) -> dict[str, list[str]]:
    """{side: the EXTEND_FOR optimizers whose best factor is at that end of ``grid``}."""
    out: dict[str, list[str]] = {}
    for o in (o for o in EXTEND_FOR if o in optimizers):
        pts = {f: point([get(task, o, f, s) for s in sweep_seeds]) for f in grid}
        side = edge(grid, best_factor(pts))
        if side:
            out.setdefault(side, []).append(o)
    return out


def _run(todo: list[tuple], st: store.Store, rev: dict, jobs: int, timeout: float, say, t0):
    """Run the (task, optimizer, factor, seed, key) jobs in a pool, storing each as it ends."""
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futs = {
            pool.submit(suite._spawn, swept(t, f), o, s, timeout): (t, o, f, s, k)
            for t, o, f, s, k in todo
        }
        for i, fut in enumerate(as_completed(futs), 1):
            task, opt, f, seed, k = futs[fut]
            body = fut.result()
            rec = store.record(k, task.name, opt, seed, settings_of(task, opt, f), rev, body)
            st.add(dict(rec, lr_factor=f))
            fin = body.get("final", {})
            say(
                f"[{i}/{len(todo)} {time.time() - t0:6.0f}s] {task.name:7s} {opt:18s} "
                f"lr x{f:<5g} seed {seed}: {body['status']} "
                + (
                    f"val_loss {fin['val_loss']:.4f}"
                    if body["status"] == "ok"
                    else body.get("reason", "")[:160]
                )
            )


def plan(
    chosen: list[tasks.Task],
    optimizers: list[str],
    grid: list[float],
    sweep_seeds: int,
    seeds: int,
) -> dict[str, int]:
    """Run counts before anything runs: the sweep exactly, the confirm phase at most (every
    optimizer's best at a factor other than AdamW's, and every drop-in at AdamW's), so a user
    can size the job before starting it."""
    n_sweep = len(chosen) * len(optimizers) * len(grid) * sweep_seeds
    extra = max(0, seeds - sweep_seeds)
    dropins = sum(peers.PEERS[o].lr_scale == 1.0 for o in optimizers if o != "adamw")
    # the sweep already ran its seeds at every grid factor, AdamW's best among them
    per_task = (len(optimizers) + dropins) * extra
    return dict(
        sweep=n_sweep,
        confirm_at_most=len(chosen) * per_task,
        per_extension=len(chosen) * len(optimizers) * sweep_seeds,
    )


def lr_sweep(
    out: Path,
    task_names: list[str],
    optimizers: list[str],
    factors: list[float],
    sweep_seeds: int = 1,
    seeds: int = 3,
    scale: float = 1.0,
    jobs: int = 2,
    store_path: Path | None = None,
    timeout: float = 900.0,
    quiet: bool = False,
    cmd: str = "",
    smoke: bool = False,
    extend_grid: int = 0,
) -> Path:
    """Sweep, extend where asked, confirm, then write lr_sweep.md, lr_sweep.json and
    lr_sweep.png into ``out``. Returns the markdown's path."""
    if "adamw" not in optimizers:
        raise ValueError("an lr sweep is measured against AdamW's best lr: include adamw")
    out.mkdir(parents=True, exist_ok=True)
    st = store.Store(store_path or out / "runs.jsonl")
    rev = store.revision()
    chosen = [tasks.scaled(tasks.TASKS[t], scale, smoke) for t in task_names]
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    s_seeds, c_seeds = list(range(sweep_seeds)), list(range(seeds))
    grids = {t.name: list(factors) for t in chosen}
    extensions: dict[str, list[float]] = {t.name: [] for t in chosen}
    t0 = time.time()
    ran = 0
    p = plan(chosen, optimizers, factors, sweep_seeds, seeds)
    say(
        f"revision {rev['code']}: sweep {p['sweep']} runs, then at most {p['confirm_at_most']} "
        f"confirm runs (+{p['per_extension']} per grid extension); stored runs in {st.path} "
        "are reused"
    )

    used: set[str] = set()

    def get(task, opt, f, seed):
        k = key(task, opt, f, seed, rev)
        r = st.get(k)
        if r is not None:
            used.add(k)
        return r

    def missing(wanted):
        """The wanted (task, optimizer, factor, seed) runs not stored yet, each once."""
        todo = {}
        for t, o, f, s in wanted:
            k = key(t, o, f, s, rev)
            if st.get(k) is None:
                todo[k] = (t, o, f, s, k)
        return list(todo.values())

    for round_ in range(extend_grid + 1):
        todo = missing(
            (t, o, f, s) for t in chosen for o in optimizers for f in grids[t.name] for s in s_seeds
        )
        say(f"sweep{' (extension ' + str(round_) + ')' if round_ else ''}: {len(todo)} to run")
        _run(todo, st, rev, jobs, timeout, say, t0)
        ran += len(todo)
        if round_ == extend_grid:
            break
        grew = False
        for t in chosen:
            for side, who in sorted(edges_of(t, optimizers, grids[t.name], s_seeds, get).items()):
                grids[t.name] = extended(grids[t.name], side)
                new = grids[t.name][-1 if side == "high" else 0]
                extensions[t.name].append(new)
                say(f"{t.name}: best of {', '.join(who)} at the {side} end: added x{new:g}")
                grew = True
        if not grew:
            break

    analyses = {
        t.name: analyse(t, optimizers, grids[t.name], s_seeds, c_seeds, get) for t in chosen
    }
    todo = []
    for t in chosen:
        a = analyses[t.name]
        want = [(t, o, f, s) for o, f in a["best"].items() if f is not None for s in c_seeds]
        if a["adamw_best"] is not None:
            want += [
                (t, o, a["adamw_best"], s)
                for o in optimizers
                if peers.PEERS[o].lr_scale == 1.0
                for s in c_seeds
            ]
        todo += missing(want)
    say(f"confirm: {len(todo)} to run")
    _run(todo, st, rev, jobs, timeout, say, t0)
    ran += len(todo)
    analyses = {
        t.name: dict(
            analyse(t, optimizers, grids[t.name], s_seeds, c_seeds, get),
            extended=extensions[t.name],
        )
        for t in chosen
    }
    wall = (
        f"This invocation ran {ran} run(s) in {time.time() - t0:.0f} s"
        f" and reused {len(used) - ran}."
    )
    settings = dict(
        factors=factors, sweep_seeds=s_seeds, seeds=c_seeds, extend_grid=extend_grid, jobs=jobs
    )
    return sweep_report.write(
        out,
        sweep_report.SweepReport(
            analyses=analyses,
            chosen=chosen,
            optimizers=optimizers,
            settings=settings,
            rev=rev,
            ignored=st.other_revisions(rev),
            cmd=cmd,
            wall=wall,
            metric=METRIC,
            trains_within=TRAINS_WITHIN,
            grid_note=spacing_note(factors),
        ),
    )
