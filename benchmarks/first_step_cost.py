"""What Gefen's first step costs against its ordinary steps, and how many host syncs it makes.

    python benchmarks/first_step_cost.py [--size 1.0] [--threads 2] [--steps 10] [--out results]

The first step learns each tensor's blocks (``partition``) and the codebook (a histogram of the
block-normalised g0) before it updates anything; every later step only updates. On a GPU each
host sync of that learning (``.item()``, ``.tolist()``, ``bool`` of a tensor, and the
data-dependent shapes of boolean indexing, ``nonzero`` and ``bincount``) stalls the host until
the device drains its queue, so their number, not the arithmetic, sets the first step's cost
at 1B parameters. This measures both on the CPU:

- ``first_s``: one fresh optimizer's first ``step()``, of which ``init_s`` is the learning
  (``Gefen._initialize``); ``step_s``: the mean of the ``--steps`` ordinary steps after it, on
  the same gradients.
- ``syncs`` and ``ops``: counted over the learning only (a second fresh optimizer, so the timing
  is not slowed by the counting). Ops are the aten calls a ``TorchDispatchMode`` sees. Syncs are
  the calls that make a device's host wait: ``aten._local_scalar_dense`` (what ``item``,
  ``float``, ``int`` and ``bool`` of a tensor run), the ops whose output shape depends on the
  data (``nonzero``, ``masked_select``, indexing with a boolean mask, ``bincount``, ``unique``,
  ``repeat_interleave`` without ``output_size``), and ``Tensor.tolist`` and ``Tensor.numpy``
  (patched for the run; they bypass the dispatcher). A device-to-host copy (``.cpu()``) cannot
  be told from a no-op on a CPU and is not counted; the learning's one such copy per step is
  its ``tolist``.

The tensor set is a GPT-like mix at ``--size 1.0`` (about 100M parameters, fp32): an embedding,
8 layers of attention and MLP weights (2-D), their biases and norm gains (1-D, small) and one
large square weight. The gradients have row and column scales of their own (lognormal), so the
partition has structure to find. ``--size`` scales the widths and the vocabulary (0.01 for a test).
Writes ``first_step_cost.json`` and ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gefen_dist import Gefen  # noqa: E402
from gefen_dist.bench import store  # noqa: E402
from gefen_dist.method import codebook as cb  # noqa: E402
from gefen_dist.method import state  # noqa: E402

_SYNC_OPS = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten.bincount.default",
    "aten._unique2.default",
    "aten.unique_consecutive.default",
}


class _Counter(TorchDispatchMode):
    """Counts every aten call and the ones that make a device's host wait (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        self.ops[name] += 1
        if name in _SYNC_OPS:
            self.syncs[name] += 1
        elif name.startswith("aten.index.Tensor") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 else ())
        ):
            self.syncs["aten.index.Tensor(bool mask)"] += 1
        elif name.startswith("aten.repeat_interleave") and kwargs.get("output_size") is None:
            self.syncs[name] += 1
        return func(*args, **kwargs)


def layout(size: float) -> list[tuple[str, tuple[int, ...]]]:
    """The tensor set: names and shapes (module docstring)."""
    d = max(64, round(768 * math.sqrt(size) / 64) * 64)
    vocab = max(256, int(32000 * size))
    big = max(128, round(4096 * math.sqrt(size) / 128) * 128)
    out: list[tuple[str, tuple[int, ...]]] = [("wte", (vocab, d)), ("wpe", (1024, d))]
    for i in range(8):
        out += [
            (f"h{i}.ln1.weight", (d,)),
            (f"h{i}.ln1.bias", (d,)),
            (f"h{i}.attn.qkv.weight", (3 * d, d)),
            (f"h{i}.attn.qkv.bias", (3 * d,)),
            (f"h{i}.attn.proj.weight", (d, d)),
            (f"h{i}.attn.proj.bias", (d,)),
            (f"h{i}.ln2.weight", (d,)),
            (f"h{i}.ln2.bias", (d,)),
            (f"h{i}.mlp.fc.weight", (4 * d, d)),
            (f"h{i}.mlp.fc.bias", (4 * d,)),
            (f"h{i}.mlp.proj.weight", (d, 4 * d)),
            (f"h{i}.mlp.proj.bias", (d,)),
        ]
    out += [("ln_f.weight", (d,)), ("ln_f.bias", (d,)), ("big.weight", (big, big))]
    return out


def build(size: float, seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters with a first gradient whose rows and columns have scales of their own."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for name, shape in layout(size):
        p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
        grad = torch.randn(shape, generator=g)
        grad.mul_(torch.randn(shape[0], *[1] * (len(shape) - 1), generator=g).exp_())
        if len(shape) == 2:
            grad.mul_(torch.randn(1, shape[1], generator=g).mul_(0.5).exp_())
        p.grad = grad.mul_(1e-3)
        params.append((name, p))
    return params


def _revision() -> str:
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    changed = subprocess.run(
        [*git, "status", "--porcelain", "--", "gefen_dist"], capture_output=True, text=True
    )
    return (head.stdout.strip() or "unknown") + ("-dirty" if changed.stdout.strip() else "")


def _patched_host_reads(counter: _Counter):
    """Tensor.tolist and Tensor.numpy counted as syncs while ``counter`` runs."""
    saved = {k: getattr(torch.Tensor, k) for k in ("tolist", "numpy")}

    def wrap(name, fn):
        def inner(self, *a, **kw):
            counter.syncs[f"Tensor.{name}"] += 1
            return fn(self, *a, **kw)

        return inner

    for k, fn in saved.items():
        setattr(torch.Tensor, k, wrap(k, fn))
    return saved


def _timed_init(opt: Gefen, into: dict) -> None:
    """Wrap ``opt._initialize`` (the learning) so its own time lands in ``into``."""
    inner = opt._initialize

    def timed(pending):
        t = time.perf_counter()
        inner(pending)
        into["init_s"] = into.get("init_s", 0.0) + time.perf_counter() - t

    opt._initialize = timed


def _load_codebook_solver() -> float:
    """The codebook's DP is numba code, loaded (or compiled) at its first call in a process:
    seconds, once, whatever the model's size. Timed apart so the first step's figure is the
    work that grows with the model."""
    t = time.perf_counter()
    cb.learn_codebook(torch.ones(cb.DEFAULT_BINS, dtype=torch.float64), 4)
    return time.perf_counter() - t


def measure(size: float, steps: int, bits: int) -> dict:
    solver_load_s = _load_codebook_solver()
    named = build(size)
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    opt = Gefen(named, lr=1e-4, bits=bits)
    first: dict = {}
    _timed_init(opt, first)
    t = time.perf_counter()
    opt.step()
    first_s = time.perf_counter() - t
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    step_s = sum(times) / len(times)
    blocks = {n: [r.block for r in state.layout_rows(opt.state[p])] for n, p in named}
    del opt

    counter = _Counter()
    opt = Gefen(named, lr=1e-4, bits=bits)
    inner = opt._initialize

    def counted(pending):
        saved = _patched_host_reads(counter)
        try:
            with counter:
                inner(pending)
        finally:
            for k, fn in saved.items():
                setattr(torch.Tensor, k, fn)

    opt._initialize = counted
    opt.step()
    codebook = opt.codebooks[bits].tolist()
    return dict(
        size=size,
        numel=numel,
        tensors=len(params),
        bits=bits,
        solver_load_s=solver_load_s,
        first_s=first_s,
        init_s=first["init_s"],
        step_s=step_s,
        steps=steps,
        first_over_step=first_s / step_s,
        syncs=sum(counter.syncs.values()),
        ops=sum(counter.ops.values()),
        sync_kinds=dict(counter.syncs.most_common()),
        top_ops=dict(counter.ops.most_common(12)),
        blocks=blocks,
        codebook=codebook,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=1.0, help="1.0: about 100M parameters")
    ap.add_argument("--steps", type=int, default=10, help="ordinary steps after the first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    r = measure(args.size, args.steps, args.bits)
    meta = dict(
        command="python " + " ".join(["benchmarks/first_step_cost.py", *sys.argv[1:]]),
        revision=_revision(),
        cpu=store.cpu_model(),
        cores=args.threads,
        machine_cores=len(os.sched_getaffinity(0)),
        torch=torch.__version__,
        python=platform.python_version(),
        load_average=os.getloadavg()[0],  # a shared machine's other work slows both figures
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "first_step_cost.json").write_text(json.dumps(dict(meta=meta, **r), indent=1))
    lines = [
        "# Gefen's first step against its ordinary steps (CPU)",
        "",
        f"`{meta['command']}` at {meta['revision']}; {meta['cpu']} ({meta['machine_cores']} "
        f"cores, load average {meta['load_average']:.1f} at the start), torch threads: "
        f"{args.threads}, torch {meta['torch']}.",
        "",
        f"{r['numel'] / 1e6:.1f}M parameters in {r['tensors']} fp32 tensors, {args.bits} bits.",
        "",
        "| first step | of it, learning | ordinary step (mean of "
        f"{args.steps}) | first / ordinary | host syncs | ops |",
        "|---|---|---|---|---|---|",
        f"| {r['first_s']:.3f} s | {r['init_s']:.3f} s | {r['step_s']:.3f} s | "
        f"{r['first_over_step']:.2f} | {r['syncs']} | {r['ops']} |",
        "",
        f"The codebook solver's one-time load in a process (numba), not in the figures above: "
        f"{r['solver_load_s']:.2f} s.",
        "",
        "Tensor.numpy and Tensor.tolist are counted wherever they are called, also on arrays "
        "already on the host (the column sums the rule reads, the codebook's counts): an upper "
        "bound of the reads a device would wait for.",
        "",
        "Syncs by kind: " + (", ".join(f"{k} {v}" for k, v in r["sync_kinds"].items()) or "none"),
        "",
    ]
    (args.out / "first_step_cost.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
