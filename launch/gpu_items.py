"""What launch/gpu_check.py runs, item by item, in a worker process it starts and watches.

The parent holds no device and imports no torch: it hands this worker the list of items (JSON on
stdin), reads one event per line from the pipe ``--fd`` (``start`` before an item, ``result``
after it) and writes its report after every result. An item that overruns its time, or a worker
that dies, costs that one item: the parent kills this process group and starts a fresh worker at
the next item. On CUDA a worker also ends itself after an item that raised, since a fault can
leave the context unusable for every later item.

Items, by ``kind``:

- ``probe``: torch's and triton's view of the device, its copy bandwidth (a large ``copy_``),
  and a tiny Triton kernel compiled and run (Triton builds its launcher with the host's C compiler
  and Python.h at first use: this is where a missing one shows);
- ``equal``: the kernels against the reference update, step by step from identical state, on one
  awkward layout at one width and parameter dtype (``check_layout``);
- ``histogram``: the device's g0 histogram against the CPU's;
- ``optimizer``: the whole optimizer on the device against the same on the CPU, with a resumed
  checkpoint (``check_optimizer``);
- ``step``: one optimizer's construction, first step and median ordinary step on a set of
  tensors (``time_step``);
- ``train``: launch/train.py on one rank under NCCL, then resumed from its checkpoint
  (``check_train``).

Every timed step sees the next of three gradient sets, copied into ``.grad`` before it and
outside its time (as benchmarks/step_speed.py: one fixed gradient lets m settle next to the
codebook's levels, which training does not).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import io
import json
import math
import os
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from gefen_dist import Gefen, Segment  # noqa: E402
from gefen_dist.backends import triton_backend, triton_checks  # noqa: E402
from gefen_dist.method import codebook as cb  # noqa: E402
from gefen_dist.method import partition, state  # noqa: E402
from gefen_dist.method.codes import unpack4  # noqa: E402

BACKEND = "triton"  # what every Gefen here runs on the device (the CPU twin: the reference)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# (name, [(numel, start, shape, block)] of one flat buffer): block 1 = per-element bf16 state,
# block -P = column blocks of a row of P
LAYOUTS = {
    "prime": [(7919, 0, (7919,), 1)],
    "rows": [(257 * 1031, 0, (257, 1031), 1031)],
    "odd_start_odd_block": [(4001, 37, (90, 97), 97)],
    "long_block": [(4 * 50257, 0, (4, 50257), 50257)],
    "short_blocks": [(96 * 300, 0, (300, 96), 8)],
    "columns": [(192 * 512, 0, (192, 512), -512)],
    "column_pieces": [(4001, 37, (90, 97), -97), (50, 5, (60, 97), -97), (300, 0, (300,), 1)],
    "flat_shard": [
        (1000, 24000, (200, 128), 128),
        (33, 0, (33,), 1),
        (5 * 96 + 1, 1, (6, 96), 96),
        (4096, 0, (64, 64), 64),
    ],
}
SMALL = {
    "prime": [(1999, 0, (1999,), 1)],
    "rows": [(5 * 1031, 0, (5, 1031), 1031)],
    "long_block": [(2 * 5003, 0, (2, 5003), 5003)],
    "short_blocks": [(96 * 12, 0, (12, 96), 8)],
    "columns": [(12 * 512, 0, (12, 512), -512)],
}
"""The interpreter's sizes for the layouts above that are large: the same shapes of problem (a
block of many tiles, many short blocks, columns), at sizes it steps in seconds."""


def layout(name: str, small: bool) -> list[tuple]:
    return SMALL.get(name, LAYOUTS[name]) if small else LAYOUTS[name]


# ------------------------------------------------------------------------------------ checks


def _grad(numel: int, start: int, row: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp(torch.randn((start + numel) // row + 2, generator=g))
    idx = (torch.arange(numel) + start) // row
    return (rows[idx] * torch.randn(numel, generator=g)).to(device)


def check_layout(name: str, parts: list, bits: int, dtype, device, steps: int = 4) -> dict:
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
    p_tol = triton_checks.PARAM_RTOL[dtype]
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


def check_histogram(device, small: bool = False) -> dict:
    """The g0 histogram of a piece whose first block is cut (the whole block's absmax given):
    the optimizer's (first_step.histogram) on the device against the same on the CPU, and
    the Triton kernel (triton_backend.histogram) against that too."""
    from gefen_dist.first_step import histogram

    rows = 31 if small else 301
    g = _grad(96 * rows + 5, 17, 96, 1, device)
    seg = Segment(0, g.numel(), 17, (rows + 2, 96))
    dev = torch.zeros(cb.DEFAULT_BINS, dtype=torch.float64)
    histogram(g, seg, 96, dev, {0: 7.5})
    ref = torch.zeros(cb.DEFAULT_BINS, dtype=torch.float64)
    histogram(g.cpu(), seg, 96, ref, {0: 7.5})
    counts = torch.zeros(cb.DEFAULT_BINS, dtype=torch.int64, device=device)
    triton_backend.histogram(g, 17, 96, 7.5, -1.0, counts)
    out = dict(
        equal=bool(torch.equal(dev, ref)),
        kernel_equal=bool(torch.equal(counts.cpu().double(), ref)),
    )
    return dict(out, ok=out["equal"] and out["kernel_equal"], total=float(ref.sum()))


def check_optimizer(device, small: bool = False, model: str = "gpt") -> dict:
    """The whole optimizer on the device, as a user runs it, against the same on the CPU: the
    demo GPT's parameters (``model`` "moe": the MoE LM's, grouped experts, whose batches of
    matrices are cut per matrix and factored per matrix) with the same real gradients (computed
    once, on the CPU) on both, so the first step partitions, builds the g0 histogram and learns
    the codebook from them on the device. Layouts (block sizes), codebooks and the state's bytes
    must be equal, the parameters after three steps (the interpreter's: two) must agree but for
    the rare element a code flip moved (at most one in 10^3 off by more than 10^-3 of the
    largest step), and a state_dict saved on the device must load into a fresh optimizer and
    step as the original does. The per-kernel checks start from state set by hand, so they never
    ran this path."""
    import torch.nn.functional as F

    from gefen_dist.bench.moe import MoEConfig, MoELM
    from gefen_dist.demo.corpus import get_batch, load_corpus
    from gefen_dist.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    # the interpreter's model is smaller, the same in kind (its time goes with the programs)
    steps, block = (2, 32) if small else (3, 64)
    if model == "moe":
        # experts of 64 x 80: the least matrices a batch takes (4096 elements)
        dims = dict(dim=64, hidden=80, n_layers=1, n_experts=4) if small else {}
        lm = MoELM(MoEConfig(seq=block, **dims))
    else:
        size = dict(n_layer=1, n_embd=16) if small else dict(n_layer=2, n_embd=128)
        lm = GPT(GPTConfig(n_head=4, block_size=block, **size))
    train, _ = load_corpus(2**18)
    batches = torch.Generator().manual_seed(0)
    grads = []
    for _ in range(steps + 1):
        lm.zero_grad(set_to_none=True)
        x, y = get_batch(train, 4, block, batches)
        if model == "moe":
            F.cross_entropy(lm(x).flatten(0, 1), y.flatten()).backward()
        else:
            lm(x, y)[1].backward()
        grads.append([q.grad.clone() for q in lm.parameters()])
    out: dict = dict(ok=False)
    runs = []
    for where, backend in (("cpu", "reference"), (device, BACKEND)):
        params = [torch.nn.Parameter(q.detach().clone().to(where)) for q in lm.parameters()]
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
    cpu_bytes = oc.memory_report()["bytes_per_param"]
    out["state_bytes_per_param"] = od.memory_report()["bytes_per_param"]
    out["state_bytes_equal"] = out["state_bytes_per_param"] == cpu_bytes
    moved = max(
        float((a.detach() - q.detach()).abs().max())
        for a, q in zip(pc, lm.parameters(), strict=True)
    )
    off = sum(
        int(((a.detach() - b.detach().cpu()).abs() > 1e-3 * moved).sum())
        for a, b in zip(pc, pd, strict=True)
    )
    out["p_off_frac"] = off / sum(a.numel() for a in pc)
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
    # what the MoE model is there for: batches of matrices, factored per matrix
    views = [(od.segments_of(q), od.state[q]) for q in pd]
    out["batches"] = sum(partition.matrix_batch(tuple(q.shape)) is not None for q in pd)
    out["factored_per_matrix"] = sum(
        any(
            state.cross_groups(seg, int(row[3])) > 1
            for seg, row in zip(segs, st["layout"], strict=True)
        )
        for segs, st in views
    )
    out["ok"] = (
        (model != "moe" or out["factored_per_matrix"] > 0)
        and out["layouts_equal"]
        and out["codebooks_equal"]
        and out["state_bytes_equal"]
        and out["p_off_frac"] <= 1e-3
        and out["resumed_equal"]
    )
    return out


TRAIN_SMALL = ["--set", "model.n_embd=32", "--set", "model.block_size=16",
               "--set", "data.batch_size=2", "--set", "data.val_batches=1",
               "--set", "data.max_bytes=65536"]  # fmt: skip
"""The CPU's sizes for check_train (its tests run it there): the same script, a tiny model."""


def check_train(device, mode: str, timeout_s: float = 90) -> dict:
    """launch/train.py on one rank (torchrun; NCCL on a GPU) under ``mode``'s run config: four
    steps saving a checkpoint at step 2, then a fresh launch resumed from it. The training
    script's device path and Gefen under that sharding with a real process group, which only a
    GPU runs (on the CPU the distributed tests cover the script). ``ok``: both launches ran
    and the resumed one continued from step 2 to a finite loss; ``resumed_equal``: its losses
    are the uninterrupted run's bit for bit (a GPU's kernels need not be deterministic)."""
    import subprocess
    import tempfile

    end = time.monotonic() + timeout_s
    config = ROOT / "configs" / "run" / f"{mode}.yaml"
    size = [] if device.type == "cuda" else TRAIN_SMALL
    # the package from this checkout, installed or not (a lent GPU has it only here)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    if device.type == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = str(device.index or 0)
    out: dict = dict(mode=mode, ok=False)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        ck = Path(tmp) / "ck"
        for name, extra in (
            ("saving", ["--set", f"checkpoint.dir={ck}", "--set", "checkpoint.save_at=2"]),
            ("resumed", ["--resume", str(ck)]),
        ):
            res_file = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "1", str(ROOT / "launch" / "train.py"),
                   "--config", str(config), "--set", "steps=4", "--set", f"device={device.type}",
                   *size, "--no-progress", "--out", str(res_file), *extra]  # fmt: skip
            try:
                r = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    timeout=max(1.0, end - time.monotonic()),
                    env=env,
                )
            except subprocess.TimeoutExpired as e:
                tail = (e.stdout or b"")[-800:] + (e.stderr or b"")[-800:]
                out[name] = dict(rc=None, error=f"timed out: {tail!r}"[-1500:])
                return out
            res = json.loads(res_file.read_text()) if res_file.exists() else {}
            runs[name] = res
            curve = res.get("curve", [])
            out[name] = dict(rc=r.returncode, val_loss=curve[-1].get("val_loss") if curve else None)
            if r.returncode != 0:
                out[name]["error"] = (r.stdout + r.stderr)[-1500:]
                return out
    saving, resumed = runs["saving"], runs["resumed"]
    last = out["resumed"]["val_loss"]
    out["resumed_from_step"] = resumed.get("resumed_from_step")
    out["val_loss"] = last
    out["resumed_equal"] = resumed.get("curve") == saving.get("curve")
    a = [c.get("val_loss") for c in saving.get("curve", [])]
    b = [c.get("val_loss") for c in resumed.get("curve", [])]
    if len(a) == len(b) and all(x is not None and y is not None for x, y in zip(a, b, strict=True)):
        out["max_val_loss_diff"] = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
    out["ok"] = out["resumed_from_step"] == 2 and last is not None and math.isfinite(last)
    return out


# ------------------------------------------------------------------------------------ timing


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def copy_bandwidth(device, numel: int) -> float:
    """Bytes read and written per second by a large ``copy_`` (median of 10)."""
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


def build(name: str, params):
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


def gpt2_shapes(kind: str) -> list[tuple[int, ...]]:
    """GPT-2 124M's 148 parameter shapes (``kind`` "124m"); narrower ("narrow": d = 64, vocab
    512), the same 148 tensors; "tiny", the interpreter's: d = 16, vocab 64, 2 of the 12
    layers (28 tensors)."""
    d, vocab, ctx, n = {
        "124m": (768, 50257, 1024, 12),
        "narrow": (64, 512, 128, 12),
        "tiny": (16, 64, 32, 2),
    }[kind]
    layer = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,)]
    layer += [(4 * d, d), (d,)]
    return [(vocab, d), (ctx, d), *layer * n, (d,), (d,)]


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


def time_step(name: str, dtype, device, shapes, steps: int, warmup: int) -> dict:
    """One optimizer on ``shapes``: its construction and first step timed apart (Gefen's first
    step partitions and learns its codebook from the first gradients), then ``warmup`` more
    steps and the median of ``steps`` timed ones. A peer that is missing or fails is skipped;
    Gefen or fused AdamW failing is an error."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02) for s in shapes]
    scales = [torch.randn(s[0], *[1] * (len(s) - 1), device=device).exp() for s in shapes]
    grads = [
        [(torch.randn(s, device=device) * r).to(dtype) for s, r in zip(shapes, scales, strict=True)]
        for _ in range(3)
    ]
    del scales
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g.clone()
    numel = sum(p.numel() for p in params)
    head = dict(optimizer=name, dtype=str(dtype), params=numel, tensors=len(params))
    miss = "error" if name.startswith(("gefen", "adamw")) else "skipped"
    try:
        _sync(device)
        t0 = time.perf_counter()
        opt = build(name, params)
        _sync(device)
        build_s = time.perf_counter() - t0
    except Exception as e:
        return dict(head, **{miss: f"{type(e).__name__}: {e}"[:300]})
    try:
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        first_s = time.perf_counter() - t0
        for t in range(1, 1 + warmup):
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
        build_s=build_s,
        first_step_s=first_s,
        first_step_x=first_s / med,
        median_ms=1e3 * med,
        host_ms=1e3 * statistics.median(host),
        device_ops=ops,
        bytes_per_s=_bytes(name, params[0].element_size()) * numel / med,
    )
    if isinstance(opt, Gefen):
        rep = opt.memory_report()
        out.update(backend=rep["backend"], state_bytes_per_param=rep["bytes_per_param"])
    return out


# ------------------------------------------------------------------------------------- probe


def _triton_smoke(device) -> dict:
    """A kernel of one line compiled and run: on a GPU the first use of Triton's compiler and of
    the launcher it builds with the host's C compiler."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x, n, TILE: tl.constexpr):
        i = tl.program_id(0) * TILE + tl.arange(0, TILE)
        tl.store(x + i, tl.load(x + i, mask=i < n) + 1.0, mask=i < n)

    x = torch.zeros(1000, device=device)
    t0 = time.perf_counter()
    add_one[(4,)](x, 1000, TILE=256)
    _sync(device)
    return dict(smoke_s=time.perf_counter() - t0, smoke_ok=bool((x == 1).all()))


def probe(device, copy_numel: int) -> dict:
    import numpy

    out: dict = dict(
        torch=torch.__version__, torch_cuda=torch.version.cuda, numpy=numpy.__version__
    )
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception as e:
        out["triton"] = f"not importable: {type(e).__name__}: {e}"
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        out.update(
            device=prop.name,
            capability=f"{prop.major}.{prop.minor}",
            multiprocessors=prop.multi_processor_count,
            memory_gib=prop.total_memory / 2**30,
        )
    else:
        out["device"] = "cpu" + " (Triton interpreter)" * triton_backend.interpreting()
    out["copy_bytes_per_s"] = copy_bandwidth(device, copy_numel)
    try:
        out.update(_triton_smoke(device))
    except Exception as e:
        out.update(smoke_ok=False, smoke_error=f"{type(e).__name__}: {e}"[-1500:])
    probe_t = torch.zeros(1, device=device)
    usable = triton_backend.supports(probe_t, probe_t) and triton_backend.available(device)
    out["backend_error"] = None if usable else triton_backend.build_error(device) or "unsupported"
    out["variants"] = sorted(_variant(n, c) for n, _, c in triton_checks.variants())
    for name in ("bitsandbytes", "torchao"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:
            out[name] = f"not importable: {type(e).__name__}: {e}"[:300]
    out["ok"] = bool(out.get("smoke_ok")) and out["backend_error"] is None
    return out


def _variant(name: str, const) -> str:
    return name + "".join(f" {k}={v}" for k, v in sorted(dict(const).items()))


# ------------------------------------------------------------------------------------ worker


def run_item(item: dict, cfg: dict, device) -> dict:
    kind = item["kind"]
    if kind == "probe":
        return probe(device, cfg["copy_numel"])
    if kind == "equal":
        parts = layout(item["layout"], cfg["small"])
        steps = 2 if cfg["small"] else 4  # the second step starts from state the first wrote
        dtype = DTYPES[item["dtype"]]
        return check_layout(item["layout"], parts, item["bits"], dtype, device, steps)
    if kind == "histogram":
        return check_histogram(device, small=cfg["small"])
    if kind == "optimizer":
        return check_optimizer(device, small=cfg["small"], model=item.get("model", "gpt"))
    if kind == "train":
        return check_train(device, item["mode"], timeout_s=item["timeout_s"])
    if kind == "step":
        if item["set"] == "matrices":
            shapes = [(cfg["rows"], cfg["rows"])] * cfg["tensors"]
        else:
            shapes = gpt2_shapes(cfg["gpt2"])
        return time_step(
            item["optimizer"], DTYPES[item["dtype"]], device, shapes, cfg["steps"], cfg["warmup"]
        )
    raise ValueError(f"item {item['name']!r}: unknown kind {kind!r}")


def _die_with_parent(parent: int) -> None:
    """The kernel ends this worker when its parent dies, SIGKILL included (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != parent:
        os._exit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description="a worker of launch/gpu_check.py")
    ap.add_argument("--fd", type=int, required=True, help="the pipe the events go to")
    ap.add_argument("--parent", type=int, required=True, help="the parent's pid")
    a = ap.parse_args()
    _die_with_parent(a.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this one stops
    job = json.load(sys.stdin)
    cfg, items = job["config"], job["items"]
    events = os.fdopen(a.fd, "w", buffering=1)
    device = torch.device(cfg["device"])

    def emit(**event) -> None:
        events.write(json.dumps(event, default=str) + "\n")
        events.flush()

    for item in items:
        emit(event="start", item=item["name"])
        before = set(triton_backend.SIGNATURES)
        raised = False
        try:
            result = run_item(item, cfg, device)
        except Exception:
            raised = True
            result = dict(ok=False, error=traceback.format_exc()[-1500:])
        ran = set(triton_backend.SIGNATURES) - before
        if ran:
            result["variants_run"] = sorted(_variant(n, c) for n, c in ran)
        emit(event="result", item=item["name"], result=result)
        gc.collect()
        if device.type == "cuda":
            try:
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
            except Exception:
                raised = True
            if raised:  # a fault may have left the context unusable: the parent starts anew
                events.close()
                os._exit(3)
    events.close()


if __name__ == "__main__":
    main()
