"""Same bits as another revision: 20 steps on every backend and layout, digested, in two checkouts.

A refactor that must not change what the optimizer computes is checked here, not by timing:
from the same seed, 20 steps of a small model whose tensors take every kind of state (contiguous
blocks with the cross factor, column blocks, B = 1, 1-D) leave parameters and optimizer state
whose SHA-256 must equal the base revision's, for each of

- one process: the reference, the C++ kernel and Triton (under its interpreter, on a smaller
  model), at 4 and 8 bits, fp32 and bf16 parameters;
- two gloo ranks: FSDP2, FSDP1 (flat parameters) and DeepSpeed ZeRO-2, at 4 bits, fp32.

    python benchmarks/ab_digest.py --base REV [--json results/house_ab.json]
    python benchmarks/ab_digest.py --here DIR        # the digests of one checkout, as JSON

``--base`` checks REV out into a temporary git worktree and runs this file's ``--here`` in each
checkout (each imports its own ``gefen_dist``), then compares; exit status 1 on any difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20
SINGLE = [
    (backend, bits, dtype)
    for backend in ("reference", "native", "triton")
    for bits in (4, 8)
    for dtype in ("float32", "bfloat16")
]
DIST = ["fsdp2", "fsdp1", "zero2"]


def _model(small: bool):
    import torch
    from torch import nn

    torch.manual_seed(0)
    d, h = (16, 40) if small else (48, 200)
    return nn.Sequential(
        nn.Embedding(50, d),
        nn.Linear(d, h),
        nn.GELU(),
        nn.Linear(h, d),
        nn.LayerNorm(d),
        nn.Linear(d, 50),
    )


def _batch(step: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 50, (8, 12), generator=g)
    return x, torch.randint(0, 50, (8, 12), generator=g)


def _loss(model, step: int):
    import torch.nn.functional as F

    x, y = _batch(step)
    out = model(x)
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def _digest(tensors: dict) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous().reshape(-1)
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _state_tensors(opt) -> dict:
    import torch

    out = {}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"{i}.{k}"] = v
    return out


def single(backend: str, bits: int, dtype: str) -> str:
    import torch

    from gefen_dist import Gefen

    model = _model(small=False).to(getattr(torch, dtype))
    opt = Gefen(model.parameters(), lr=3e-3, bits=bits)
    opt.backend = backend
    for step in range(STEPS):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: p for n, p in model.named_parameters()}
    return _digest({**params, **_state_tensors(opt)})


def distributed(kind: str, out: Path) -> None:
    """One rank of a two-rank run (under torchrun); writes its digest to ``out``/rank<r>.txt."""
    import torch
    import torch.distributed as dist

    from gefen_dist import Gefen

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if kind == "zero2":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    model = _model(small=False)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, use_orig_params=False, device_id=torch.device("cpu"))
    opt = Gefen(model.parameters(), lr=3e-3, bits=4)
    engine = None
    if kind == "zero2":
        import deepspeed

        cfg = {
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 2},
            "steps_per_print": 10**6,
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    for step in range(STEPS):
        if engine is not None:
            loss = _loss(engine, step)
            engine.backward(loss)
            engine.step()
        else:
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    local = {}
    for n, p in (engine.module if engine is not None else model).named_parameters():
        local[n] = p.to_local() if hasattr(p, "to_local") else p
    digest = _digest({**local, **_state_tensors(opt)})
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.txt").write_text(digest)
    dist.destroy_process_group()


def here(checkout: Path) -> dict:
    """Every digest of the package in ``checkout`` (each run in a process of its own)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(checkout),
        "TRITON_INTERPRET": "1",
        "OMP_NUM_THREADS": "1",
    }
    script = Path(__file__).resolve()
    got = {}
    for backend, bits, dtype in SINGLE:
        r = subprocess.run(
            [sys.executable, str(script), "--one", backend, str(bits), dtype],
            cwd=checkout,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if r.returncode != 0:
            raise RuntimeError(
                f"{backend} {bits} {dtype} failed in {checkout}:\n{r.stderr[-3000:]}"
            )
        got[f"{backend}/{bits}/{dtype}"] = r.stdout.strip().splitlines()[-1]
        print(f"{checkout}: {backend}/{bits}/{dtype} done", file=sys.stderr, flush=True)
    for kind in DIST:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=2",
                f"--master-port={_free_port()}",
                str(script),
                "--rank",
                kind,
                tmp,
            ]
            r = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{kind} failed in {checkout}:\n{r.stderr[-3000:]}")
            for rank in (0, 1):
                got[f"{kind}/rank{rank}"] = (Path(tmp) / f"rank{rank}.txt").read_text()
        print(f"{checkout}: {kind} done", file=sys.stderr, flush=True)
    return got


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rev(checkout: Path) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True
    ).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", help="git revision to compare the working tree with")
    ap.add_argument("--here", type=Path, help="print the digests of this checkout")
    ap.add_argument("--json", type=Path, help="write the comparison here")
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--rank", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one or args.rank:
        import gefen_dist

        if not Path(gefen_dist.__file__).resolve().is_relative_to(Path.cwd().resolve()):
            sys.exit(f"imported {gefen_dist.__file__}, not the checkout's in {Path.cwd()}")
    if args.one:
        backend, bits, dtype = args.one
        print(single(backend, int(bits), dtype))
        return
    if args.rank:
        distributed(args.rank[0], Path(args.rank[1]))
        return
    if args.here:
        print(json.dumps(here(args.here), indent=1))
        return
    if not args.base:
        ap.error("give --base REV or --here DIR")
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base_dir), args.base],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            base = here(base_dir)
            base_rev = _rev(base_dir)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_dir)], cwd=ROOT)
    mine = here(ROOT)
    rows = {k: {"base": base[k], "here": mine.get(k), "same": base[k] == mine.get(k)} for k in base}
    result = {
        "command": "python benchmarks/ab_digest.py --base " + args.base,
        "base": base_rev,
        "here": _rev(ROOT) + (" (+ uncommitted)" if _dirty() else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "steps": STEPS,
        "identical": all(r["same"] for r in rows.values()),
        "runs": rows,
    }
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    sys.exit(0 if result["identical"] else 1)


def _dirty() -> bool:
    r = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
    return bool(r.stdout.strip())


if __name__ == "__main__":
    main()
