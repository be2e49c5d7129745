"""Paired-seed study: validation loss of Gefen variants relative to AdamW on the stdlib GPT.

Every (config, seed) is its own `python -m gefen_dist.demo.train` subprocess with one thread, so
runs neither share state nor fight over cores. Results go to a JSON-lines store, one record
per run; a run already stored for the same config, seed and git revision is skipped, so an
interrupted study resumes where it stopped. The summary pairs each Gefen run with the AdamW
run of the same seed (same init, same batches), which removes most of the seed-to-seed noise.

    python launch/sharing_study.py --steps 1000 --seeds 3 --jobs 2
    python launch/sharing_study.py --variants '{"gefen4": {"bits": 4}}' --summary-only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VARIANTS = {"gefen8": {"bits": 8}, "gefen4": {"bits": 4}}


def git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (rev or "unknown") + ("-dirty" if dirty else "")


def study_configs(variants: dict, steps: int, extra: dict) -> dict[str, dict]:
    """Name -> the train config each seed of it runs with (seed added per run)."""
    base = {**extra, "steps": steps}
    configs = {"adamw": {**base, "optimizer": "adamw", "gefen_kwargs": {}}}
    for name, kwargs in variants.items():
        configs[name] = {**base, "optimizer": "gefen", "gefen_kwargs": kwargs}
    return configs


def run_key(config: dict, seed: int, revision: str) -> str:
    return json.dumps([config, seed, revision], sort_keys=True)


def load_store(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def cli_args(config: dict, seed: int, json_path: str) -> list[str]:
    """Turn a train config dict into `python -m gefen_dist.demo.train` flags."""
    args = ["--seed", str(seed), "--threads", "1", "--quiet", "--json", json_path]
    for k, v in config.items():
        if k == "gefen_kwargs":
            v = json.dumps(v)
        elif isinstance(v, list | tuple):
            v = ",".join(str(x) for x in v)
        args += ["--" + k.replace("_", "-"), str(v)]
    return args


def run_one(name: str, config: dict, seed: int) -> dict | None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "gefen_dist.demo.train", *cli_args(config, seed, out)]
        t0 = time.time()
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if p.returncode != 0 or not os.path.exists(out):
            print(
                f"FAILED {name} seed {seed} (rc {p.returncode}):\n{p.stderr[-2000:]}",
                file=sys.stderr,
                flush=True,
            )
            return None
        with open(out) as f:
            result = json.load(f)
    print(
        f"done {name} seed {seed}: val {result['final_val_loss']:.4f} ({time.time() - t0:.0f} s)",
        flush=True,
    )
    return result


def run_study(configs: dict, seeds: int, jobs: int, store: Path, revision: str) -> None:
    done = {r["key"] for r in load_store(store)}
    # seed-major order, so an interrupted study already has complete pairs
    todo = [
        (name, cfg, seed)
        for seed in range(seeds)
        for name, cfg in configs.items()
        if run_key(cfg, seed, revision) not in done
    ]
    print(
        f"{len(todo)} runs to do ({len(configs) * seeds - len(todo)} already in {store}), "
        f"{jobs} at a time, revision {revision}",
        flush=True,
    )
    store.parent.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def work(item: tuple[str, dict, int]) -> None:
        name, cfg, seed = item
        result = run_one(name, cfg, seed)
        if result is None:
            return
        record = dict(
            key=run_key(cfg, seed, revision),
            name=name,
            seed=seed,
            revision=revision,
            request=cfg,
            config=result["config"],
            result=result,
        )
        with lock, open(store, "a") as f:
            f.write(json.dumps(record) + "\n")

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(work, todo))


def summarize(configs: dict, seeds: int, store: Path, revision: str) -> str:
    """Markdown table; the relative difference is paired by seed against AdamW."""
    by_key = {r["key"]: r["result"] for r in load_store(store)}
    runs = {
        name: {s: by_key[k] for s in range(seeds) if (k := run_key(cfg, s, revision)) in by_key}
        for name, cfg in configs.items()
    }
    ref = runs["adamw"]
    lines = [
        f"revision {revision}, steps {configs['adamw']['steps']}, seeds 0..{seeds - 1}",
        "",
        "| config | seeds | val loss (mean) | vs AdamW, paired (mean ± std) | bytes/param "
        "| state MiB | s/run |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        if not rs:
            lines.append(f"| {name} | 0 | | | | | |")
            continue
        vals = [r["final_val_loss"] for r in rs.values()]
        rel = [
            100 * (r["final_val_loss"] - ref[s]["final_val_loss"]) / ref[s]["final_val_loss"]
            for s, r in rs.items()
            if s in ref
        ]
        if rel:
            sd = statistics.stdev(rel) if len(rel) > 1 else float("nan")
            paired = f"{statistics.mean(rel):+.2f} % ± {sd:.2f} (n={len(rel)})"
        else:
            paired = "no AdamW pair"
        # Gefen picks its block sizes from the gradients, so memory can vary with the seed
        bpp = statistics.mean(r["bytes_per_param"] for r in rs.values())
        mib = statistics.mean(r["state_bytes"] for r in rs.values()) / 2**20
        wall = statistics.mean(r["wall_time_s"] for r in rs.values())
        lines.append(
            f"| {name} | {len(rs)} | {statistics.mean(vals):.4f} | {paired} "
            f"| {bpp:.2f} | {mib:.2f} | {wall:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (1 thread each)")
    p.add_argument("--store", type=Path, default=Path("runs/sharing_study.jsonl"))
    p.add_argument(
        "--variants",
        type=json.loads,
        default=DEFAULT_VARIANTS,
        help="JSON dict: name -> Gefen kwargs",
    )
    p.add_argument(
        "--extra",
        type=json.loads,
        default={},
        help='JSON dict of further train options for every run, e.g. {"batch_size": 8}',
    )
    p.add_argument(
        "--revision",
        default=None,
        help="summarize the runs of this revision (default: the current one)",
    )
    p.add_argument("--summary-only", action="store_true")
    args = p.parse_args(argv)

    configs = study_configs(args.variants, args.steps, args.extra)
    revision = args.revision or git_revision()
    if not args.summary_only:
        run_study(configs, args.seeds, args.jobs, args.store, revision)
    summary = summarize(configs, args.seeds, args.store, revision)
    print(summary)
    md = args.store.with_suffix(".md")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(f"# Gefen vs AdamW, paired seeds\n\n{summary}\n")
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
