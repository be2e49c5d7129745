"""The comparison's report: report.md, results.json and three small PNGs, from stored records.
Its statistics (``summarize``, ``goals``) serve the lr sweep's report too; the header, cells,
palette and panels both reports draw with are ``render``'s.

Statistics, and why: every optimizer of a task runs the same seeds with the same init and data
order, so differences to AdamW are taken per seed (paired), which cancels most of the
seed-to-seed spread that both share. ``diff_sd`` is the mean paired difference in units of
AdamW's own seed standard deviation (how large the gap is next to the noise); ``t`` is the
paired t statistic, and "significantly worse" means a one-sided paired t-test at 5 % (with 3
seeds the critical t is 2.92). With one seed there is no spread: both are left empty.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from gefen_dist.bench import peers, render, tasks
from gefen_dist.bench.render import diff, pm

GEFEN = {"gefen8": (0.01, 0.005), "gefen4": (0.02, 0.005)}
"""Goal (b): allowed relative val-loss gap (LM tasks) and accuracy gap (classification)."""


def _t_crit(df: int) -> float:
    """One-sided 95 % quantile of Student's t."""
    try:
        from scipy.stats import t

        return float(t.ppf(0.95, df))
    except ImportError:
        return {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015}.get(df, 1.645)


def _ms(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else float("nan"))


def summarize(
    rows: list[dict[str, Any]], chosen: list[tasks.Task], optimizers: list[str]
) -> dict[str, Any]:
    """Per task and optimizer: metric mean/std over seeds, paired difference to AdamW, bytes per
    parameter, step time; skipped/failed runs with their reasons."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by.setdefault((r["task"], r["optimizer"]), []).append(r)
    out: dict[str, Any] = {}
    for task in chosen:
        base = {r["seed"]: r for r in by.get((task.name, "adamw"), []) if r["status"] == "ok"}
        cells = {}
        for opt in optimizers:
            runs = sorted(by.get((task.name, opt), []), key=lambda r: r["seed"])
            ok = [r for r in runs if r["status"] == "ok"]
            bad = [r for r in runs if r["status"] != "ok"]
            cell: dict[str, Any] = dict(label=peers.PEERS[opt].label, seeds=[r["seed"] for r in ok])
            if not ok:
                cell.update(
                    status=bad[0]["status"] if bad else "missing",
                    reason=bad[0].get("reason", "") if bad else "no stored run",
                )
                cells[opt] = cell
                continue
            cell["status"] = "ok" if not bad else "partial"
            if bad:
                cell["reason"] = f"{len(bad)} seed(s) {bad[0]['status']}: {bad[0].get('reason')}"
            for m in ("val_loss", "val_acc"):
                if m not in ok[0]["final"]:
                    continue
                xs = [r["final"][m] for r in ok]
                mean, sd = _ms(xs)
                c = dict(mean=mean, std=sd, values=xs)
                paired = [
                    (r["final"][m], base[r["seed"]]["final"][m]) for r in ok if r["seed"] in base
                ]
                if paired and opt != "adamw":
                    d = [a - b for a, b in paired]
                    b_sd = _ms([b for _, b in paired])[1]
                    dmean, dsd = _ms(d)
                    bmean = statistics.fmean(b for _, b in paired)
                    c.update(
                        diff=dmean,
                        rel=dmean / bmean,
                        diff_sd=dmean / b_sd if b_sd and b_sd == b_sd else None,
                        t=dmean / (dsd / math.sqrt(len(d))) if dsd and dsd == dsd else None,
                        n_paired=len(d),
                    )
                cell[m] = c
            cell["bytes_per_param"] = statistics.fmean(r["bytes_per_param"] for r in ok)
            cell["state_bytes"] = ok[0]["state_bytes"]
            cell["params"] = ok[0]["params"]
            cell["step_ms"] = statistics.median(r["step_ms_median"] for r in ok)
            cell["revision"] = sorted({r["revision"] for r in ok})
            if "gefen" in ok[0]:
                g = ok[0]["gefen"]
                cell["fallback_numel"] = g["fallback_numel"]
                cell["tensors"] = g["tensors"]
            cell["curve"] = _mean_curve([r["curve"] for r in ok])
            cells[opt] = cell
        out[task.name] = cells
    return out


def _mean_curve(curves: list[list[dict]]) -> list[dict]:
    n = min(len(c) for c in curves)
    return [
        dict(step=curves[0][i]["step"], val_loss=statistics.fmean(c[i]["val_loss"] for c in curves))
        for i in range(n)
    ]


def goals(summary: dict[str, Any], chosen: list[tasks.Task]) -> dict[str, Any]:
    """(a) Gefen's bytes/param at or below every peer that keeps a first moment, per task;
    (b) Gefen 8-bit within 1 % of AdamW's val loss, 4-bit within 2 % (classification: 0.5
    accuracy points), and not significantly worse (paired one-sided t-test, 5 %)."""
    a, b = [], []
    for task in chosen:
        cells = summary[task.name]
        for g in GEFEN:
            if cells.get(g, {}).get("status") not in ("ok", "partial"):
                a.append(dict(task=task.name, gefen=g, ok=False, note="Gefen did not run"))
                b.append(dict(task=task.name, gefen=g, ok=False, note="Gefen did not run"))
                continue
            mine = cells[g]["bytes_per_param"]
            rivals = [  # AdamW keeps 8 bytes/param: being below it is no evidence
                o
                for o, c in cells.items()
                if o not in GEFEN
                and o != "adamw"
                and peers.PEERS[o].momentum
                and "bytes_per_param" in c
            ]
            if not rivals:  # nothing to be at or below: not evidence for the goal
                a.append(
                    dict(
                        task=task.name,
                        gefen=g,
                        ok=False,
                        note="no low-memory peer with a first moment ran: not evaluated",
                    )
                )
            above = {
                o: c["bytes_per_param"]
                for o, c in cells.items()
                if o not in GEFEN
                and peers.PEERS[o].momentum
                and "bytes_per_param" in c
                and c["bytes_per_param"] < mine
            }
            if rivals:
                a.append(
                    dict(task=task.name, gefen=g, ok=not above, bytes_per_param=mine, below=above)
                )
            tol_loss, tol_acc = GEFEN[g]
            metric = "val_acc" if task.kind == "cls" else "val_loss"
            c = cells[g].get(metric, {})
            if "diff" not in c:
                b.append(dict(task=task.name, gefen=g, ok=False, note="no paired AdamW runs"))
                continue
            if metric == "val_acc":
                close = c["diff"] >= -tol_acc
                worse_t = -(c["t"] or 0.0)
            else:
                close = c["rel"] <= tol_loss
                worse_t = c["t"] or 0.0
            crit = _t_crit(c["n_paired"] - 1) if c["n_paired"] > 1 else None
            signif = crit is not None and worse_t > crit
            b.append(
                dict(
                    task=task.name,
                    gefen=g,
                    metric=metric,
                    ok=close and not signif,
                    within_tolerance=close,
                    significantly_worse=signif,
                    diff=c["diff"],
                    rel=c["rel"],
                    t=c["t"],
                    t_crit=crit,
                )
            )
    return dict(a=a, b=b, a_met=all(x["ok"] for x in a), b_met=all(x["ok"] for x in b))


# -- writing ----------------------------------------------------------------------------------
def markdown(
    summary: dict,
    g: dict,
    chosen: list[tasks.Task],
    optimizers: list[str],
    rev: dict,
    ignored: dict,
    cmd: str,
    wall: str,
    jobs: int = 2,
) -> str:
    L = ["# Gefen against its peers: quality, state and step time", ""]
    L += render.header(cmd, rev, ignored, wall, jobs)
    L += [
        "Every optimizer of a task: same init, same data order and the same warmup + cosine "
        "schedule for each seed; the AdamW-like methods (Gefen, bitsandbytes, torchao, "
        "Adam-mini) get exactly AdamW's lr, betas and weight decay. Metric: final validation "
        "loss (nats; bytes for the LMs) and, for classification, accuracy. Δ is the mean "
        "paired (same-seed) difference to AdamW; σ is AdamW's seed standard deviation; t the "
        "paired t statistic. Bytes/param: every storage reachable from the optimizer state "
        "(quantised tensors unpacked, shared maps once, step counters included) / trainable "
        "parameters.",
        "",
    ]
    scaled = [
        f"{p.label} lr × {p.lr_scale:g}"
        for p in peers.PEERS.values()
        if p.name in optimizers and p.lr_scale != 1.0
    ]
    if scaled:
        L += [
            "Peers whose lr means something else run with a scaled lr: "
            + "; ".join(scaled)
            + f" ({peers.LR_SCALE_NOTE})",
            "",
        ]
    L += ["## Goals", ""]
    L += _goal_lines(g)
    L += ["", "![validation loss](loss_curves.png)", ""]
    for task in chosen:
        params = summary[task.name].get("adamw", {}).get("params", "?")
        L += [f"## {task.name}: {task.label}", "", render.task_line(task, params), ""]
        cls = task.kind == "cls"
        head = "| optimizer | val loss | Δ loss vs AdamW |"
        if cls:
            head += " val acc % | Δ acc vs AdamW |"
        head += " bytes/param | step ms | seeds |"
        L += render.table(head)
        for opt in optimizers:
            c = summary[task.name][opt]
            if c["status"] not in ("ok", "partial"):
                L.append(render.row([c["label"], f"skipped: {c['reason'][:150]}"]))
                continue
            cells = [c["label"], pm(c["val_loss"], ".4f"), diff(c["val_loss"], True)]
            if cls:
                cells += [pm(c.get("val_acc"), ".1f", 100), diff(c.get("val_acc"), False, 100)]
            cells += [f"{c['bytes_per_param']:.3f}", f"{c['step_ms']:.1f}", str(len(c["seeds"]))]
            L.append(render.row(cells))
            if c["status"] == "partial":
                L.append(f"| ↳ {c['reason'][:150]} |")
        L += [""] + _fallback_lines(summary[task.name], task, g) + [""]
    L += [
        "## State and step time",
        "",
        "![state bytes per parameter](state_bytes.png)",
        "",
        "![median step time](step_time.png)",
        "",
    ]
    return "\n".join(L)


def _goal_lines(g: dict) -> list[str]:
    unseen = all("not evaluated" in x.get("note", "") for x in g["a"])
    if g["a_met"]:
        verdict = "MET"
    elif unseen:
        verdict = "NOT EVALUATED (no peer with a first moment ran)"
    else:
        verdict = "MISSED"
    L = [
        f"**(a) Gefen's state at or below every peer that keeps a first moment, on every task: "
        f"{verdict}.**",
        "",
    ]
    for x in g["a"]:
        if not x["ok"]:
            if "note" in x:
                L.append(f"- {x['task']}, {x['gefen']}: {x['note']}")
                continue
            peers_ = ", ".join(f"{peers.PEERS[o].label} {v:.3f}" for o, v in x["below"].items())
            L.append(
                f"- missed on {x['task']}: {x['gefen']} {x['bytes_per_param']:.3f} "
                f"bytes/param, above {peers_}"
            )
    L += [
        "",
        f"**(b) Gefen 8-bit within 1 % of AdamW's val loss, 4-bit within 2 % "
        f"(classification: 0.5 accuracy points), not significantly worse: "
        f"{'MET' if g['b_met'] else 'MISSED'}.**",
        "",
    ]
    for x in g["b"]:
        if "note" in x:
            L.append(f"- {x['task']}, {x['gefen']}: MISSED ({x['note']})")
            continue
        L.append(f"- {x['task']}, {x['gefen']}: {render.goal_verdict(x)}")
    return L


def _fallback_lines(cells: dict, task: tasks.Task, g: dict) -> list[str]:
    """Which tensors Gefen kept at B = 1 (per-element bf16 m and v, 4 bytes/param): the reason its
    bytes/param can exceed a peer's."""
    L = []
    missed = {x["gefen"] for x in g["a"] if x["task"] == task.name and not x["ok"]}
    for name in GEFEN:
        c = cells.get(name, {})
        if "tensors" not in c:
            continue
        fb = [t for t in c["tensors"] if t["fallback_numel"]]
        share = c["fallback_numel"] / max(1, c["params"])
        L.append(
            f"{c['label']}: {c['fallback_numel']} of {c['params']} parameters "
            f"({share:.1%}) at B = 1 in {len(fb)} tensors"
            + (" — above a momentum peer; those tensors:" if name in missed else ".")
        )
        if name in missed:
            L += ["", *render.table("| tensor | shape | numel | block sizes | state bytes |")]
            L += [
                f"| {t['name'].split(chr(39))[1] if chr(39) in t['name'] else t['name']} | "
                f"{tuple(t['shape'])} | {t['numel']} | "
                f"{','.join(map(str, t['block_sizes']))} | {t['state_bytes']} |"
                for t in fb
            ]
            L.append("")
    return L


# -- figures ----------------------------------------------------------------------------------
def figures(out: Path, summary: dict, chosen: list[tasks.Task], optimizers: list[str]) -> None:
    """loss_curves.png (a panel per task), state_bytes.png and step_time.png (a bar per
    optimizer, a panel per task)."""
    p = render.panels(len(chosen), 3.6, 2.7)
    for ax, task in zip(p.axes, chosen, strict=False):
        cells = summary[task.name]
        tail = []
        for opt in optimizers:
            c = cells.get(opt, {})
            if "curve" not in c:
                continue
            xs = [p["step"] for p in c["curve"]]
            ys = [p["val_loss"] for p in c["curve"]]
            lw = 1.8 if opt in GEFEN or opt == "adamw" else 1.0
            ax.plot(
                xs,
                ys,
                color=render.COLORS.get(opt),
                lw=lw,
                label=c["label"],
                zorder=3 if opt in GEFEN or opt == "adamw" else 2,
            )
            tail += [y for x, y in zip(xs, ys, strict=True) if x >= 0.3 * xs[-1]]
        if tail:  # zoom on the part of the run where optimizers differ
            lo, hi = min(tail), sorted(tail)[int(0.9 * (len(tail) - 1))]
            pad = 0.08 * (hi - lo or 1.0)
            ax.set_ylim(lo - pad, hi + pad)
        ax.set_title(task.name, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("val loss")
        ax.grid(alpha=0.3)
    title = "Validation loss (mean over seeds; y zoomed on the last 70 % of training)"
    render.save_panels(p, title, out / "loss_curves.png")

    plt, n = p.plt, len(chosen)
    for key, fname, xlabel in (
        ("bytes_per_param", "state_bytes.png", "optimizer state, bytes per parameter (AdamW = 8)"),
        ("step_ms", "step_time.png", "median step time, ms (1 thread)"),
    ):
        fig, axes = plt.subplots(
            1, n, figsize=(2.5 * n + 1.4, 0.28 * len(optimizers) + 1.0), squeeze=False, sharey=True
        )
        for j, (ax, task) in enumerate(zip(axes.flat, chosen, strict=True)):
            cells = summary[task.name]
            ys = list(range(len(optimizers)))[::-1]
            vals = [cells.get(o, {}).get(key, 0.0) or 0.0 for o in optimizers]
            ax.barh(ys, vals, color=[render.COLORS.get(o) for o in optimizers], height=0.7)
            for y, v, o in zip(ys, vals, optimizers, strict=True):
                txt = f"{v:.2f}" if key == "bytes_per_param" else f"{v:.0f}"
                if cells.get(o, {}).get(key) is None:
                    txt = "skipped"
                ax.text(v, y, " " + txt, va="center", fontsize=7)
            ax.set_title(task.name, fontsize=9)
            ax.set_xlim(0, max(vals + [1e-9]) * 1.35)
            if j == 0:
                ax.set_yticks(ys, [peers.PEERS[o].label.split(" (")[0] for o in optimizers])
            ax.tick_params(axis="x", labelsize=7)
        fig.supxlabel(xlabel, fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=90)
        plt.close(fig)


def write(
    out: Path,
    rows: list[dict],
    chosen: list[tasks.Task],
    optimizers: list[str],
    rev: dict,
    ignored: dict,
    cmd: str,
    wall: str = "",
    jobs: int = 2,
) -> Path:
    summary = summarize(rows, chosen, optimizers)
    g = goals(summary, chosen)
    figures(out, summary, chosen, optimizers)
    (out / "results.json").write_text(
        json.dumps(
            dict(
                command=cmd,
                revision=rev,
                ignored_other_revisions=ignored,
                tasks={t.name: t.settings() for t in chosen},
                lr_scale={o: peers.PEERS[o].lr_scale for o in optimizers},
                summary=summary,
                goals=g,
            ),
            indent=1,
        )
    )
    path = out / "report.md"
    path.write_text(markdown(summary, g, chosen, optimizers, rev, ignored, cmd, wall, jobs))
    return path
