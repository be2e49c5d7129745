"""The GPU path in one go: the Triton kernels against the reference, the whole optimizer, timing.

On a GPU (a lent H200: run as is, well inside 8 minutes; torch with CUDA, triton, numba):

    python launch/gpu_check.py --out "$OUT"

On the CPU, the same script under Triton's interpreter (``TRITON_INTERPRET=1``: the kernels run
on CPU tensors, slowly, so every size is small); CI runs it this way, so the script is known to
work end to end before a GPU ever runs it:

    python launch/gpu_check.py --interpret --scale 0.000004 --steps 2 --out DIR

1. Checks the kernels against the reference update, step by step from identical state: awkward
   layouts (prime sizes, B = 1, odd block sizes and odd starts at 4 bits, a block of 50k
   elements spanning many tiles, several tensors' pieces in one flat buffer as FSDP/ZeRO hand
   them, cut blocks, column blocks whole and in pieces), 8 and 4 bits, fp32/bf16/fp16
   parameters; the device g0 histogram against the CPU's (must be equal); the whole optimizer
   as a user runs it (partition, histogram and codebook from real gradients on the device,
   three steps, a checkpoint resumed) against the same on the CPU (``check_optimizer``); and,
   on a GPU, launch/train.py on one NCCL rank under DDP and FSDP2 (``check_train``).
2. Times one step on a ~1B-parameter set of 16 matrices (fp32, then bf16 parameters and
   gradients) for fused AdamW, Gefen 4/8-bit and, where importable, bitsandbytes AdamW8bit and
   torchao AdamW8bit/4bit; reports the median step, the ratio to fused AdamW and the bytes/s
   each step must move against the device's measured copy bandwidth (a large ``copy_``), and
   whether Gefen 4-bit meets its goals there (``goals``: at most 0.6x fused AdamW's step, at
   least 70 % of copy bandwidth).
3. Times fused AdamW and Gefen 4/8-bit on GPT-2 124M's 148 tensors (fp32): the same kernels
   over many small tensors, so the per-tensor work on the host shows.

A failing check, or Gefen or fused AdamW failing to step, exits non-zero; a peer that is not
importable or fails is reported as skipped. Under the interpreter the times are the
interpreter's, not a GPU's: the report says so and judges no goal.

Every timed step sees the next of three gradient sets, copied into ``.grad`` before it and
outside its time (as benchmarks/step_speed.py: one fixed gradient lets m settle next to the
codebook's levels, which training does not).

Writes gpu_check.json and gpu_check.md to --out.
"""

from __future__ import annotations

import os
import sys

if "--interpret" in sys.argv:  # before anything imports triton, which reads it at import
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import functools  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gefen_dist import Gefen, Segment  # noqa: E402
from gefen_dist.backends import triton_backend  # noqa: E402
from gefen_dist.method import codebook as cb  # noqa: E402
from gefen_dist.method import state  # noqa: E402
from gefen_dist.method.codes import unpack4  # noqa: E402

GOAL_RATIO = 0.6  # Gefen 4-bit's step at most this times fused AdamW's, on the 1B set
GOAL_COPY = 0.70  # and at least this share of the device's copy bandwidth
BACKEND = "triton"  # what every Gefen here runs on the device (the CPU twin: the reference)

# (name, [(numel, start, shape, block)] of one flat buffer): block 1 = per-element bf16 state,
# block -P = column blocks of a row of P
LAYOUTS = [
    ("prime", [(7919, 0, (7919,), 1)]),
    ("rows", [(257 * 1031, 0, (257, 1031), 1031)]),
    ("odd_start_odd_block", [(4001, 37, (90, 97), 97)]),
    ("long_block", [(4 * 50257, 0, (4, 50257), 50257)]),
    ("short_blocks", [(96 * 300, 0, (300, 96), 8)]),
    ("columns", [(192 * 512, 0, (192, 512), -512)]),
    ("column_pieces", [(4001, 37, (90, 97), -97), (50, 5, (60, 97), -97), (300, 0, (300,), 1)]),
    (
        "flat_shard",
        [
            (1000, 24000, (200, 128), 128),
            (33, 0, (33,), 1),
            (5 * 96 + 1, 1, (6, 96), 96),
            (4096, 0, (64, 64), 64),
        ],
    ),
]
SMALL = {
    "rows": [(31 * 1031, 0, (31, 1031), 1031)],
    "long_block": [(2 * 5003, 0, (2, 5003), 5003)],
    "short_blocks": [(96 * 40, 0, (40, 96), 8)],
    "columns": [(40 * 512, 0, (40, 512), -512)],
}
"""The interpreter's sizes for the layouts above that are large: the same shapes of problem (a
block of many tiles, many short blocks, columns), at sizes it steps in seconds."""


def layouts(small: bool) -> list[tuple[str, list]]:
    return [(name, SMALL.get(name, parts) if small else parts) for name, parts in LAYOUTS]


def _grad(numel: int, start: int, row: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp(torch.randn((start + numel) // row + 2, generator=g))
    idx = (torch.arange(numel) + start) // row
    return (rows[idx] * torch.randn(numel, generator=g)).to(device)


def check_layout(name, parts, bits, dtype, device, steps=4) -> dict:
    numel = sum(n for n, *_ in parts)
    segs, off = [], 0
    for n, start, shape, _ in parts:
        segs.append(Segment(off, n, start, shape))
        off += n
    blocks = [b for *_, b in parts]
    gen = torch.Generator().manual_seed(0)
    levels = cb.learn_codebook(cb.histogram(torch.randn(20000, generator=gen).clamp(-1, 1)), bits)
    p0 = torch.randn(numel, generator=gen).to(device, dtype)
    ps, opts = [], []
    for backend in ("reference", BACKEND):
        p = p0.clone().requires_grad_()
        o = Gefen([p], lr=1e-2, weight_decay=0.1, bits=bits)
        o.backend = backend
        o.set_segments(p, segs)
        o.state[p] = state.allocate(segs, blocks, levels, p.device)
        ps.append(p)
        opts.append(o)
    (pr, pn), (orf, onb) = ps, opts
    worst = dict(p=0.0, v=0.0, absmax=0.0, dense=0.0, code_frac=0.0, code_max=0)
    for t in range(steps):
        g = torch.cat(
            [_grad(n, s, shape[-1], 10 * t + i, device) for i, (n, s, shape, _) in enumerate(parts)]
        ).to(dtype)
        pr.grad, pn.grad = g.clone(), g.clone()
        if t:
            pn.data.copy_(pr.data)
            for k, v in orf.state[pr].items():
                onb.state[pn][k].copy_(v)
        before = pr.detach().float().abs()
        orf.step()
        onb.step()
        sr, sn = orf.state[pr], onb.state[pn]
        # relative to the step's operands: where the step nearly cancels p (a step of 0.375 on
        # a p of -0.376), the backends' ulp in v is an ulp of the step, far more of the result
        scale = torch.maximum(before, pr.detach().float().abs()).clamp_min(1e-3)
        worst["p"] = max(worst["p"], ((pn - pr).detach().float().abs() / scale).max().item())
        for k in ("v", "absmax", "exp_avg", "exp_avg_sq"):
            if sr[k].numel():
                a, b = sn[k].float(), sr[k].float()
                # B = 1's m where m + w (g - m) cancels: an ulp of the operands, not of m
                floor = 1e-6 * b.abs().max() if k.startswith("exp_avg") else 0.0
                rel = ((a - b).abs() / (b.abs() + floor).clamp_min(1e-30)).max().item()
                key = "dense" if k.startswith("exp_avg") else k
                worst[key] = max(worst[key], rel)
        cr, cn = sr["codes"], sn["codes"]
        if bits == 4:
            cr, cn = unpack4(cr, 2 * cr.numel()), unpack4(cn, 2 * cn.numel())
        if cr.numel():
            d = (cr.long() - cn.long()).abs()
            worst["code_max"] = max(worst["code_max"], int(d.max()))
            worst["code_frac"] = max(worst["code_frac"], (d > 0).float().mean().item())
    p_tol = triton_backend.PARAM_RTOL[dtype]
    ok = (
        worst["p"] <= p_tol
        and worst["v"] <= 1e-5
        and worst["absmax"] <= 1e-5
        and worst["dense"] <= 2**-7  # B = 1 bf16 state: one ulp where an fp32 ulp carries
        and worst["code_max"] <= 1
        and worst["code_frac"] < 2e-3
    )
    used = onb.memory_report()["backend"]
    return dict(layout=name, bits=bits, dtype=str(dtype), backend=used, ok=ok, **worst)


def check_histogram(device) -> dict:
    g = _grad(96 * 301 + 5, 17, 96, 1, device)
    seg = Segment(0, g.numel(), 17, (400, 96))
    from gefen_dist.first_step import histogram

    dev = torch.zeros(cb.DEFAULT_BINS, dtype=torch.float64)
    histogram(g, seg, 96, dev, {0: 7.5})
    ref = torch.zeros(cb.DEFAULT_BINS, dtype=torch.float64)
    x = g.cpu()
    histogram(x, seg, 96, ref, {0: 7.5})
    return dict(check="histogram", ok=bool(torch.equal(dev, ref)), total=float(dev.sum()))


def check_optimizer(device, steps: int = 3, small: bool = False) -> dict:
    """The whole optimizer on the device, as a user runs it, against the same on the CPU: the
    demo GPT's parameters with the same real gradients (computed once, on the CPU) on both, so
    the first step partitions, builds the g0 histogram and learns the codebook from them on
    the device. Layouts (block sizes) and codebooks must be equal, the parameters after
    ``steps`` steps must agree but for the rare element a code flip moved (at most one in 10^3
    off by more than 10^-3 of the largest step), and a state_dict saved on the device must load
    into a fresh optimizer and step as the original does. The per-kernel checks above start
    from state set by hand, so they never ran this path."""
    from gefen_dist.demo.corpus import get_batch, load_corpus
    from gefen_dist.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    d = 64 if small else 128  # the interpreter's model is narrower, the same in kind
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=d, block_size=64))
    train, _ = load_corpus(2**18)
    batches = torch.Generator().manual_seed(0)
    grads = []
    for _ in range(steps + 1):
        model.zero_grad(set_to_none=True)
        model(*get_batch(train, 4, 64, batches))[1].backward()
        grads.append([q.grad.clone() for q in model.parameters()])
    out = dict(check="optimizer", ok=False)
    runs = []
    for where, backend in (("cpu", "reference"), (device, BACKEND)):
        params = [torch.nn.Parameter(q.detach().clone().to(where)) for q in model.parameters()]
        opt = Gefen(params, lr=1e-2, weight_decay=0.1, bits=4)
        opt.backend = backend
        for t in range(steps):
            for q, g in zip(params, grads[t], strict=True):
                q.grad = g.to(where)
            opt.step()
        runs.append((params, opt))
    (pc, oc), (pd, od) = runs
    out["backend"] = od.memory_report()["backend"]
    out["layouts_equal"] = all(
        torch.equal(oc.state[a]["layout"], od.state[b]["layout"].cpu())
        for a, b in zip(pc, pd, strict=True)
    )
    out["codebooks_equal"] = all(
        torch.equal(oc.state[a]["codebook"], od.state[b]["codebook"].cpu())
        for a, b in zip(pc, pd, strict=True)
    )
    moved = max(
        float((a.detach() - q.detach()).abs().max())
        for a, q in zip(pc, model.parameters(), strict=True)
    )
    off = sum(
        int(((a.detach() - b.detach().cpu()).abs() > 1e-3 * moved).sum())
        for a, b in zip(pc, pd, strict=True)
    )
    total = sum(a.numel() for a in pc)
    out["p_off_frac"] = off / total
    file = io.BytesIO()  # through a checkpoint file: a state_dict shares the state's tensors
    torch.save(od.state_dict(), file)
    file.seek(0)
    saved = torch.load(file, weights_only=True)
    twin = [torch.nn.Parameter(q.detach().clone()) for q in pd]
    fresh = Gefen(twin, lr=1e-2, weight_decay=0.1, bits=4)
    fresh.backend = BACKEND
    fresh.load_state_dict(saved)
    for q, r, g in zip(pd, twin, grads[steps], strict=True):
        q.grad, r.grad = g.to(device), g.to(device)
    od.step()
    fresh.step()
    out["resumed_equal"] = all(torch.equal(a, b) for a, b in zip(pd, twin, strict=True))
    out["ok"] = (
        out["layouts_equal"]
        and out["codebooks_equal"]
        and out["p_off_frac"] <= 1e-3
        and out["resumed_equal"]
    )
    return out


def check_train(device, mode: str) -> dict:
    """launch/train.py on one GPU rank (torchrun, NCCL) under ``mode``'s run config, four
    steps: the training script's device path and Gefen under that sharding with a real NCCL
    group, which only a GPU runs (on the CPU the distributed tests cover the script)."""
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        res_file = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
               "--master_port", str(29400 + len(mode)), str(root / "launch" / "train.py"),
               "--config", str(root / "configs" / "run" / f"{mode}.yaml"), "--set", "steps=4",
               "--set", f"device={device.type}", "--no-progress",
               "--out", str(res_file)]  # fmt: skip
        # the package from this checkout, installed or not (a lent GPU has it only here)
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
        )
        if device.type == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(device.index or 0)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        res = json.loads(res_file.read_text()) if res_file.exists() else {}
    curve = res.get("curve", [])
    last = curve[-1].get("val_loss") if curve else None
    ok = r.returncode == 0 and last is not None and math.isfinite(last)
    out = dict(check=f"train_{mode}", ok=ok, rc=r.returncode, val_loss=last)
    if not ok:
        out["error"] = (r.stdout + r.stderr)[-1500:]
    return out


def copy_bandwidth(device, numel: int) -> float:
    a = torch.empty(numel, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        t = _timer(device)
        b.copy_(a)
        times.append(t())
    return 2 * a.numel() * 4 / statistics.median(times)


def _timer(device):
    if device.type == "cuda":
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()

        def stop():
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1e3

        return stop
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0


# bytes a step must move per parameter (reads + writes), for the bandwidth column
def _bytes(name: str, pbytes: int) -> float:
    return {
        "adamw_fused": 2 * pbytes + pbytes + 16,
        "gefen4": 2 * pbytes + pbytes + 1.0,
        "gefen8": 2 * pbytes + pbytes + 2.0,
        "bnb_adamw8bit": 2 * pbytes + pbytes + 4.0,
        "torchao_adamw8bit": 2 * pbytes + pbytes + 4.0,
        "torchao_adamw4bit": 2 * pbytes + pbytes + 2.0,
    }[name]


def build(name, params):
    kw = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, fused=True, **kw)
    if name.startswith("gefen"):
        opt = Gefen(params, bits=int(name[5:]), **kw)
        opt.backend = BACKEND
        return opt
    if name == "bnb_adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kw)
    import torchao.optim as ao

    return (ao.AdamW8bit if name.endswith("8bit") else ao.AdamW4bit)(params, **kw)


def matrices(n_tensors: int, rows: int, cols: int) -> list[tuple[int, ...]]:
    return [(rows, cols)] * n_tensors


def gpt2_shapes(scale: float, tiny: bool = False) -> list[tuple[int, ...]]:
    """GPT-2 124M's 148 parameter shapes at scale 1; narrower (d = 64, vocab 512) below it, and
    ``tiny`` (d = 16, vocab 64: the interpreter's) narrower still."""
    d, vocab, ctx = (768, 50257, 1024) if scale >= 1 else (64, 512, 128)
    if tiny:
        d, vocab, ctx = 16, 64, 32
    layer = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,)]
    layer += [(4 * d, d), (d,)]
    return [(vocab, d), (ctx, d), *layer * 12, (d,), (d,)]


@torch.no_grad()
def feed(params, grads, t: int) -> None:
    """Gradient set t mod 3 into ``.grad``, in place (an optimizer may keep the addresses)."""
    torch._foreach_copy_([p.grad for p in params], grads[t % len(grads)])


def _device_ops(opt, device) -> int | None:
    """Kernels and copies one step puts on the GPU (torch.profiler), where a step of many small
    launches would show; None on the CPU or where the profiler cannot see the device."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            opt.step()
            torch.cuda.synchronize(device)
        return sum(e.device_type == DeviceType.CUDA for e in prof.events())
    except Exception:
        return None


def time_step(name, dtype, device, shapes, steps, label, warmup: int = 3) -> dict:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02) for s in shapes]
    scales = [torch.randn(s[0], *[1] * (len(s) - 1), device=device).exp() for s in shapes]
    grads = [
        [(torch.randn(s, device=device) * r).to(dtype) for s, r in zip(shapes, scales, strict=True)]
        for _ in range(3)
    ]
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g.clone()
    numel = sum(p.numel() for p in params)
    head = dict(optimizer=name, dtype=str(dtype), set=label)
    # a peer that is missing or fails is skipped; ours or the baseline failing is an error
    miss = "error" if name.startswith(("gefen", "adamw")) else "skipped"
    try:
        opt = build(name, params)
    except Exception as e:
        return dict(head, **{miss: f"{type(e).__name__}: {e}"[:300]})

    try:
        for t in range(warmup):
            feed(params, grads, t)
            opt.step()
        times, host = [], []
        for t in range(steps):
            feed(params, grads, t)
            timer = _timer(device)
            t0 = time.perf_counter()
            opt.step()
            host.append(time.perf_counter() - t0)  # until step() returns: Python and launches
            times.append(timer())
        feed(params, grads, steps)
        ops = _device_ops(opt, device)
    except Exception as e:
        return dict(head, **{miss: f"{type(e).__name__}: {e}"[:300]})
    med = statistics.median(times)
    out = dict(
        head,
        params=numel,
        tensors=len(params),
        median_ms=1e3 * med,
        host_ms=1e3 * statistics.median(host),
        device_ops=ops,
        bytes_per_s=_bytes(name, params[0].element_size()) * numel / med,
    )
    if isinstance(opt, Gefen):
        rep = opt.memory_report()
        out.update(backend=rep["backend"], state_bytes_per_param=rep["bytes_per_param"])
    del opt, params, grads
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the 1B-parameter set")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=480, help="stop timing peers after this")
    ap.add_argument("--checks-only", action="store_true", help="check, no timing")
    ap.add_argument(
        "--interpret",
        action="store_true",
        help="run the Triton kernels under Triton's interpreter on CPU tensors (--device cpu)",
    )
    a = ap.parse_args()
    device = torch.device("cpu" if a.interpret else a.device)
    a.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    report: dict = dict(
        command=" ".join(sys.argv), torch=torch.__version__, python=platform.python_version()
    )
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    report["interpret"] = interpret
    if device.type == "cuda":
        report["device"] = torch.cuda.get_device_name(device)
    else:
        report["device"] = (platform.processor() or "cpu") + (" (Triton interpreter)" * interpret)
    probe = torch.zeros(1, device=device)
    if not (triton_backend.supports(probe, probe) and triton_backend.available(device)):
        report["build_error"] = triton_backend.build_error() or f"no Triton kernels for {device}"
        _write(a.out, report)
        sys.exit(f"Triton backend unavailable: {report['build_error']} (on the CPU: --interpret)")
    checks = []
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    for i, (name, parts) in enumerate(layouts(small=interpret)):
        for j, bits in enumerate((4, 8)):
            # the interpreter takes each layout at both widths and the three dtypes in turn
            # (every dtype meets every width over the layouts); a GPU takes every combination
            for dtype in (dtypes[(2 * i + j) % 3],) if interpret else dtypes:
                t0 = time.perf_counter()
                try:
                    checks.append(check_layout(name, parts, bits, dtype, device))
                except Exception:
                    checks.append(
                        dict(
                            layout=name,
                            bits=bits,
                            dtype=str(dtype),
                            ok=False,
                            error=traceback.format_exc()[-1500:],
                        )
                    )
                checks[-1]["s"] = time.perf_counter() - t0
    whole = [
        ("histogram", check_histogram),
        ("optimizer", functools.partial(check_optimizer, small=interpret)),
    ]
    if device.type == "cuda":
        whole += [(f"train_{m}", functools.partial(check_train, mode=m)) for m in ("ddp", "fsdp2")]
    for name, check in whole:
        t0 = time.perf_counter()
        try:
            checks.append(check(device))
        except Exception:
            checks.append(dict(check=name, ok=False, error=traceback.format_exc()[-1500:]))
        checks[-1]["s"] = time.perf_counter() - t0
    report["checks"] = checks
    report["checks_ok"] = all(c["ok"] for c in checks)
    report["check_s"] = time.perf_counter() - t_start
    if a.checks_only:
        _write(a.out, report)
        print((a.out / "gpu_check.md").read_text())
        sys.exit(0 if report["checks_ok"] else "some checks failed: see gpu_check.json")

    # 16 x 8192 x 8192 = 1.07B parameters at scale 1
    least = 16 if interpret else 64  # the interpreter steps a few thousand elements a second
    rows = max(least, int(8192 * a.scale**0.5) // least * least)
    warmup = 1 if interpret else 3
    n_tensors, cols = 16, rows
    report["copy_bytes_per_s"] = copy_bandwidth(device, min(2**28, n_tensors * rows * cols))
    timings = []
    names = [
        "adamw_fused",
        "gefen4",
        "gefen8",
        "bnb_adamw8bit",
        "torchao_adamw8bit",
        "torchao_adamw4bit",
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for name in names:
            if time.perf_counter() - t_start > a.budget_s and not name.startswith(
                ("adamw", "gefen")
            ):
                timings.append(
                    dict(optimizer=name, dtype=str(dtype), set="matrices", skipped="time budget")
                )
                continue
            shapes = matrices(n_tensors, rows, cols)
            timings.append(time_step(name, dtype, device, shapes, a.steps, "matrices", warmup))
            print(json.dumps(timings[-1]), flush=True)
    for name in names[:3]:
        shapes = gpt2_shapes(a.scale, tiny=interpret)
        timings.append(time_step(name, torch.float32, device, shapes, a.steps, "gpt2_124m", warmup))
        print(json.dumps(timings[-1]), flush=True)
    report["timings"] = timings
    report["timings_ok"] = not any("error" in t for t in timings)
    report["goals"] = goals(timings, report["copy_bytes_per_s"], interpret)
    report["total_s"] = time.perf_counter() - t_start
    _write(a.out, report)
    print((a.out / "gpu_check.md").read_text())
    if not report["checks_ok"] or not report["timings_ok"]:
        sys.exit("some checks or Gefen's own timings failed: see gpu_check.json")


def goals(timings: list[dict], copy_bps: float, interpret: bool) -> dict:
    """Gefen 4-bit on the 1B set against its goals, per dtype: the ratio to fused AdamW and
    the share of copy bandwidth, each met or not; none judged under the interpreter."""
    if interpret:
        return dict(judged=False, why="Triton interpreter on the CPU: not a GPU's times")
    out: dict = dict(judged=True)
    for dtype in sorted({t["dtype"] for t in timings if t.get("set") == "matrices"}):
        row = {
            t["optimizer"]: t
            for t in timings
            if t.get("set") == "matrices" and t["dtype"] == dtype and "median_ms" in t
        }
        if "gefen4" not in row or "adamw_fused" not in row:
            out[dtype] = dict(met=False, why="gefen4 or adamw_fused did not step")
            continue
        ratio = row["gefen4"]["median_ms"] / row["adamw_fused"]["median_ms"]
        share = row["gefen4"]["bytes_per_s"] / copy_bps
        out[dtype] = dict(
            ratio=ratio,
            copy_share=share,
            ratio_met=ratio <= GOAL_RATIO,
            copy_met=share >= GOAL_COPY,
        )
    return out


def _write(out: Path, report: dict) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    lines = [f"# Triton kernels on {report.get('device')}", "", f"`{report['command']}`", ""]
    if report.get("interpret"):
        lines += ["Under Triton's interpreter on the CPU: times are not a GPU's.", ""]
    if report.get("build_error"):
        lines.append(f"Unavailable: {report['build_error']}")
    checks = report.get("checks", [])
    bad = [c for c in checks if not c["ok"]]
    lines.append(f"Checks against the reference: {len(checks) - len(bad)}/{len(checks)} ok")
    for c in bad:
        lines.append(f"- FAILED {json.dumps(c)[:400]}")
    bw = report.get("copy_bytes_per_s")
    if report.get("timings"):
        lines += [
            "",
            f"Copy bandwidth: {bw / 1e9:.0f} GB/s",
            "",
            "| set | dtype | optimizer | median step | x fused AdamW | host | device ops | GB/s | "
            "% of copy |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        kinds = dict.fromkeys((t.get("set", "matrices"), t["dtype"]) for t in report["timings"])
        for kind, dtype in kinds:
            rows = [
                t
                for t in report["timings"]
                if (t.get("set", "matrices"), t["dtype"]) == (kind, dtype)
            ]
            ref = next(
                (t for t in rows if t["optimizer"] == "adamw_fused" and "median_ms" in t), None
            )
            for t in rows:
                if "skipped" in t or "error" in t:
                    why = "skipped" if "skipped" in t else "ERROR"
                    lines.append(
                        f"| {kind} | {dtype} | {t['optimizer']} | {why}: "
                        f"{t.get('skipped', t.get('error'))[:60]} | | | | | |"
                    )
                    continue
                ratio = f"{t['median_ms'] / ref['median_ms']:.2f}x" if ref else "-"
                lines.append(
                    f"| {kind} | {dtype} | {t['optimizer']} {t.get('backend', '')} | "
                    f"{t['median_ms']:.2f} ms | {ratio} | {t.get('host_ms', 0):.2f} ms | "
                    f"{'-' if t.get('device_ops') is None else t['device_ops']} | "
                    f"{t['bytes_per_s'] / 1e9:.0f} | "
                    f"{100 * t['bytes_per_s'] / bw:.0f} % |"
                )
    g = report.get("goals") or {}
    if g.get("judged"):
        lines += ["", f"Goals (Gefen 4-bit, 1B set): <= {GOAL_RATIO}x fused AdamW, >= "
                  f"{GOAL_COPY:.0%} of copy bandwidth"]  # fmt: skip
        for dtype, r in g.items():
            if isinstance(r, dict):
                lines.append(f"- {dtype}: {json.dumps(r)}")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
