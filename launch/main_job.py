"""The main job: Gefen against AdamW on 2 ranks under the same sharding, with a report.

    python3 launch/main_job.py            # about 5 minutes on 2 CPU cores
    python3 launch/main_job.py --quick    # under 2 minutes (CI)

Each optimizer trains in its own launch (own processes, so peak RSS is its own) of
``launch/train.py`` with the same config, seed, data order and lr schedule; only
``optimizer.name`` differs. The output folder gets ``report.md``, ``results.json``,
``loss_curves.png`` and ``state_per_rank.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from train import ConfigError, load_config  # noqa: E402

MAIN_JOB: dict = {
    "model": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64},
    "data": {"max_bytes": 4 * 2**20, "batch_size": 8, "val_batches": 10},
    "steps": 300,
    "eval_every": 20,
    "seed": 0,
    "optimizer": {"bits": 4, "lr": 1e-3, "warmup": 30, "grad_clip": 1.0},
    "sharding": {"mode": "fsdp2"},
}
QUICK: dict = {
    "model": {"n_layer": 2},
    "data": {"val_batches": 4},
    "steps": 60,
    "eval_every": 10,
    "optimizer": {"warmup": 6},
}
OPTIMIZERS = ("adamw", "gefen")
MiB = 2**20


def _update(base: dict, new: dict) -> dict:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _update(base[k], v)
        else:
            base[k] = v
    return base


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(mode: str, nproc: int, args: list[str]) -> list[str]:
    """The launcher each sharding mode is meant for, around ``launch/train.py``."""
    script, port = str(HERE / "train.py"), str(_free_port())
    if mode == "deepspeed":
        return ["deepspeed", f"--num_gpus={nproc}", f"--master_port={port}", script, *args]
    if mode == "accelerate":
        exe = shutil.which("accelerate") or "accelerate"
        return [exe, "launch", "--multi_gpu", f"--num_processes={nproc}",
                f"--main_process_port={port}", script, *args]  # fmt: skip
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={port}", script, *args]  # fmt: skip


def run_one(cfg: dict, out_dir: Path, nproc: int, progress: bool) -> dict:
    """Launch one training run in its own processes and return rank 0's results."""
    name = cfg["optimizer"]["name"]
    cfg_path, res_path = out_dir / f"{name}.yaml", out_dir / f"{name}.json"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    args = ["--config", str(cfg_path), "--out", str(res_path)]
    if not progress:
        args.append("--no-progress")
    cmd = launch_command(cfg["sharding"]["mode"], nproc, args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    log = out_dir / f"{name}.log"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=f, text=True)
        for chunk in iter(lambda: p.stdout.read(256), ""):
            sys.stdout.write(chunk)
            sys.stdout.flush()
            f.write(chunk)
    if p.wait() != 0 or not res_path.exists():
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"the {name} run failed (exit {p.returncode}); log {log}:\n{tail}")
    res = json.loads(res_path.read_text())
    res["launch_wall_s"] = time.perf_counter() - t0
    res["command"] = cmd
    return res


def table(results: dict[str, dict]) -> list[list[str]]:
    """Rows of the summary; ratios are against the AdamW run under the same sharding."""
    ref = results["adamw"]
    head = ["optimizer", "rank", "state MiB", "bytes/param", "state vs AdamW", "peak RSS MiB",
            "step ms (median)", "final train", "final val", "val vs AdamW"]  # fmt: skip
    rows = [head]
    for name, r in results.items():
        for rk, ref_rk in zip(r["ranks"], ref["ranks"], strict=True):
            rows.append(
                [
                    name,
                    str(rk["rank"]),
                    f"{rk['state_bytes'] / MiB:.3f}",
                    f"{rk['state_bytes'] / max(1, rk['state_params']):.2f}",
                    f"{rk['state_bytes'] / ref_rk['state_bytes']:.3f}x",
                    f"{rk['peak_rss_bytes'] / MiB:.0f}",
                    f"{1000 * rk['step_time_median_s']:.0f}",
                    f"{r['final_train_loss']:.4f}",
                    f"{r['final_val_loss']:.4f}",
                    f"{100 * (r['final_val_loss'] / ref['final_val_loss'] - 1):+.2f} %",
                ]
            )
    return rows


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def plain(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def plot(results: dict[str, dict], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"adamw": "tab:blue", "gefen": "tab:orange"}
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, r in results.items():
        c = [p for p in r["curve"] if p["train_loss"] is not None]
        ax.plot([p["step"] for p in c], [p["train_loss"] for p in c], "--", color=colors[name],
                alpha=0.7, label=f"{name} train")  # fmt: skip
        v = r["curve"]
        ax.plot([p["step"] for p in v], [p["val_loss"] for p in v], "-o", ms=3,
                color=colors[name], label=f"{name} val")  # fmt: skip
    cfg = results["gefen"]["config"]
    ax.set(xlabel="step", ylabel="loss (nats/byte)",
           title=f"Gefen {cfg['optimizer']['bits']}-bit vs AdamW, {cfg['sharding']['mode']},"
           f" {results['gefen']['world_size']} ranks")  # fmt: skip
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "loss_curves.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ranks = [rk["rank"] for rk in results["adamw"]["ranks"]]
    width = 0.38
    for i, (name, r) in enumerate(results.items()):
        vals = [rk["state_bytes"] / MiB for rk in r["ranks"]]
        per = [rk["state_bytes"] / max(1, rk["state_params"]) for rk in r["ranks"]]
        xs = [x + (i - 0.5) * width for x in ranks]
        bars = ax.bar(xs, vals, width, color=colors[name], label=name)
        labels = [f"{v:.2f} MiB\n{b:.2f} B/param" for v, b in zip(vals, per, strict=True)]
        ax.bar_label(bars, labels=labels, fontsize=8)
    ax.set_xticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(top=1.15 * ax.get_ylim()[1])
    ax.set(ylabel="optimizer state (MiB)",
           title=f"Optimizer-state bytes per rank ({cfg['sharding']['mode']})")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "state_per_rank.png")
    plt.close(fig)


def report(results: dict[str, dict], out_dir: Path, command: str, wall: float) -> str:
    """Writes report.md, results.json and the two PNGs; returns the plain-text table."""
    rows = table(results)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out_dir)
    cfg = results["gefen"]["config"]
    m = cfg["model"]
    o, d, g = cfg["optimizer"], cfg["data"], results["gefen"]
    text = f"""# Gefen vs AdamW: {cfg["sharding"]["mode"]}, {g["world_size"]} ranks

Command: `{command}` ({wall:.0f} s wall, both runs).
Model: byte-level GPT, {m["n_layer"]} layers, d={m["n_embd"]}, {m["n_head"]} heads, context
{m["block_size"]}; {g["n_params"]:,} parameters. {cfg["steps"]} steps, batch
{d["batch_size"]} per rank, lr {o["lr"]}, {o["warmup"]} warmup steps and cosine decay, the
same for both; Gefen {o["bits"]}-bit. Final train loss: mean over the last eval interval,
averaged over ranks; validation loss: {d["val_batches"]} fixed batches. torch
{g["torch_version"]}.

{markdown(rows)}

![loss curves](loss_curves.png)

![optimizer state per rank](state_per_rank.png)
"""
    (out_dir / "report.md").write_text(text)
    return plain(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 layers, 60 steps (CI)")
    ap.add_argument("--config", help="YAML run config over the built-in main-job config")
    ap.add_argument("--out", default="main_job_out", help="output folder (default %(default)s)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    base = copy.deepcopy(MAIN_JOB)
    if args.quick:
        _update(base, copy.deepcopy(QUICK))
    try:
        if args.config:
            _update(base, yaml.safe_load(Path(args.config).read_text()) or {})
        configs = {n: load_config(_update(copy.deepcopy(base), {"optimizer": {"name": n}}))
                   for n in OPTIMIZERS}  # fmt: skip
    except ConfigError as e:
        ap.exit(2, f"error: {e}\n")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = {n: run_one(c, out_dir, args.nproc, not args.no_progress) for n, c in configs.items()}
    wall = time.perf_counter() - t0
    command = "python3 launch/main_job.py" + (" --quick" if args.quick else "")
    print(report(results, out_dir, command, wall))
    print(f"wrote {out_dir}/report.md, results.json, loss_curves.png, state_per_rank.png "
          f"({wall:.0f} s)")  # fmt: skip
    bad = [n for n, r in results.items() if not math.isfinite(r["final_val_loss"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
