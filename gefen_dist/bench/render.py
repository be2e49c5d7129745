"""What the comparison's two reports share in how they look: the header, the cells and rows of
their markdown tables, a goal's verdict, the palette, and the grid of panels their figures draw in.

Why one module: the fixed-lr report (``report``: report.md, loss_curves.png) and the lr sweep's
(``sweep_report``: lr_sweep.md, lr_sweep.png) show the same things (a mean ± sd, a paired Δ
with σ and t, a goal met or missed, one panel per task with the legend in a spare panel), and
written twice they drift apart. Nothing here computes a statistic: the callers pass what
``report.summarize`` / ``report.goals`` and ``sweep.analyse`` computed, so a report regenerates
byte for byte from its results.json or lr_sweep.json.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gefen_dist.bench import store, tasks

COLORS = {
    "adamw": "#111111",
    "gefen8": "#d62728",
    "gefen4": "#ff7f0e",
    "gefen4_bf16": "#bcbd22",
    "gefen4_bf16_sr": "#e377c2",
    "bnb_adamw8bit": "#1f77b4",
    "torchao_adamw8bit": "#17becf",
    "torchao_adamw4bit": "#9edae5",
    "adam_mini": "#2ca02c",
    "adafactor": "#9467bd",
    "sm3": "#8c564b",
}
"""One colour per optimizer, the same in every figure of both reports."""


# -- markdown ---------------------------------------------------------------------------------
def header(cmd: str, rev: dict, ignored: dict, wall: str, jobs: int = 2) -> list[str]:
    """Command, machine and revision lines: what a reader needs to reproduce a report or to see
    that two reports are not comparable."""
    return [
        f"Command: `{cmd}`  ",
        f"Machine: {platform.machine()} ({store.cpu_model()}), {_cores()} cores, torch "
        f"{_torch()}, Python "
        f"{platform.python_version()}, one torch thread per run, at most {jobs} runs at once.  ",
        f"Code revision (last commit touching `gefen_dist/` or `csrc/`): `{rev['code']}`, HEAD "
        f"`{rev['head']}`. Only records of this revision and these settings are used"
        + (
            f"; ignored {sum(ignored.values())} stored record(s) of other revisions "
            f"({', '.join(ignored)})."
            if ignored
            else "."
        )
        + "  ",
        f"Written {time.strftime('%Y-%m-%d %H:%M')}. {wall}",
        "",
    ]


def task_line(task: tasks.Task, params: Any, lr: str = "lr") -> str:
    """A task's size and schedule, under its heading (``lr``: what its lr is called there)."""
    h = task.hyper
    return (
        f"{params} parameters; {h.steps} steps, {lr} {h.lr:g}, betas {h.betas}, weight decay "
        f"{h.weight_decay:g}, warmup {h.warmup_frac:.0%}, cosine to {h.min_lr_frac:.0%}, clip "
        f"{h.grad_clip:g}; sizes {json.dumps(task.sizes)}"
    )


def table(head: str) -> list[str]:
    """A table's head row and the rule under it, as many columns as ``head`` has."""
    return [head, "|" + "---|" * (head.count("|") - 1)]


def row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def pm(c: dict | None, fmt: str, scale: float = 1.0) -> str:
    """A metric's mean ± seed sd (the sd left out with one seed)."""
    if not c:
        return ""
    sd = c["std"]
    s = f"{c['mean'] * scale:{fmt}}"
    return s + (f" ± {sd * scale:{fmt}}" if sd == sd else "")


def diff(c: dict | None, pct: bool, scale: float = 1.0) -> str:
    """A metric's paired difference to AdamW: relative (``pct``) or in points, with σ and t."""
    if not c or "diff" not in c:
        return "" if not c else "—"
    s = f"{100 * c['rel']:+.2f} %" if pct else f"{c['diff'] * scale:+.2f} pt"
    z = f"{c['diff_sd']:+.1f} σ" if c.get("diff_sd") is not None else "n/a"
    t = f"t {c['t']:+.1f}" if c.get("t") is not None else ""
    return f"{s} ({z}{', ' + t if t else ''})"


def goal_verdict(x: dict, tol: float | None = None) -> str:
    """One Gefen's goal (b) row as a line's end: its Δ, then met or MISSED and why; with
    ``tol``, the allowance after the Δ."""
    loss = x["metric"] == "val_loss"
    what = (
        f"{100 * x['rel']:+.2f} % val loss" if loss else f"{100 * x['diff']:+.2f} accuracy points"
    )
    if tol is not None:
        what += f" (allowed +{100 * tol:g} %)" if loss else f" (allowed -{100 * tol:g})"
    why = []
    if not x["within_tolerance"]:
        why.append("outside the tolerance")
    if x["significantly_worse"]:
        why.append(f"significantly worse (t {x['t']:+.1f} > {x['t_crit']:.2f})")
    return f"{what}: " + ("met" if x["ok"] else "MISSED, " + " and ".join(why))


def _cores() -> int:
    return os.cpu_count() or 0


def _torch() -> str:
    import torch

    return torch.__version__


# -- figures ----------------------------------------------------------------------------------
def pyplot() -> Any:
    """matplotlib's pyplot, off-screen, in the reports' style (imported here, not at the top:
    matplotlib is the ``bench`` extra's, and only writing a report needs it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "axes.spines.top": False, "axes.spines.right": False})
    return plt


@dataclass
class Panels:
    """One panel per task, at most three a row; ``axes`` in reading order."""

    plt: Any
    fig: Any
    axes: list[Any]
    n: int


def panels(n: int, width: float, height: float) -> Panels:
    """A figure of ``n`` panels of ``width`` x ``height`` inches each."""
    plt = pyplot()
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    return Panels(plt, fig, list(axes.flat), n)


def save_panels(p: Panels, title: str, path: Path) -> Path:
    """Blank the panels no task used, put the legend in the last of them (or beside the panels
    where none is spare), title the figure and write it to ``path``."""
    for ax in p.axes[p.n :]:
        ax.axis("off")
    handles, labels = p.axes[0].get_legend_handles_labels()
    if p.n < len(p.axes):
        p.axes[-1].legend(handles, labels, loc="center", frameon=False)
    else:  # no spare panel: the legend goes beside the panels
        p.fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    p.fig.suptitle(title, fontsize=9)
    p.fig.tight_layout()
    p.fig.savefig(path, dpi=90, bbox_inches="tight")
    p.plt.close(p.fig)
    return path
