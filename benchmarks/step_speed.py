"""Time one optimizer step on the CPU, Gefen against fused AdamW and the low-bit peers.

Each optimizer runs in its own subprocess (so one's allocations and thread pools cannot slow
another), on the same parameters and gradients, and reports the median step time and the peak
memory the step allocates beyond the state: the process's peak RSS is reset
(/proc/self/clear_refs) after warm-up steps have allocated the state, and the timed steps' peak is
read back (VmHWM) minus the RSS before them.

Parameter sets:
- ``gpt``: the demo GPT's parameters (4 layers, d=256, 3.24M) with the gradients of real
  batches of the stdlib corpus, so Gefen's partition is the one training would get.
- ``100m``: 24 matrices of 2048 x 2048 (100.7M), gradients N(0, 1) times a per-row scale
  (log-normal, the same at every step), the structure Gefen's partition finds in linear layers
  (one block per row).

Every step sees the next of GRADIENTS gradient sets, copied into ``.grad`` in place before the
step and outside its time, the same sequence for every optimizer. Why not one gradient: under a
fixed gradient m converges and every m / absmax settles next to a codebook level, which training
never does. The 8-bit kernel used to find most codes with one table load and walk one by one to
the rest, many elements in training but almost none on one fixed gradient: the demo GPT's 8-bit
step read 3.7 ms on one gradient (README's table at 31d76eb) and 10.1 ms on three in turn
(research/results/step_speed/step_ab_grid8.json, its base rows).

    python benchmarks/step_speed.py [--sets gpt,100m] [--steps 20] [--threads 2] [--rounds 3]
        [--json out.json]

``--rounds R`` runs every optimizer's process R times, the rounds alternating between
optimizers, and reports the median of the R medians with their range: on a shared machine one
process's timing can be off by tens of percent, and alternating spreads that over all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OPTIMIZERS = {
    "adamw_fused": "torch AdamW fused",
    "adamw_foreach": "torch AdamW foreach",
    "gefen4": "Gefen 4-bit",
    "gefen8": "Gefen 8-bit",
    "bnb_adamw8bit": "bitsandbytes AdamW8bit",
    "torchao_adamw8bit": "torchao AdamW8bit",
    "torchao_adamw4bit": "torchao AdamW4bit",
}


GRADIENTS = 3


def make_params(which: str) -> list[torch.nn.Parameter]:
    """The set's parameters, each ``.grad`` its first gradient."""
    return make_problem(which, 1)[0]


def make_problem(
    which: str, sets: int = GRADIENTS
) -> tuple[list[torch.nn.Parameter], list[list[torch.Tensor]]]:
    """The set's parameters and ``sets`` gradients for them (``.grad`` a copy of the first)."""
    torch.manual_seed(0)
    if which == "gpt":
        from gefen_dist.demo.corpus import get_batch, load_corpus
        from gefen_dist.demo.model import GPT, GPTConfig

        model = GPT(GPTConfig())
        train, _ = load_corpus(2**20)
        params, grads = list(model.parameters()), []
        batches = torch.Generator().manual_seed(0)
        for _ in range(sets):
            model.zero_grad(set_to_none=True)
            x, y = get_batch(train, 8, 128, batches)
            model(x, y)[1].backward()
            grads.append([p.grad.clone() for p in params])
    elif which == "100m":
        params = [torch.nn.Parameter(torch.randn(2048, 2048) * 0.02) for _ in range(24)]
        rows = [torch.randn(2048, 1).exp() for _ in params]
        grads = [[torch.randn(2048, 2048) * r for r in rows] for _ in range(sets)]
    else:
        raise ValueError(f"unknown parameter set {which!r}")
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g.clone()
    return params, grads


class Feed:
    """Copies the next gradient set into the parameters' ``.grad``, in place (the addresses
    an optimizer may have kept stay valid), before each step and outside its time."""

    def __init__(self, params: list[torch.nn.Parameter], grads: list[list[torch.Tensor]]):
        self.params, self.grads, self.t = params, grads, 0

    @torch.no_grad()
    def __call__(self) -> None:
        self.t += 1
        torch._foreach_copy_([p.grad for p in self.params], self.grads[self.t % len(self.grads)])


def build(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, fused=True, **kw)
    if name == "adamw_foreach":
        return torch.optim.AdamW(params, foreach=True, **kw)
    from gefen_dist.bench import peers

    return peers.build(name, torch.nn.Module(), params=params, **kw)


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(name: str, which: str, steps: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    params, grads = make_problem(which)
    feed = Feed(params, grads)
    numel = sum(p.numel() for p in params)
    try:
        opt = build(name, params)
    except Exception as e:
        return dict(optimizer=name, set=which, skipped=f"{type(e).__name__}: {e}")
    for _ in range(3):  # state allocation, codebook, numba/torch.compile warm-up
        opt.step()
        feed()
    before = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    times = []
    for _ in range(steps):
        feed()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    extra = _rss("VmHWM") - before
    from gefen_dist.bench.peers import state_bytes

    out = dict(
        optimizer=name,
        set=which,
        params=numel,
        median_ms=1e3 * statistics.median(times),
        min_ms=1e3 * min(times),
        extra_mib=max(extra, 0) / 2**20,
        state_bytes_per_param=state_bytes(opt) / numel,
    )
    if hasattr(opt, "memory_report"):
        report = opt.memory_report()
        out["backend"] = report["backend"]
        if report.get("cpu_isa"):
            out["backend"] += f", {report['cpu_isa']}"
    return out


def combine(runs: list[dict]) -> dict:
    """One row from an optimizer's rounds: the median of their medians, and their range."""
    done = [r for r in runs if "median_ms" in r]
    if not done:
        return runs[-1]
    out = dict(done[0])
    out["median_ms"] = statistics.median(r["median_ms"] for r in done)
    out["min_ms"] = min(r["min_ms"] for r in done)
    out["extra_mib"] = max(r["extra_mib"] for r in done)
    out["rounds_ms"] = [r["median_ms"] for r in done]
    return out


def _revision() -> str:
    """The commit, "-dirty" if anything but results/ differs from it (a run of several commands
    writes its own results between them)."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    changed = subprocess.run(
        [*git, "status", "--porcelain", "--", ".", ":!results"], capture_output=True, text=True
    )
    return (head.stdout.strip() or "unknown") + ("-dirty" if changed.stdout.strip() else "")


def save(path: Path, rows: list[dict], **meta) -> None:
    """``rows`` and ``meta`` as JSON at ``path``, with what every result here records: the
    revision, the CPU, torch's version and the command."""
    from gefen_dist.bench import store

    meta = dict(
        **meta,
        cpu=store.cpu_model(),
        revision=_revision(),
        torch=torch.__version__,
        command=" ".join(sys.argv),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


def run_child(name: str, which: str, steps: int, threads: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--sets",
        which,
        "--steps",
        str(steps),
        "--threads",
        str(threads),
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return dict(optimizer=name, set=which, skipped=f"exit {r.returncode}: {r.stderr[-300:]}")


def table(rows: list[dict]) -> str:
    out = [
        "| set | optimizer | median step (rounds' range) | x fused AdamW | extra memory "
        "| state B/param |",
        "|---|---|---|---|---|---|",
    ]
    for which in dict.fromkeys(r["set"] for r in rows):
        ref = next(
            (
                r
                for r in rows
                if r["set"] == which and r["optimizer"] == "adamw_fused" and "median_ms" in r
            ),
            None,
        )
        for r in (r for r in rows if r["set"] == which):
            label = OPTIMIZERS.get(r["optimizer"], r["optimizer"])
            if "skipped" in r:
                out.append(f"| {which} | {label} | skipped: {r['skipped'][:80]} | | | |")
                continue
            if r.get("backend"):
                label += f" ({r['backend']})"
            ratio = f"{r['median_ms'] / ref['median_ms']:.2f}x" if ref else "-"
            spread = r.get("rounds_ms", [])
            span = f" ({min(spread):.1f}-{max(spread):.1f})" if len(spread) > 1 else ""
            out.append(
                f"| {which} | {label} | {r['median_ms']:.1f} ms{span} | {ratio} | "
                f"{r['extra_mib']:.1f} MiB | {r['state_bytes_per_param']:.3f} |"
            )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", default="gpt,100m")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.sets, a.steps, a.threads)))
        return
    rows = []
    names = a.optimizers.split(",")
    for which in a.sets.split(","):
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for _ in range(a.rounds):
            for name in names:
                if runs[name] and "skipped" in runs[name][-1]:
                    continue
                runs[name].append(run_child(name, which, a.steps, a.threads))
                print(json.dumps(runs[name][-1]), flush=True)
        rows += [combine(runs[n]) for n in names]
    print(table(rows))
    if a.json:
        save(a.json, rows, threads=a.threads, cpus=os.cpu_count(), rounds=a.rounds)


if __name__ == "__main__":
    main()
