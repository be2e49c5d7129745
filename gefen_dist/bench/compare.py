"""``python -m gefen_dist.bench compare``: the quality suite's command line.

Why apart from ``suite``: the lr sweep (``sweep``) builds on the suite's runs, and the command
line offers both, so it sits above the two and neither imports the other's caller.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gefen_dist.bench import peers, suite, sweep, tasks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="report folder (default results/bench; with --lr-sweep results/bench/lr_sweep)",
    )
    p.add_argument(
        "--store",
        type=Path,
        default=None,
        help="JSONL store (default OUT/runs.jsonl); done runs are skipped",
    )
    p.add_argument(
        "--tasks",
        default=",".join(tasks.DEFAULT_TASKS),
        help=f"comma list (default {','.join(tasks.DEFAULT_TASKS)}; also known: "
        f"{','.join(t for t in tasks.TASKS if t not in tasks.DEFAULT_TASKS)})",
    )
    p.add_argument("--optimizers", default=None, help="comma list (default: all peers)")
    p.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="seeds per optimizer (default 3); with --lr-sweep: the paired seeds at each "
        "optimizer's best lr and at AdamW's best lr",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs at once (one per core)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every task's steps")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="1 seed, 3 %% of the steps, 4 optimizers: an end-to-end check (<2 min); with "
        "--lr-sweep 2 paired seeds unless --seeds says otherwise",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    g = p.add_argument_group(
        "lr sweep",
        "every optimizer at its own best lr, and Gefen at AdamW's (gefen_dist.bench.sweep)",
    )
    g.add_argument(
        "--lr-sweep",
        action="store_true",
        help="sweep the lr per task instead of one fixed lr; writes lr_sweep.md, .json, .png",
    )
    g.add_argument(
        "--lr-factors",
        default=None,
        help="grid, as multiples of each task's lr (peers with an lr scale keep it on top); "
        f"at least {sweep.MIN_POINTS} factors about 3 apart (default {sweep.DEFAULT_FACTORS})",
    )
    g.add_argument(
        "--sweep-seeds",
        type=int,
        default=None,
        help="seeds per grid point, from which each optimizer's best lr is chosen (default 1)",
    )
    g.add_argument(
        "--extend-grid",
        type=int,
        nargs="?",
        const=1,
        default=None,
        metavar="N",
        help="where AdamW's (or a Gefen's) best lr is at an end of a task's grid, add one "
        "factor on that side, up to N times (N default 1; without the flag the report only "
        "warns)",
    )
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="print how many runs the sweep would start, and exit",
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m gefen_dist.bench compare", description=suite.__doc__
    )
    add_arguments(p)
    a = p.parse_args(argv)
    opts = a.optimizers.split(",") if a.optimizers else list(peers.DEFAULT)
    scale = a.scale
    if a.smoke:
        scale = min(scale, 0.03)
        opts = [o for o in opts if o in suite.SMOKE_OPTIMIZERS] if not a.optimizers else opts
    unknown = [o for o in opts if o not in peers.PEERS]
    if unknown:
        p.error(f"unknown optimizers {unknown}; known: {', '.join(peers.PEERS)}")
    names = a.tasks.split(",")
    bad = [t for t in names if t not in tasks.TASKS]
    if bad:
        p.error(f"unknown tasks {bad}; known: {', '.join(tasks.TASKS)}")
    cmd = "python -m gefen_dist.bench compare " + " ".join(sys.argv[1:] if argv is None else argv)
    if a.lr_sweep:
        _main_sweep(p, a, names, opts, scale, cmd.strip())
        return
    given = [f for f in ("lr_factors", "sweep_seeds", "extend_grid") if getattr(a, f) is not None]
    if given or a.dry_run:
        flags = [f"--{f.replace('_', '-')}" for f in given] + (["--dry-run"] if a.dry_run else [])
        p.error(f"{', '.join(flags)} only with --lr-sweep")
    seeds = 1 if a.smoke else (3 if a.seeds is None else a.seeds)
    path = suite.compare(
        a.out or Path("results/bench"),
        names,
        opts,
        list(range(seeds)),
        scale,
        a.jobs,
        a.store,
        a.timeout,
        cmd=cmd.strip(),
        smoke=a.smoke,
    )
    print(f"report: {path}")


def _main_sweep(
    p: argparse.ArgumentParser,
    a: argparse.Namespace,
    names: list[str],
    opts: list[str],
    scale: float,
    cmd: str,
) -> None:
    try:
        factors = sweep.parse_factors(a.lr_factors or sweep.DEFAULT_FACTORS)
    except ValueError as e:
        p.error(str(e))
    if "adamw" not in opts:
        p.error("--lr-sweep compares against AdamW's best lr: --optimizers must include adamw")
    seeds = a.seeds if a.seeds is not None else (2 if a.smoke else 3)
    sweep_seeds = 1 if a.sweep_seeds is None else a.sweep_seeds
    extend = 0 if a.extend_grid is None else a.extend_grid
    if seeds < 1 or sweep_seeds < 1 or extend < 0:
        p.error("--seeds and --sweep-seeds must be at least 1, --extend-grid at least 0")
    note = sweep.spacing_note(factors)
    if note:
        print(f"warning: --lr-factors: {note}", file=sys.stderr)
    if a.dry_run:
        chosen = [tasks.scaled(tasks.TASKS[t], scale, a.smoke) for t in names]
        n = sweep.plan(chosen, opts, factors, sweep_seeds, seeds)
        print(
            f"{len(chosen)} task(s) x {len(opts)} optimizer(s) x {len(factors)} lr(s) x "
            f"{sweep_seeds} sweep seed(s) = {n['sweep']} sweep runs; then at most "
            f"{n['confirm_at_most']} confirm runs ({seeds} paired seeds); up to "
            f"{n['per_extension']} more per grid extension and side (--extend-grid {extend}); "
            "runs already in the store are not repeated"
        )
        return
    path = sweep.lr_sweep(
        a.out or Path("results/bench/lr_sweep"),
        names,
        opts,
        factors,
        sweep_seeds,
        seeds,
        scale,
        a.jobs,
        a.store,
        a.timeout,
        cmd=cmd,
        smoke=a.smoke,
        extend_grid=extend,
    )
    print(f"report: {path}")
