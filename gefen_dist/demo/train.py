"""Train the byte-level GPT on the stdlib source with AdamW or Gefen and report loss and memory.

Everything except the optimizer is a function of the seed (model init, batch order) and the
validation batches are a function of a separate fixed seed, so two runs that differ only in
the optimizer are a paired comparison.

    python -m gefen_dist.demo.train --optimizer adamw --steps 300
    python -m gefen_dist.demo.train --optimizer gefen --gefen-kwargs '{"bits": 4}'
    python -m gefen_dist.demo.train --compare --steps 300 --seed 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from gefen_dist.demo import loop
from gefen_dist.demo.corpus import get_batch, load_corpus
from gefen_dist.demo.loop import Trace, plain_step
from gefen_dist.demo.model import GPT, GPTConfig
from gefen_dist.schedule import warmup_cosine

DEFAULTS: dict = dict(
    optimizer="adamw",
    gefen_kwargs={},
    steps=300,
    batch_size=16,
    block_size=64,
    lr=1e-3,
    min_lr_frac=0.1,
    weight_decay=0.1,
    betas=(0.9, 0.95),
    warmup=None,  # None: 10 % of steps
    grad_clip=1.0,
    seed=0,
    eval_every=None,  # None: steps // 10
    eval_batches=20,
    val_seed=1234,  # independent of `seed`, so every run is scored on the same batches
    n_layer=4,
    n_head=8,
    n_embd=256,
    max_bytes=8 * 2**20,
    threads=1,
    device="cpu",
    quiet=False,
)

MiB = 2**20


def full_config(config: dict) -> dict:
    """Defaults filled in and derived values resolved, so a stored config fully describes a run."""
    unknown = set(config) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown config keys: {sorted(unknown)}")
    cfg = {**DEFAULTS, **config}
    cfg["betas"] = tuple(float(b) for b in cfg["betas"])
    cfg["gefen_kwargs"] = dict(cfg["gefen_kwargs"] or {})
    if cfg["warmup"] is None:
        cfg["warmup"] = int(0.1 * cfg["steps"])
    if cfg["eval_every"] is None:
        cfg["eval_every"] = max(1, cfg["steps"] // 10)
    return cfg


def build_optimizer(model: torch.nn.Module, cfg: dict) -> torch.optim.Optimizer:
    """nanoGPT grouping: decay matrices and embeddings, not biases and LayerNorm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg["weight_decay"]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    common = dict(lr=cfg["lr"], betas=cfg["betas"], weight_decay=cfg["weight_decay"])
    if cfg["optimizer"] == "adamw":
        return torch.optim.AdamW(groups, **common)
    if cfg["optimizer"] == "gefen":
        from gefen_dist import Gefen  # lazy: the optimizer is optional for AdamW runs

        return Gefen(groups, **{**common, **cfg["gefen_kwargs"]})
    raise ValueError(f"unknown optimizer {cfg['optimizer']!r}")


def lr_lambda(cfg: dict):
    """Linear warmup, then cosine decay to min_lr_frac * lr at the last step."""
    steps, warmup, floor = cfg["steps"], cfg["warmup"], cfg["min_lr_frac"]

    return lambda step: warmup_cosine(step, steps, warmup, floor)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every state tensor except the per-parameter step counter."""
    total = 0
    for state in opt.state.values():
        for k, v in state.items():
            if k != "step" and torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


def memory_summary(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict:
    """Same accounting for every optimizer; the optimizer's own report wins when it has one."""
    params = [p for p in model.parameters() if p.requires_grad]
    adamw_bytes = sum(2 * p.numel() * p.element_size() for p in params)
    report = opt.memory_report() if hasattr(opt, "memory_report") else None
    if report is not None:
        n, total = int(report["params"]), int(report["state_bytes"])
        per_param = float(report.get("bytes_per_param", total / max(1, n)))
        adamw_bytes = int(report.get("adamw_bytes", adamw_bytes))
    else:
        n = sum(p.numel() for p in params)
        total = state_bytes(opt)
        per_param = total / max(1, n)
    return dict(
        state_bytes=total,
        state_params=n,
        bytes_per_param=per_param,
        adamw_bytes=adamw_bytes,
        memory_report=report,
    )


@torch.no_grad()
def evaluate(model: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    loss = sum(model(x, y)[1].item() for x, y in batches) / len(batches)
    model.train()
    return loss


def run(config: dict) -> dict:
    """Train once and return the result dict (config, loss curve, final losses, timing, memory)."""
    cfg = full_config(config)
    torch.set_num_threads(cfg["threads"])
    dev = torch.device(cfg["device"])
    say = (lambda *a: None) if cfg["quiet"] else (lambda *a: print(*a, flush=True))

    train_data, val_data = load_corpus(cfg["max_bytes"])
    bs, T = cfg["batch_size"], cfg["block_size"]
    g_val = torch.Generator().manual_seed(cfg["val_seed"])
    val_batches = [
        tuple(t.to(dev) for t in get_batch(val_data, bs, T, g_val))
        for _ in range(cfg["eval_batches"])
    ]

    torch.manual_seed(cfg["seed"])
    g_train = torch.Generator().manual_seed(cfg["seed"])
    mcfg = GPTConfig(
        block_size=T, n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"]
    )
    model = GPT(mcfg).to(dev)
    opt = build_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))

    name = cfg["optimizer"]
    if name == "gefen" and cfg["gefen_kwargs"]:
        name += json.dumps(cfg["gefen_kwargs"])
    say(
        f"{name}: {model.num_params():,} params, {cfg['steps']} steps, batch {bs}x{T}, "
        f"seed {cfg['seed']}"
    )
    trace = Trace(curve=[dict(step=0, train_loss=None, val_loss=evaluate(model, val_batches))])
    say(f"step {0:5d} | val {trace.curve[0]['val_loss']:.4f}")
    lrs: list[float] = []

    def step(s: int) -> float:
        def loss_of() -> torch.Tensor:
            x, y = (t.to(dev) for t in get_batch(train_data, bs, T, g_train))
            return model(x, y)[1]

        lrs.append(opt.param_groups[0]["lr"])
        loss = plain_step(model, opt, loss_of, cfg["grad_clip"])
        sched.step()
        return loss

    last = [0]

    def report(s: int, trace: Trace) -> None:
        if trace.curve[-1]["step"] != s:
            return
        p, n = trace.curve[-1], s - last[0]
        ms = sum(trace.step_ms[-n:]) / n
        say(
            f"step {s:5d} | train {p['train_loss']:.4f} | val {p['val_loss']:.4f} | "
            f"lr {lrs[-1]:.2e} | {ms:.1f} ms/step"
        )
        last[0] = s

    t_start = time.perf_counter()
    trace = loop.train(
        step,
        cfg["steps"],
        lambda: dict(val_loss=evaluate(model, val_batches)),
        lambda s: s % cfg["eval_every"] == 0 or s == cfg["steps"],
        trace=trace,
        after=report,
    )
    curve = trace.curve
    wall = time.perf_counter() - t_start

    return dict(
        config=cfg,
        optimizer=name,
        curve=curve,
        final_train_loss=curve[-1]["train_loss"],  # mean over the last eval interval
        final_val_loss=curve[-1]["val_loss"],
        wall_time_s=wall,
        step_time_median_ms=statistics.median(trace.step_ms),
        n_params=model.num_params(),
        **memory_summary(opt, model),
        torch_version=torch.__version__,
    )


def table(results: list[dict]) -> str:
    """Side-by-side summary; the 'vs AdamW' columns use the AdamW run if there is one."""
    ref = next((r for r in results if r["config"]["optimizer"] == "adamw"), None)
    head = ("optimizer", "final val", "state MiB", "bytes/param", "state vs AdamW", "val vs AdamW")
    rows = [head]
    for r in results:
        dval = ""
        if ref is not None:
            rel = (r["final_val_loss"] - ref["final_val_loss"]) / ref["final_val_loss"]
            dval = f"{100 * rel:+.2f} %"
        rows.append(
            (
                r["optimizer"],
                f"{r['final_val_loss']:.4f}",
                f"{r['state_bytes'] / MiB:.2f}",
                f"{r['bytes_per_param']:.2f}",
                f"{r['state_bytes'] / r['adamw_bytes']:.3f}x",
                dval,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _json_default(o):
    """memory_report() may hold numpy or torch scalars."""
    try:
        return o.item()
    except (AttributeError, ValueError, RuntimeError):
        return str(o)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = DEFAULTS
    p = argparse.ArgumentParser(
        prog="python -m gefen_dist.demo.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--optimizer", choices=["adamw", "gefen"], default=d["optimizer"])
    p.add_argument(
        "--gefen-kwargs",
        type=json.loads,
        default={},
        help="JSON dict of extra Gefen options, e.g. '{\"bits\": 4}'",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="run AdamW then Gefen with the same seed and print both",
    )
    p.add_argument("--steps", type=int, default=d["steps"])
    p.add_argument("--batch-size", type=int, default=d["batch_size"])
    p.add_argument("--block-size", type=int, default=d["block_size"])
    p.add_argument("--lr", type=float, default=d["lr"])
    p.add_argument("--weight-decay", type=float, default=d["weight_decay"])
    p.add_argument(
        "--betas",
        type=lambda s: tuple(float(b) for b in s.split(",")),
        default=d["betas"],
        help="e.g. 0.9,0.95",
    )
    p.add_argument("--warmup", type=int, default=None, help="steps (default 10 %% of --steps)")
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--eval-every", type=int, default=None, help="default steps // 10")
    p.add_argument("--eval-batches", type=int, default=d["eval_batches"])
    p.add_argument("--n-layer", type=int, default=d["n_layer"])
    p.add_argument("--n-head", type=int, default=d["n_head"])
    p.add_argument("--n-embd", type=int, default=d["n_embd"])
    p.add_argument("--max-bytes", type=int, default=d["max_bytes"], help="corpus size cap")
    p.add_argument("--threads", type=int, default=d["threads"])
    p.add_argument("--device", default=d["device"])
    p.add_argument("--json", metavar="PATH", help="write the result dict (a list with --compare)")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = vars(parse_args(argv))
    json_path, compare = args.pop("json"), args.pop("compare")
    if compare:
        results = [
            run({**args, "optimizer": "adamw", "gefen_kwargs": {}}),
            run({**args, "optimizer": "gefen"}),
        ]
    else:
        results = [run(args)]
    print(table(results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results if compare else results[0], f, indent=1, default=_json_default)


if __name__ == "__main__":
    main(sys.argv[1:])
