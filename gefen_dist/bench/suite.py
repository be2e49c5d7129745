"""``python -m gefen_dist.bench compare``: every optimizer on every task, same init, data order
and schedule, one subprocess per run, results kept in a resumable store, then the report.
With ``--lr-sweep`` each optimizer runs on an lr grid instead and is compared at its own best
lr, and Gefen at AdamW's best (gefen_dist.bench.sweep).

Why a subprocess per run: one run's leftovers (numba's and torch.compile's caches, torchao's
compiled graphs, allocator state, a crash) cannot change another's timing or outcome, and a
peer that segfaults costs only its own row. At most ``--jobs`` (default 2, one per core) run
at once, each with one torch thread, so step times are comparable within a report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from gefen_dist.bench import peers, store, tasks

SMOKE_OPTIMIZERS = ["adamw", "gefen8", "gefen4", "bnb_adamw8bit"]
"""The smoke run: AdamW, both Gefens and one peer; torchao compiles for ~10 s per process."""


def run_one(task: tasks.Task, optimizer: str, seed: int) -> dict[str, Any]:
    """Train ``optimizer`` on ``task`` for one seed, in this process. Returns the record body
    (status 'ok', or 'skipped' with the reason when the peer is unavailable)."""
    import torch

    torch.set_num_threads(1)
    h = task.hyper
    inst = tasks.build(task, seed)
    model = inst.model
    try:
        opt = peers.build(
            optimizer, model, h.lr, betas=h.betas, weight_decay=h.weight_decay, **inst.model_info
        )
    except peers.Unavailable as e:
        return dict(status="skipped", reason=str(e))
    eval_at = {max(1, round(h.steps * (i + 1) / h.evals)) for i in range(h.evals)}
    curve = [dict(step=0, **inst.evaluate(model))]
    step_ms: list[float] = []
    window: list[float] = []
    for step in range(1, h.steps + 1):
        peers.set_lr(opt, tasks.lr_factor(step - 1, h))
        t0 = time.perf_counter()
        loss = inst.loss(model, next(inst.batches))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), h.grad_clip)
        opt.step()
        window.append(loss.item())
        step_ms.append(1000 * (time.perf_counter() - t0))
        if not all(map(_finite, window[-1:])):
            return dict(
                status="failed", reason=f"loss became {window[-1]} at step {step}", curve=curve
            )
        if step in eval_at:
            curve.append(
                dict(step=step, train_loss=sum(window) / len(window), **inst.evaluate(model))
            )
            window = []
    n = peers.trainable_numel(model)
    sb = peers.state_bytes(opt)
    rec: dict[str, Any] = dict(
        status="ok",
        curve=curve,
        final=dict(curve[-1]),
        state_bytes=sb,
        params=n,
        bytes_per_param=sb / n,
        step_ms_median=statistics.median(step_ms[1:] or step_ms),
        step_ms_first=step_ms[0],
    )
    if hasattr(opt, "memory_report"):
        rep = opt.memory_report()
        rec["gefen"] = dict(
            bytes_per_param=rep["bytes_per_param"],
            fallback_numel=rep["fallback_numel"],
            backend=rep["backend"],
            tensors=[
                dict(
                    name=t["name"],
                    shape=list(t["shape"]),
                    numel=t["numel"],
                    block_sizes=t["block_sizes"],
                    fallback_numel=t["fallback_numel"],
                    state_bytes=t["state_bytes"],
                )
                for t in rep["tensors"]
            ],
        )
    return rec


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _worker(argv: list[str]) -> None:
    """Subprocess entry: read the job, run it, write the record body as JSON."""
    job_path, out_path = argv
    job = json.loads(Path(job_path).read_text())
    task = tasks.Task(**{**job["task"], "hyper": tasks.Hyper(**job["task"]["hyper"])})
    try:
        body = run_one(task, job["optimizer"], job["seed"])
    except Exception as e:  # the report lists a crashing peer with its reason
        body = dict(
            status="failed",
            reason=f"{type(e).__name__}: {e}",
            traceback=traceback.format_exc()[-3000:],
        )
    Path(out_path).write_text(json.dumps(body))


def _spawn(task: tasks.Task, optimizer: str, seed: int, timeout: float) -> dict[str, Any]:
    job = dict(
        task=dict(
            name=task.name,
            label=task.label,
            kind=task.kind,
            hyper=_asdict(task.hyper),
            sizes=task.sizes,
        ),
        optimizer=optimizer,
        seed=seed,
    )
    with tempfile.TemporaryDirectory(prefix="gefen_bench_") as d:
        jp, op = Path(d, "job.json"), Path(d, "out.json")
        jp.write_text(json.dumps(job))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        try:
            p = subprocess.run(
                [sys.executable, "-m", "gefen_dist.bench.suite", "--worker", str(jp), str(op)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return dict(status="failed", reason=f"timed out after {timeout:.0f} s")
        if op.exists():
            return json.loads(op.read_text())
        return dict(
            status="failed",
            reason=f"worker exited {p.returncode}: "
            + (p.stderr.strip().splitlines() or ["no output"])[-1][-300:],
        )


def _asdict(h: tasks.Hyper) -> dict:
    from dataclasses import asdict

    return asdict(h)


def settings_of(task: tasks.Task, optimizer: str) -> dict[str, Any]:
    """What a stored record must match to be reused: the task's sizes and hyperparameters and
    the peer's lr scale."""
    return dict(task.settings(), lr_scale=peers.PEERS[optimizer].lr_scale)


def compare(
    out: Path,
    task_names: list[str],
    optimizers: list[str],
    seeds: list[int],
    scale: float = 1.0,
    jobs: int = 2,
    store_path: Path | None = None,
    timeout: float = 900.0,
    quiet: bool = False,
    cmd: str = "",
    smoke: bool = False,
) -> Path:
    """Run every missing (task, optimizer, seed), append each to the store as it finishes,
    then write the report into ``out``. Returns the report path."""
    from gefen_dist.bench import report

    out.mkdir(parents=True, exist_ok=True)
    st = store.Store(store_path or out / "runs.jsonl")
    rev = store.revision()
    todo = []
    chosen = [tasks.scaled(tasks.TASKS[t], scale, smoke) for t in task_names]
    for task in chosen:
        for opt in optimizers:
            for seed in seeds:
                key = store.key(task.name, opt, seed, settings_of(task, opt), rev)
                if st.get(key) is None:
                    todo.append((task, opt, seed, key))
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    say(
        f"revision {rev['code']}: {len(todo)} runs to do, "
        f"{len(chosen) * len(optimizers) * len(seeds) - len(todo)} reused from {st.path}"
    )
    t_start = time.time()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futs = {pool.submit(_spawn, t, o, s, timeout): (t, o, s, k) for t, o, s, k in todo}
        for i, fut in enumerate(as_completed(futs), 1):
            task, opt, seed, key = futs[fut]
            body = fut.result()
            st.add(store.record(key, task.name, opt, seed, settings_of(task, opt), rev, body))
            fin = body.get("final", {})
            say(
                f"[{i}/{len(todo)} {time.time() - t_start:6.0f}s] {task.name:7s} {opt:18s} "
                f"seed {seed}: {body['status']} "
                + (
                    f"val_loss {fin['val_loss']:.4f} {body['bytes_per_param']:.2f} B/param "
                    f"{body['step_ms_median']:.1f} ms"
                    if body["status"] == "ok"
                    else body.get("reason", "")[:160]
                )
            )
    rows = [
        st.get(store.key(t.name, o, s, settings_of(t, o), rev))
        for t in chosen
        for o in optimizers
        for s in seeds
    ]
    ignored = st.other_revisions(rev)
    wall = (
        f"This invocation ran {len(todo)} run(s) in {time.time() - t_start:.0f} s"
        f" and reused {len(rows) - len(todo)}."
    )
    return report.write(
        out, [r for r in rows if r], chosen, optimizers, rev, ignored, cmd, wall, jobs
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gefen_dist.bench import sweep  # here, not at the top: sweep builds on this module

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
    p.add_argument("--tasks", default=",".join(tasks.TASKS))
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
    p = argparse.ArgumentParser(prog="python -m gefen_dist.bench compare", description=__doc__)
    add_arguments(p)
    a = p.parse_args(argv)
    opts = a.optimizers.split(",") if a.optimizers else list(peers.PEERS)
    scale = a.scale
    if a.smoke:
        scale = min(scale, 0.03)
        opts = [o for o in opts if o in SMOKE_OPTIMIZERS] if not a.optimizers else opts
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
    path = compare(
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
    from gefen_dist.bench import sweep

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


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2:])
    else:
        main(sys.argv[1:])
