"""The lr sweep's report: lr_sweep.md, lr_sweep.json and lr_sweep.png, from ``sweep.analyse``'s
result per task.

Apart from ``sweep`` (the grid, the runs and their analysis) so that each file has one job; the
cells, tables, header and panels it shares with the fixed-lr report come from ``render``. It is
handed everything it shows as a ``SweepReport`` (the analysis rule's metric and its "still
trains" bound included, as lr_sweep.json records them), so a report regenerates from its JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gefen_dist.bench import peers, render, report, tasks
from gefen_dist.bench.render import diff, pm


@dataclass(frozen=True)
class SweepReport:
    """What the sweep's report shows, and how the sweep that measured it was run."""

    analyses: dict[str, dict[str, Any]]
    """``sweep.analyse``'s result per task name, with ``extended``: the factors a grid gained."""
    chosen: list[tasks.Task]
    optimizers: list[str]
    settings: dict[str, Any]
    """factors, sweep_seeds, seeds, extend_grid and jobs, as the sweep ran."""
    rev: dict[str, str]
    ignored: dict[str, int]
    """Stored records of other revisions, per revision, left out."""
    cmd: str
    wall: str
    metric: str
    """The metric each best lr was chosen by (``sweep.METRIC``)."""
    trains_within: float
    """Rule (d)'s bound (``sweep.TRAINS_WITHIN``)."""
    grid_note: str | None
    """``sweep.spacing_note`` of the grid as asked, where it is not about 3 apart."""


def lr_of(task: tasks.Task, optimizer: str, factor: float) -> float:
    """The lr a run at ``factor`` trained with: the task's lr times the factor and the peer's lr
    scale."""
    return task.hyper.lr * factor * peers.PEERS[optimizer].lr_scale


def _fx(f: float | None) -> str:
    return "—" if f is None else f"×{f:g}"


def _lr(task: tasks.Task, opt: str, f: float | None) -> str:
    return "—" if f is None else f"{_fx(f)} = {lr_of(task, opt, f):.3g}"


def _label(opt: str) -> str:
    p = peers.PEERS[opt]
    return p.label + (f" [lr × {p.lr_scale:g}]" if p.lr_scale != 1.0 else "")


def markdown(r: SweepReport) -> str:
    """lr_sweep.md: how the sweep ran, whether AdamW's best lr is bracketed, the summary, then
    per task the sweep (a), best against best (b), at AdamW's best (c), the highest lr that
    trains (d)."""
    settings = r.settings
    L = ["# Gefen against its peers, each at its own best lr (lr sweep)", ""]
    L += render.header(r.cmd, r.rev, r.ignored, r.wall, settings["jobs"])
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
        f"finite and the mean final val loss is within {r.trains_within:.0%} of the optimizer's "
        f"own best (relative val loss, the same rule on every task).",
        "",
    ]
    if r.grid_note:
        L += [f"Grid: {r.grid_note}.", ""]
    L += ["## Is AdamW's best lr bracketed?", ""]
    for t in r.chosen:
        L.append("- " + _bracket_line(t, r.analyses[t.name]))
    L += ["", "## Summary", ""]
    L += render.table(
        "| task | AdamW best lr | Gefen 8-bit: best vs best | at AdamW's best | "
        "Gefen 4-bit: best vs best | at AdamW's best | Gefen vs AdamW ranking at half length |"
    )
    for t in r.chosen:
        a = r.analyses[t.name]
        cells = [t.name, _lr(t, "adamw", a["adamw_best"])]
        for g in ("gefen8", "gefen4"):
            for comp in ("best_vs_best", "at_adamw_best"):
                cells.append(diff(a[comp].get(g, {}).get(r.metric), True) or "—")
        cells.append(_ranking_short(a))
        L.append(render.row(cells))
    L += ["", "![final val loss against lr](lr_sweep.png)", ""]
    for t in r.chosen:
        L += _task_lines(r, t, r.analyses[t.name])
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


def _task_lines(r: SweepReport, t: tasks.Task, a: dict) -> list[str]:
    h, metric, optimizers = t.hyper, r.metric, r.optimizers
    grid = a["grid"]
    n_s, n_c = len(r.settings["sweep_seeds"]), len(r.settings["seeds"])
    cls = t.kind == "cls"
    anyc = next(iter(a["best_vs_best"].values()), {})
    L = [
        f"## {t.name}: {t.label}",
        "",
        render.task_line(t, anyc.get("params", "?"), "task lr"),
        "",
        _bracket_line(t, a),
        "",
        f"### (a) Final val loss against lr ({n_s} sweep seed(s); bold: each one's best)",
        "",
        *render.table(
            render.row(["optimizer", *(f"{_fx(f)} ({h.lr * f:.3g})" for f in grid), "best"])
        ),
    ]
    reasons = []
    for o in optimizers:
        pts, b = a["sweep"][o], a["best"][o]
        cells = [_label(o)] + [_sweep_cell(pts[f], f == b) for f in grid]
        cells.append(_lr(t, o, b) + (f" (at the {a['edges'][o]} end)" if o in a["edges"] else ""))
        L.append(render.row(cells))
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
    L += render.table(head)
    rk = a["ranking"]["best_vs_best"]
    for o in optimizers:
        if a["best"][o] is None:
            bad = next(iter(a["sweep"][o].values()), {})
            why = (
                f"skipped: {bad.get('reason', '')[:150]}"
                if all(c["status"] == "skipped" for c in a["sweep"][o].values())
                else "did not train at any lr of the grid"
            )
            L.append(render.row([_label(o), why]))
            continue
        c = a["best_vs_best"].get(o)
        if not c or c["status"] not in ("ok", "partial"):
            L.append(render.row([_label(o), _lr(t, o, a["best"][o]), (c or {}).get("reason", "")]))
            continue
        cells = [_label(o), _lr(t, o, a["best"][o]), pm(c[metric], ".4f"), diff(c[metric], True)]
        if cls:
            cells += [pm(c.get("val_acc"), ".1f", 100), diff(c.get("val_acc"), False, 100)]
        if hs is not None:
            hc = half.get(o, {})
            r_full = rk["order_full"].index(o) + 1 if o in rk["order_full"] else "—"
            r_half = rk.get("order_half", [])
            r_half = r_half.index(o) + 1 if o in r_half else "—"
            cells += [pm(hc.get(metric), ".4f"), diff(hc.get(metric), True), f"{r_full} / {r_half}"]
        cells += [f"{c['bytes_per_param']:.3f}", str(len(c["seeds"]))]
        L.append(render.row(cells))
    L += [""] + _ranking_lines(a, "best_vs_best", hs, h.steps) + [""]
    L += _selection_lines(a, n_s) + [""]
    L += _at_adamw_lines(r, t, a, n_c, hs, cls)
    L += [
        "### (d) Highest lr that still trains",
        "",
        *render.table(
            "| optimizer | highest lr that trains | its val loss vs own best | one step higher |"
        ),
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
            more = f"{_fx(nxt['factor'])}: {100 * nxt['rel']:+.0f} % (beyond {r.trains_within:.0%})"
        else:
            more = f"{_fx(nxt['factor'])}: {nxt['status']} ({nxt['reason'][:80]})"
        L.append(render.row([_label(o), _lr(t, o, x["factor"]), f"{100 * x['rel']:+.1f} %", more]))
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
    r: SweepReport, t: tasks.Task, a: dict, n_c: int, hs: int | None, cls: bool
) -> list[str]:
    metric = r.metric
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
    L += render.table(head)
    for o in r.optimizers:
        if o not in cells:
            continue
        c = cells[o]
        if c["status"] not in ("ok", "partial"):
            L.append(render.row([_label(o), f"{c['status']}: {c.get('reason', '')[:150]}"]))
            continue
        row = [_label(o), pm(c[metric], ".4f"), diff(c[metric], True)]
        if cls:
            row += [pm(c.get("val_acc"), ".1f", 100), diff(c.get("val_acc"), False, 100)]
        if hs is not None:
            row.append(diff(half.get(o, {}).get(metric), True))
        row += [_fx(a["best"][o]), str(len(c["seeds"]))]
        L.append(render.row(row))
    L += [""] + _ranking_lines(a, "at_adamw_best", hs, t.hyper.steps) + [""]
    for x in a["goals_at_adamw_best"]:
        if "note" in x:
            L.append(f"- {peers.PEERS[x['gefen']].label}: {x['note']}")
            continue
        tol = report.GEFEN[x["gefen"]][1 if x["metric"] == "val_acc" else 0]
        L.append(
            f"- Goal (b) at AdamW's best lr, {peers.PEERS[x['gefen']].label}: "
            + render.goal_verdict(x, tol)
        )
    return L + [""]


def figure(out: Path, r: SweepReport) -> Path:
    """lr_sweep.png, one panel per task: final val loss against the lr factor, each optimizer's
    best marked, runs that did not train drawn as crosses at the top, AdamW's best as a dashed
    line."""
    optimizers = r.optimizers
    p = render.panels(len(r.chosen), 3.8, 2.9)
    for ax, t in zip(p.axes, r.chosen, strict=False):
        a = r.analyses[t.name]
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
            ax.plot(xs, ys, marker=".", color=render.COLORS.get(o), lw=lw, label=_label(o))
            b = a["best"][o]
            if b is not None:
                ax.plot([b], [pts[b]["mean"]], "o", color=render.COLORS.get(o), ms=6)
            bad = [f for f in a["grid"] if pts[f]["status"] in ("diverged", "failed")]
            ax.plot(bad, [top] * len(bad), "x", color=render.COLORS.get(o), ms=6)
        if a["adamw_best"] is not None:
            ax.axvline(a["adamw_best"], color=render.COLORS["adamw"], ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.set_ylim(lo - 0.05 * (top - lo or 1.0), top + 0.05 * (top - lo or 1.0))
        ax.set_title(f"{t.name} (task lr {t.hyper.lr:g})", fontsize=9)
        ax.set_xlabel("lr factor")
        ax.set_ylabel("final val loss")
        ax.grid(alpha=0.3)
    title = (
        "Final val loss against lr factor (dots: each one's best; x: did not train; "
        "dashed: AdamW's best)"
    )
    return render.save_panels(p, title, out / "lr_sweep.png")


def write(out: Path, r: SweepReport) -> Path:
    """lr_sweep.png, lr_sweep.json (everything the report rests on, the analyses whole) and
    lr_sweep.md into ``out``; returns the markdown's path."""
    out.mkdir(parents=True, exist_ok=True)
    figure(out, r)

    def jsonable(a: dict) -> dict:  # float keys become strings in JSON: say which
        return dict(
            a,
            sweep={o: {f"{f:g}": c for f, c in pts.items()} for o, pts in a["sweep"].items()},
        )

    (out / "lr_sweep.json").write_text(
        json.dumps(
            dict(
                command=r.cmd,
                revision=r.rev,
                ignored_other_revisions=r.ignored,
                settings=r.settings,
                trains_within=r.trains_within,
                metric=r.metric,
                tasks={t.name: t.settings() for t in r.chosen},
                lr_scale={o: peers.PEERS[o].lr_scale for o in r.optimizers},
                analyses={k: jsonable(v) for k, v in r.analyses.items()},
            ),
            indent=1,
        )
    )
    path = out / "lr_sweep.md"
    path.write_text(markdown(r))
    return path
