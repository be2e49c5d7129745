"""ZeRO-Offload's host step: DeepSpeedCPUAdam against Gefen 4-bit and 8-bit, in one engine kind.

Under ZeRO-Offload the optimizer steps the fp32 master partitions on the host, and that step is
often what a step waits for. This runs one process under DeepSpeed (CPU accelerator, gloo,
ZeRO-2 with ``offload_optimizer: {device: cpu}``) with three engines built alike on the same
model and data, one per optimizer, and steps them in turn (A, B, C, A, B, C, ...) so that a
noisy machine slows all three alike. It reports per optimizer, side by side:

- ``host_step_ms``: the inner optimizer's ``step`` calls within ``engine.step()`` (what
  ZeRO-Offload runs on the host), median over the measured steps, and ``host_step_min_ms``,
  their fastest (the least disturbed by other load on a shared machine);
- ``bare_step_ms``: the same optimizer stepping one bare fp32 tensor of as many elements
  outside DeepSpeed, right after (the kernel alone, without the partition's layout);
- ``engine_step_ms`` (``engine.step()``: also the gradient copies to the host and the weights'
  copy back) and ``whole_step_ms`` (forward, backward and ``engine.step()``);
- ``state_bytes``: bytes of the optimizer's state tensors, and ``rss_delta_bytes``: the
  process's resident memory after the first step (where both allocate their state) minus
  before it.

    nice -n 19 python benchmarks/offload_step.py                  # 25M parameters
    nice -n 19 python benchmarks/offload_step.py --n-embd 256 --steps 3   # a quick look

Writes ``results/offload/offload_step.json`` (``--out``) with the command, machine and revision.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _mem_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
        return round(kib / 2**20, 1)
    except (OSError, StopIteration):
        return 0.0


def _revision() -> str:
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    changed = subprocess.run(
        [*git, "status", "--porcelain", "--", ".", ":!results"], capture_output=True, text=True
    )
    return (head.stdout.strip() or "unknown") + ("-dirty" if changed.stdout.strip() else "")


class _Timed:
    """Times the inner optimizer's step calls (ZeRO calls it once per param group)."""

    def __init__(self, opt) -> None:
        self.spent = 0.0
        inner = opt.step

        def step(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - t

        opt.step = step


def _state_bytes(opt) -> int:
    seen, total = set(), 0
    for st in opt.state.values():
        for t in st.values():
            if hasattr(t, "untyped_storage") and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2, help="steps not measured (the first included)")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per optimizer")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results" / "offload" / "offload_step.json"))
    a = ap.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    for k, v in dict(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", "29561")
    import deepspeed
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    import gefen_dist.integrations.deepspeed as gd
    from gefen_dist import Gefen
    from gefen_dist.bench import store
    from gefen_dist.demo.model import GPT, GPTConfig

    torch.set_num_threads(a.threads)
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = GPTConfig(block_size=a.block_size, n_layer=a.n_layer, n_head=8, n_embd=a.n_embd)
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    makers = {
        "DeepSpeedCPUAdam": lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True, **hyper),
        "Gefen 4-bit": lambda ps: Gefen(ps, bits=4, **hyper),
        "Gefen 8-bit": lambda ps: Gefen(ps, bits=8, **hyper),
    }
    config = {
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    runs = {}
    for name, make in makers.items():
        torch.manual_seed(0)
        model = GPT(cfg)
        eng, *_ = deepspeed.initialize(
            model=model, optimizer=make(model.parameters()), config=config
        )
        runs[name] = dict(eng=eng, timer=_Timed(eng.optimizer.optimizer), rows=[])
    params = sum(p.numel() for p in runs["DeepSpeedCPUAdam"]["eng"].module.parameters())
    # The same optimizers on one bare fp32 tensor of as many elements, outside DeepSpeed: what
    # separates the kernel's speed from the ZeRO partition's layout (many tensors' segments).
    torch.manual_seed(1)
    grad = torch.randn(params) * 1e-3
    for r, make in zip(runs.values(), makers.values(), strict=True):
        w = torch.nn.Parameter(torch.randn(params) * 0.02)
        w.grad = grad.clone()
        r["bare"] = (w, make([w]))
        r["bare_rows"] = []

    def batch(s: int):
        g = torch.Generator().manual_seed(1000 + s)
        x = torch.randint(0, cfg.vocab_size, (a.batch, a.block_size), generator=g)
        return x, torch.roll(x, -1, dims=1)

    for s in range(a.warmup + a.steps):
        for r in runs.values():
            eng, timer = r["eng"], r["timer"]
            gc.collect()
            if s == 0:
                r["rss_before"] = _rss()
            t0 = time.perf_counter()
            loss = eng(*batch(s))[1]
            eng.backward(loss)
            timer.spent = 0.0
            t1 = time.perf_counter()
            eng.step()
            t2 = time.perf_counter()
            if s == 0:
                gc.collect()
                r["rss_delta"] = _rss() - r["rss_before"]
            r.setdefault("losses", []).append(round(float(loss.detach()), 5))
            if s >= a.warmup:
                r["rows"].append((timer.spent, t2 - t1, t2 - t0))
            t3 = time.perf_counter()
            r["bare"][1].step()
            if s >= a.warmup:
                r["bare_rows"].append(time.perf_counter() - t3)
    out = []
    for name, r in runs.items():
        host, eng_step, whole = (statistics.median(x) * 1e3 for x in zip(*r["rows"], strict=True))
        inner = r["eng"].optimizer.optimizer
        row = dict(
            optimizer=name,
            host_step_ms=round(host, 1),
            host_step_min_ms=round(min(x[0] for x in r["rows"]) * 1e3, 1),
            host_step_rounds_ms=[round(x[0] * 1e3, 1) for x in r["rows"]],
            bare_step_ms=round(statistics.median(r["bare_rows"]) * 1e3, 1),
            bare_step_min_ms=round(min(r["bare_rows"]) * 1e3, 1),
            engine_step_ms=round(eng_step, 1),
            whole_step_ms=round(whole, 1),
            state_bytes=_state_bytes(inner),
            rss_delta_bytes=r["rss_delta"],
            losses=r["losses"],
        )
        if isinstance(inner, Gefen):
            row["backend"] = gd.memory_report(r["eng"])["backend"]
        out.append(row)
    adam = out[0]
    for row in out:
        row["host_step_vs_cpu_adam"] = round(row["host_step_ms"] / adam["host_step_ms"], 3)
        row["bare_step_vs_cpu_adam"] = round(row["bare_step_ms"] / adam["bare_step_ms"], 3)
        row["host_step_min_vs_cpu_adam"] = round(
            row["host_step_min_ms"] / adam["host_step_min_ms"], 3
        )
        row["state_vs_cpu_adam"] = round(row["state_bytes"] / adam["state_bytes"], 4)
    meta = dict(
        command="nice -n 19 python "
        + " ".join([f"benchmarks/{Path(__file__).name}", *sys.argv[1:]]),
        machine=dict(
            cpu=store.cpu_model(),
            cores=os.cpu_count(),
            memory_gib=_mem_gib(),
            system=platform.platform(),
        ),
        revision=_revision(),
        torch=torch.__version__,
        deepspeed=deepspeed.__version__,
        threads=a.threads,
        params=params,
        model=dict(n_layer=a.n_layer, n_embd=a.n_embd, block_size=a.block_size, batch=a.batch),
        warmup=a.warmup,
        steps=a.steps,
        zero="ZeRO-2, offload_optimizer cpu, fp32, 1 process",
    )
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(meta=meta, rows=out), indent=1) + "\n")
    for row in out:
        print(
            f"{row['optimizer']:<17} host step {row['host_step_ms']:8.1f} ms "
            f"({row['host_step_vs_cpu_adam']:.2f}x)  bare {row['bare_step_ms']:7.1f} ms  "
            f"engine.step {row['engine_step_ms']:8.1f} ms  "
            f"whole {row['whole_step_ms']:8.1f} ms  state {row['state_bytes'] / 2**20:7.1f} MiB "
            f"({row['state_vs_cpu_adam']:.3f}x)  RSS +{row['rss_delta_bytes'] / 2**20:.1f} MiB"
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
