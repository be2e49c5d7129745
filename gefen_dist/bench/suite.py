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
from gefen_dist.demo import loop

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

    def step(s: int) -> float:
        peers.set_lr(opt, tasks.lr_factor(s - 1, h))
        return loop.plain_step(
            model, opt, lambda: inst.loss(model, next(inst.batches)), h.grad_clip
        )

    trace = loop.train(
        step, h.steps, lambda: inst.evaluate(model), eval_at.__contains__, stop_on_nonfinite=True
    )
    curve, step_ms = trace.curve, trace.step_ms
    if trace.failed:
        return dict(status="failed", reason=trace.failed, curve=curve)
    n = peers.trainable_numel(model)
    sb = peers.state_bytes(opt)
    wb, gb = peers.weight_bytes(model)
    rec: dict[str, Any] = dict(
        status="ok",
        curve=curve,
        final=dict(curve[-1]),
        state_bytes=sb,
        params=n,
        bytes_per_param=sb / n,
        weight_bytes_per_param=wb / n,
        grad_bytes_per_param=gb / n,
        training_bytes_per_param=(sb + wb + gb) / n,
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


if __name__ == "__main__":  # the suite's own subprocess; users run `python -m gefen_dist.bench`
    if sys.argv[1:2] != ["--worker"]:
        raise SystemExit("usage: python -m gefen_dist.bench compare [options]")
    _worker(sys.argv[2:])
