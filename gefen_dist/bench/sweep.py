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
fixed-lr records and a rerun reuses every finished run.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path
from typing import Any

from gefen_dist.bench import peers, report, store, suite, tasks

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


def lr_of(task: tasks.Task, optimizer: str, factor: float) -> float:
    return task.hyper.lr * factor * peers.PEERS[optimizer].lr_scale


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
    return write(
        out, analyses, chosen, optimizers, settings, rev, st.other_revisions(rev), cmd, wall
    )


# -- writing ----------------------------------------------------------------------------------
def _fx(f: float | None) -> str:
    return "—" if f is None else f"×{f:g}"


def _lr(task: tasks.Task, opt: str, f: float | None) -> str:
    return "—" if f is None else f"{_fx(f)} = {lr_of(task, opt, f):.3g}"


def _label(opt: str) -> str:
    p = peers.PEERS[opt]
    return p.label + (f" [lr × {p.lr_scale:g}]" if p.lr_scale != 1.0 else "")


def markdown(
    analyses: dict,
    chosen: list[tasks.Task],
    optimizers: list[str],
    settings: dict,
    rev: dict,
    ignored: dict,
    cmd: str,
    wall: str,
) -> str:
    L = ["# Gefen against its peers, each at its own best lr (lr sweep)", ""]
    L += report.header(cmd, rev, ignored, wall, settings["jobs"])
    n_s, n_c = len(settings["sweep_seeds"]), len(settings["seeds"])
    L += [
        "Every optimizer of a task: same init, data order and warmup + cosine schedule per seed, "
        "as in the fixed-lr report; only the peak lr changes. Grid: lr = factor × the task's lr "
        f"(factors {', '.join(_fx(f) for f in settings['factors'])}), times the peer's own lr "
        "scale where it has one (Adafactor × 30, SM3 × 10), so the grid brackets those peers' "
        f"best as well. Sweep: {n_s} seed(s) per grid point; best lr = lowest final validation "
        f"loss (mean over the sweep seeds; a factor where any run failed or ended non-finite is "
        f"not eligible). Then {n_c} paired seeds at each optimizer's best lr and at AdamW's best "
        "lr for the drop-ins (lr scale 1); sweep seeds are reused. Δ is the mean paired "
        "(same-seed) difference to AdamW at AdamW's best lr; σ is AdamW's seed standard "
        "deviation there; t the paired t statistic.",
        "",
        "Run-length check: the same comparison at the validation evaluation nearest half the "
        "run, from the same runs. That point is mid-schedule (the cosine has not annealed), so "
        "it asks whether the ranking holds through training, not what a separately scheduled "
        "half-length run would give.",
        "",
        f"Highest lr that still trains (d): the highest grid lr at which every sweep run ends "
        f"finite and the mean final val loss is within {TRAINS_WITHIN:.0%} of the optimizer's "
        f"own best (relative val loss, the same rule on every task).",
        "",
    ]
    note = spacing_note(settings["factors"])
    if note:
        L += [f"Grid: {note}.", ""]
    L += ["## Is AdamW's best lr bracketed?", ""]
    for t in chosen:
        a = analyses[t.name]
        L.append("- " + _bracket_line(t, a))
    L += ["", "## Summary", ""]
    L += [
        "| task | AdamW best lr | Gefen 8-bit: best vs best | at AdamW's best | "
        "Gefen 4-bit: best vs best | at AdamW's best | Gefen vs AdamW ranking at half length |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in chosen:
        a = analyses[t.name]
        cells = [t.name, _lr(t, "adamw", a["adamw_best"])]
        for g in ("gefen8", "gefen4"):
            for comp in ("best_vs_best", "at_adamw_best"):
                cells.append(report._diff(a[comp].get(g, {}).get(METRIC), True) or "—")
        cells.append(_ranking_short(a))
        L.append("| " + " | ".join(cells) + " |")
    L += ["", "![final val loss against lr](lr_sweep.png)", ""]
    for t in chosen:
        L += _task_lines(t, analyses[t.name], optimizers, settings)
    return "\n".join(L)


def _bracket_line(t: tasks.Task, a: dict) -> str:
    grid, b = a["grid"], a["adamw_best"]
    span = f"{_fx(grid[0])} to {_fx(grid[-1])}"
    ext = (
        f" (grid extended to {', '.join(_fx(f) for f in a['extended'])})"
        if a.get("extended")
        else ""
    )
    if b is None:
        return f"**{t.name}: AdamW trained at no lr of the grid {span}{ext}: nothing to compare.**"
    side = a["edges"].get("adamw")
    if side:
        where = "highest" if side == "high" else "lowest"
        beyond = "higher" if side == "high" else "lower"
        return (
            f"**{t.name}: NOT BRACKETED. AdamW's best lr is the {where} of the grid "
            f"({_lr(t, 'adamw', b)}, grid {span}){ext}; its true best may be {beyond}, and "
            f"every comparison below is against an AdamW that may not be at its best. Rerun "
            f"with --extend-grid or with --lr-factors reaching {beyond}.**"
        )
    others = [
        f"{peers.PEERS[o].label} ({'top' if s == 'high' else 'bottom'})"
        for o, s in a["edges"].items()
        if o != "adamw"
    ]
    line = f"{t.name}: bracketed: AdamW's best lr {_lr(t, 'adamw', b)} is inside the grid {span}"
    line += ext + "."
    if others:
        line += (
            " Best at an end of the grid, so possibly better beyond it: " + ", ".join(others) + "."
        )
    return line


def _ranking_short(a: dict) -> str:
    r = a["ranking"]["best_vs_best"]["gefen"]
    if a["half_step"] is None:
        return "no mid-run evaluation"
    parts = []
    for g, x in r.items():
        if "changed" not in x:
            continue
        name = "8-bit" if g == "gefen8" else "4-bit"
        parts.append(
            f"{name} {'CHANGED' if x['changed'] else 'unchanged'} "
            f"({x['half']} at half, {x['full']} at the end)"
        )
    return "; ".join(parts) or "—"


def _sweep_cell(c: dict, is_best: bool) -> str:
    if c["status"] == "ok":
        s = f"{c['mean']:.4f}"
        return f"**{s}**" if is_best else s
    return c["status"]


def _task_lines(t: tasks.Task, a: dict, optimizers: list[str], settings: dict) -> list[str]:
    h = t.hyper
    grid = a["grid"]
    n_s, n_c = len(settings["sweep_seeds"]), len(settings["seeds"])
    cls = t.kind == "cls"
    anyc = next(iter(a["best_vs_best"].values()), {})
    L = [
        f"## {t.name}: {t.label}",
        "",
        f"{anyc.get('params', '?')} parameters; {h.steps} steps, task lr {h.lr:g}, betas "
        f"{h.betas}, weight decay {h.weight_decay:g}, warmup {h.warmup_frac:.0%}, cosine to "
        f"{h.min_lr_frac:.0%}, clip {h.grad_clip:g}; sizes {json.dumps(t.sizes)}",
        "",
        _bracket_line(t, a),
        "",
        f"### (a) Final val loss against lr ({n_s} sweep seed(s); bold: each one's best)",
        "",
        "| optimizer | " + " | ".join(f"{_fx(f)} ({h.lr * f:.3g})" for f in grid) + " | best |",
        "|---|" + "---|" * (len(grid) + 1),
    ]
    reasons = []
    for o in optimizers:
        pts, b = a["sweep"][o], a["best"][o]
        row = [_label(o)] + [_sweep_cell(pts[f], f == b) for f in grid]
        row.append(_lr(t, o, b) + (f" (at the {a['edges'][o]} end)" if o in a["edges"] else ""))
        L.append("| " + " | ".join(row) + " |")
        bad = [(f, c) for f, c in pts.items() if c["status"] not in ("ok",)]
        if bad:
            f, c = bad[0]
            reasons.append(
                f"{peers.PEERS[o].label} at {_fx(f)}: {c['status']}, {c['reason'][:150]}"
            )
    if reasons:
        L += [""] + [f"- {x}" for x in reasons]
    L += [
        "",
        "Column lrs are AdamW's; a peer with an lr scale ran at that times its scale.",
        "",
    ]
    hs = a["half_step"]
    half = a.get("best_vs_best_half", {})
    L += [
        f"### (b) Each optimizer at its own best lr against AdamW at its best ({n_c} paired seeds)",
        "",
    ]
    head = "| optimizer | best lr | val loss | Δ loss vs AdamW |"
    if cls:
        head += " val acc % | Δ acc vs AdamW |"
    if hs is not None:
        head += f" val loss at step {hs} | Δ at step {hs} | rank (full / step {hs}) |"
    head += " bytes/param | seeds |"
    L += [head, "|" + "---|" * (head.count("|") - 1)]
    rk = a["ranking"]["best_vs_best"]
    for o in optimizers:
        if a["best"][o] is None:
            bad = next(iter(a["sweep"][o].values()), {})
            why = (
                f"skipped: {bad.get('reason', '')[:150]}"
                if all(c["status"] == "skipped" for c in a["sweep"][o].values())
                else "did not train at any lr of the grid"
            )
            L.append(f"| {_label(o)} | {why} |")
            continue
        c = a["best_vs_best"].get(o)
        if not c or c["status"] not in ("ok", "partial"):
            L.append(f"| {_label(o)} | {_lr(t, o, a['best'][o])} | {(c or {}).get('reason', '')} |")
            continue
        row = (
            f"| {_label(o)} | {_lr(t, o, a['best'][o])} | {report._pm(c[METRIC], '.4f')} | "
            f"{report._diff(c[METRIC], True)} |"
        )
        if cls:
            row += (
                f" {report._pm(c.get('val_acc'), '.1f', 100)} |"
                f" {report._diff(c.get('val_acc'), False, 100)} |"
            )
        if hs is not None:
            hc = half.get(o, {})
            r_full = rk["order_full"].index(o) + 1 if o in rk["order_full"] else "—"
            r_half = rk.get("order_half", [])
            r_half = r_half.index(o) + 1 if o in r_half else "—"
            row += (
                f" {report._pm(hc.get(METRIC), '.4f')} | {report._diff(hc.get(METRIC), True)} |"
                f" {r_full} / {r_half} |"
            )
        row += f" {c['bytes_per_param']:.3f} | {len(c['seeds'])} |"
        L.append(row)
    L += [""] + _ranking_lines(a, "best_vs_best", hs, h.steps) + [""]
    L += _selection_lines(a, n_s) + [""]
    L += _at_adamw_lines(t, a, optimizers, n_c, hs, h.steps, cls)
    L += [
        "### (d) Highest lr that still trains",
        "",
        "| optimizer | highest lr that trains | its val loss vs own best | one step higher |",
        "|---|---|---|---|",
    ]
    for o in optimizers:
        x = a["trains"][o]
        if x is None:
            L.append(f"| {_label(o)} | none of the grid | | |")
            continue
        nxt = x.get("next")
        if nxt is None:
            more = "top of the grid: may train higher"
        elif nxt["status"] == "ok":
            more = f"{_fx(nxt['factor'])}: {100 * nxt['rel']:+.0f} % (beyond {TRAINS_WITHIN:.0%})"
        else:
            more = f"{_fx(nxt['factor'])}: {nxt['status']} ({nxt['reason'][:80]})"
        L.append(f"| {_label(o)} | {_lr(t, o, x['factor'])} | {100 * x['rel']:+.1f} % | {more} |")
    L.append("")
    return L


def _selection_lines(a: dict, n_s: int) -> list[str]:
    sel = a.get("selection", {})
    weak = [(o, x) for o, x in sel.items() if x.get("holds") is False]
    if not weak:
        checked = [o for o, x in sel.items() if "holds" in x]
        return (
            [
                f"Best-lr check: every best lr holds on the paired seeds (their mean at the best "
                f"lr is no worse than the runner-up lr on the {n_s} sweep seed(s))."
            ]
            if checked
            else []
        )
    L = []
    for o, x in weak:
        L.append(
            f"**Best-lr check: {peers.PEERS[o].label}'s best lr {_fx(x['factor'])} rests on a "
            f"lucky sweep draw: {x['sweep']:.4f} there on {n_s} sweep seed(s), {x['paired']:.4f} "
            f"over {x['n']} paired seeds, worse than {_fx(x['runner_up'])}'s "
            f"{x['runner_up_sweep']:.4f} on the sweep seed(s); more --sweep-seeds would "
            "settle it.**"
        )
    return L


def _ranking_lines(a: dict, comp: str, hs: int | None, steps: int) -> list[str]:
    if hs is None:
        return ["Run-length check: the runs have no evaluation near half the run."]
    r = a["ranking"][comp]
    L = []
    if "order_unchanged" in r:
        L.append(
            f"Ranking of all optimizers at step {hs} vs step {steps}: "
            + ("unchanged." if r["order_unchanged"] else "changed.")
        )
    for g, x in r["gefen"].items():
        if "changed" not in x:
            continue
        verdict = "CHANGED" if x["changed"] else "unchanged"
        L.append(
            f"{peers.PEERS[g].label} vs AdamW: {x['half']} at step {hs} "
            f"({_dt(x['diff_half'], x['t_half'])}), {x['full']} at step {steps} "
            f"({_dt(x['diff_full'], x['t_full'])}): ranking {verdict}."
        )
    if any(x.get("changed") for x in r["gefen"].values()):
        L.append(
            "(A change where |t| is small at either length is within the seeds' noise: the "
            "sign of that Δ is not established.)"
        )
    return [" ".join(L)] if L else []


def _dt(d: float, t: float | None) -> str:
    return f"Δ {d:+.4f}" + (f", t {t:+.1f}" if t is not None else "")


def _at_adamw_lines(
    t: tasks.Task, a: dict, optimizers: list[str], n_c: int, hs: int | None, steps: int, cls: bool
) -> list[str]:
    b = a["adamw_best"]
    L = [f"### (c) Gefen and the other drop-ins at AdamW's best lr ({_lr(t, 'adamw', b)})", ""]
    if b is None:
        return L + ["AdamW trained at no lr of the grid.", ""]
    cells, half = a["at_adamw_best"], a.get("at_adamw_best_half", {})
    head = "| optimizer | val loss | Δ loss vs AdamW |"
    if cls:
        head += " val acc % | Δ acc vs AdamW |"
    if hs is not None:
        head += f" Δ at step {hs} |"
    head += " its own best lr | seeds |"
    L += [head, "|" + "---|" * (head.count("|") - 1)]
    for o in optimizers:
        if o not in cells:
            continue
        c = cells[o]
        if c["status"] not in ("ok", "partial"):
            L.append(f"| {_label(o)} | {c['status']}: {c.get('reason', '')[:150]} |")
            continue
        row = f"| {_label(o)} | {report._pm(c[METRIC], '.4f')} | {report._diff(c[METRIC], True)} |"
        if cls:
            row += (
                f" {report._pm(c.get('val_acc'), '.1f', 100)} |"
                f" {report._diff(c.get('val_acc'), False, 100)} |"
            )
        if hs is not None:
            row += f" {report._diff(half.get(o, {}).get(METRIC), True)} |"
        row += f" {_fx(a['best'][o])} | {len(c['seeds'])} |"
        L.append(row)
    L += [""] + _ranking_lines(a, "at_adamw_best", hs, steps) + [""]
    for x in a["goals_at_adamw_best"]:
        if "note" in x:
            L.append(f"- {peers.PEERS[x['gefen']].label}: {x['note']}")
            continue
        tol = report.GEFEN[x["gefen"]][1 if x["metric"] == "val_acc" else 0]
        L.append(
            f"- Goal (b) at AdamW's best lr, {peers.PEERS[x['gefen']].label}: "
            + report.goal_verdict(x, tol)
        )
    return L + [""]


def figure(out: Path, analyses: dict, chosen: list[tasks.Task], optimizers: list[str]) -> Path:
    """One panel per task: final val loss against the lr factor, each optimizer's best marked,
    runs that did not train drawn as crosses at the top, AdamW's best as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "axes.spines.top": False, "axes.spines.right": False})
    n = len(chosen)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 2.9 * rows), squeeze=False)
    for ax, t in zip(axes.flat, chosen, strict=False):
        a = analyses[t.name]
        ys_all = [c["mean"] for o in optimizers for c in a["sweep"][o].values() if "mean" in c]
        if ys_all:
            lo = min(ys_all)
            hi = min(max(ys_all), lo * 3 if lo > 0 else max(ys_all))
            top = hi * 1.05
        else:
            lo = hi = top = 1.0
        for o in optimizers:
            pts = a["sweep"][o]
            xs = [f for f in a["grid"] if pts[f]["status"] == "ok"]
            ys = [min(pts[f]["mean"], top) for f in xs]
            lw = 1.8 if o in report.GEFEN or o == "adamw" else 1.0
            ax.plot(xs, ys, marker=".", color=report.COLORS.get(o), lw=lw, label=_label(o))
            b = a["best"][o]
            if b is not None:
                ax.plot([b], [pts[b]["mean"]], "o", color=report.COLORS.get(o), ms=6)
            bad = [f for f in a["grid"] if pts[f]["status"] in ("diverged", "failed")]
            ax.plot(bad, [top] * len(bad), "x", color=report.COLORS.get(o), ms=6)
        if a["adamw_best"] is not None:
            ax.axvline(a["adamw_best"], color=report.COLORS["adamw"], ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.set_ylim(lo - 0.05 * (top - lo or 1.0), top + 0.05 * (top - lo or 1.0))
        ax.set_title(f"{t.name} (task lr {t.hyper.lr:g})", fontsize=9)
        ax.set_xlabel("lr factor")
        ax.set_ylabel("final val loss")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if n < rows * cols:
        list(axes.flat)[-1].legend(handles, labels, loc="center", frameon=False)
    else:
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.suptitle(
        "Final val loss against lr factor (dots: each one's best; x: did not train; "
        "dashed: AdamW's best)",
        fontsize=9,
    )
    fig.tight_layout()
    path = out / "lr_sweep.png"
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def write(
    out: Path,
    analyses: dict,
    chosen: list[tasks.Task],
    optimizers: list[str],
    settings: dict,
    rev: dict,
    ignored: dict,
    cmd: str,
    wall: str = "",
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    figure(out, analyses, chosen, optimizers)

    def jsonable(a: dict) -> dict:  # float keys become strings in JSON: say which
        return dict(
            a,
            sweep={o: {f"{f:g}": c for f, c in pts.items()} for o, pts in a["sweep"].items()},
        )

    (out / "lr_sweep.json").write_text(
        json.dumps(
            dict(
                command=cmd,
                revision=rev,
                ignored_other_revisions=ignored,
                settings=settings,
                trains_within=TRAINS_WITHIN,
                metric=METRIC,
                tasks={t.name: t.settings() for t in chosen},
                lr_scale={o: peers.PEERS[o].lr_scale for o in optimizers},
                analyses={k: jsonable(v) for k, v in analyses.items()},
            ),
            indent=1,
        )
    )
    path = out / "lr_sweep.md"
    path.write_text(markdown(analyses, chosen, optimizers, settings, rev, ignored, cmd, wall))
    return path
