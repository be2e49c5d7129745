"""Microbatch capacity: the largest microbatch that trains under a fixed memory budget, per
optimizer, single process and 2-rank DDP and FSDP2 (gloo), with its tokens/s.

Why this way: optimizer state is only worth saving if the memory it frees buys a larger
microbatch. On this CPU machine "memory" is the resident set of the training process. The
parent imports every optimizer's package and steps each once on a tiny layer (numba's kernels,
bitsandbytes' library, torchao's compiler loaded), then forks one child per probe (two, one per
rank, joined by a gloo process group, for DDP/FSDP2). A child reads its RSS (the *baseline*:
the same process image for every optimizer, so no optimizer's imports count against it),
resets the kernel's peak counter (VmHWM), builds the GPT and its optimizer and runs a few real
steps on the stdlib corpus at microbatch b; its peak is VmHWM. The budget applies to the *net*
peak, peak - baseline, per rank: what training itself holds, the analogue of
``torch.cuda.max_memory_allocated``. The probes run on the CPU even where a GPU is present, as
the rest of the bench: a forked child cannot use a CUDA context its parent may have made, and a
GPU's capacity is a different measurement (its allocator's peak, NCCL ranks) that no GPU here
could check.
Baseline and total peak are both in the report.

Search per optimizer: galloping (offsets 1, 2, 4, ... from a start) then bisection, one probe
per fork, assuming the net peak grows with b. The first optimizer starts at b = 1; later ones
start from a guess (their own b = 1 probe plus the per-sample slope measured for the first),
which only saves probes: every reported microbatch was probed and fitted, with b + 1 probed
and not fitted.

torchao runs compiled, as it ships (eager torchao allocates several int64 tensors per element
while quantising); its per-shape compilation in the child counts in its net peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

MiB = 2**20
MARK = "CAPACITY_PROBE "


@dataclass(frozen=True)
class Setup:
    """The workload: a wide, short-sequence GPT, so optimizer state is a big share of memory."""

    n_layer: int = 4
    n_head: int = 8
    n_embd: int = 512
    block_size: int = 16
    steps: int = 3
    lr: float = 1e-3
    budget_mib: float = 260.0

    def gpt_config(self):
        from gefen_dist.demo.model import GPTConfig

        return GPTConfig(
            block_size=self.block_size, n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd
        )

    def optimizer(self, name: str, model):
        """``name`` built the same way in the preload and in every probe."""
        from gefen_dist.bench import peers

        return peers.build(
            name,
            model,
            self.lr,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            dim=self.n_embd,
            n_heads=self.n_head,
            n_kv_heads=self.n_head,
        )


DIST_OPTIMIZERS = ("adamw", "gefen4", "gefen8", "bnb_adamw8bit", "torchao_adamw4bit", "adam_mini")
"""Under DDP/FSDP2: AdamW, Gefen, and the smallest-state peer of each kind with momentum
(8-bit, 4-bit, shared-v); torchao 8-bit keeps what bitsandbytes does and SM3 what Adam-mini
does (4 bytes/param of momentum), so each mode stays ~6 minutes on 2 shared cores."""

SMOKE = Setup(n_layer=1, n_head=8, n_embd=512, block_size=8, steps=2, budget_mib=110.0)


def rss_now() -> int:
    """Current resident set, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    """VmHWM: the kernel's peak RSS of this process since the last reset."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


_CORPUS: list = []
_UNAVAILABLE: dict[str, str] = {}


def _trim() -> None:
    """Give freed heap back to the OS, so a child cannot reuse pages it did not count."""
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def preload(optimizers: list[str], setup: Setup) -> None:
    """In the parent, before any probe forks: import every optimizer's package and run one
    b = 1 step of each on the probe's model (numba's kernels, bitsandbytes' library and
    torchao's compiled kernels for every shape loaded), then free it and trim the heap. Every
    probe then starts from the same process image, so no optimizer's imports, JIT or compiler
    memory is counted in its net peak (all are in everyone's baseline), as on a GPU, where
    they would be host memory."""
    import torch

    from gefen_dist.bench import peers
    from gefen_dist.demo.corpus import get_batch, load_corpus
    from gefen_dist.demo.model import GPT

    torch.set_num_threads(1)
    if not _CORPUS:
        _CORPUS.append(load_corpus(max_bytes=1 * MiB)[0])
    gen = torch.Generator().manual_seed(0)
    for name in optimizers:
        model = GPT(setup.gpt_config())
        try:
            opt = setup.optimizer(name, model)
            for _ in range(2):
                x, y = get_batch(_CORPUS[0], 1, setup.block_size, gen)
                model(x, y)[1].backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            del opt
        except peers.Unavailable as e:
            _UNAVAILABLE[name] = str(e)
        del model
    _trim()


def _wrap(model, mode: str):
    import torch

    if mode == "single":
        return model
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # on the CPU even where a GPU is present (FSDP2's default mesh would take the GPU)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def probe(spec: dict, rank: int = 0) -> dict:
    """Train ``spec['steps']`` steps at microbatch ``spec['b']``; this rank's measurements.

    Runs in a forked child: net peak = VmHWM (reset after the process group is up) minus the
    RSS at that moment."""
    import torch

    from gefen_dist.demo.corpus import get_batch
    from gefen_dist.demo.model import GPT

    mode, name, b = spec["mode"], spec["optimizer"], spec["b"]
    s = Setup(**spec["setup"])
    out: dict = dict(rank=rank)
    if name in _UNAVAILABLE:
        return dict(out, error=_UNAVAILABLE[name])
    _trim()
    out["baseline_bytes"] = rss_now()
    _reset_peak()
    torch.manual_seed(0)
    model = _wrap(GPT(s.gpt_config()), mode)
    gen = torch.Generator().manual_seed(1 + rank)
    times = []
    try:
        opt = s.optimizer(name, model)
        for _ in range(s.steps):
            x, y = get_batch(_CORPUS[0], b, s.block_size, gen)
            t0 = time.perf_counter()
            loss = model(x, y)[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
    except Exception as e:  # a peer that refuses this wrapping (e.g. DTensor) is reported
        import traceback

        where = traceback.format_exc().strip().splitlines()[-3:-1]
        return dict(out, error=f"{type(e).__name__}: {str(e)[:300]} at {' | '.join(where)}")
    out.update(
        peak_bytes=_peak_rss(),
        step_s=statistics.median(times[1:] or times),
        state_bytes=_state_bytes(opt),
        loss=float(loss.detach()),
    )
    return out


def _state_bytes(opt) -> int:
    """``peers.state_bytes``; for FSDP2's DTensor state (which it does not unpack in this
    torch), the bytes of each state tensor's local shard, each storage once."""
    from gefen_dist.bench import peers

    try:
        return peers.state_bytes(opt)
    except AttributeError:
        seen: dict[int, int] = {}
        for st in opt.state.values():
            for v in st.values():
                if hasattr(v, "to_local"):
                    v = v.to_local()
                if isinstance(v, __import__("torch").Tensor):
                    for leaf in peers._leaves(v):
                        s = leaf.untyped_storage()
                        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return sum(seen.values())


def _rank_main(spec: dict, rank: int, world: int, port: int, conn) -> None:
    """Body of a forked probe process; never returns into the parent's code (os._exit)."""
    code = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if world > 1:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}"
            )
        res = probe(spec, rank)
        if world > 1:
            dist.barrier()
        conn.send(res)
        if world > 1:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001  the parent must hear of every failure
        import traceback

        where = " | ".join(traceback.format_exc().strip().splitlines()[-3:-1])
        conn.send(dict(rank=rank, error=f"{type(e).__name__}: {str(e)[:300]} at {where}"))
        code = 1
    finally:
        os._exit(code)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_probe(optimizer: str, b: int, mode: str, setup: Setup, timeout: float = 300) -> dict:
    """One probe in its own forked process (two, one per rank, for DDP/FSDP2)."""
    import multiprocessing as mp

    spec = dict(optimizer=optimizer, b=b, mode=mode, setup=asdict(setup))
    world = 1 if mode == "single" else 2
    ctx = mp.get_context("fork")
    port = _free_port()
    t0 = time.perf_counter()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [
        ctx.Process(target=_rank_main, args=(spec, r, world, port, pipes[r][1]))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    ranks: list[dict] = []
    for r, (recv, _) in enumerate(pipes):
        left = max(1.0, timeout - (time.perf_counter() - t0))
        try:
            ranks.append(
                recv.recv()
                if recv.poll(left)
                else dict(rank=r, error=f"probe timed out after {timeout} s")
            )
        except EOFError:
            ranks.append(dict(rank=r, error="probe process died without a result"))
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
    wall = time.perf_counter() - t0
    ranks.sort(key=lambda r: r["rank"])
    rec = dict(optimizer=optimizer, b=b, mode=mode, wall_s=wall, ranks=ranks)
    errs = [r["error"] for r in ranks if "error" in r]
    if errs:
        return dict(rec, ok=False, error=errs[0])
    net = max(r["peak_bytes"] - r["baseline_bytes"] for r in ranks)
    tokens = b * setup.block_size * world
    return dict(
        rec,
        ok=True,
        net_peak_bytes=net,
        baseline_bytes=max(r["baseline_bytes"] for r in ranks),
        peak_bytes=max(r["peak_bytes"] for r in ranks),
        fits=net <= setup.budget_mib * MiB,
        tokens_per_s=tokens / max(r["step_s"] for r in ranks),
        state_bytes=max(r["state_bytes"] for r in ranks),
    )


def search(
    fits: Callable[[int], bool],
    start: int = 1,
    b_max: int = 4096,
    known: dict[int, bool] | None = None,
) -> int:
    """Largest b in [1, b_max] with ``fits(b)``, assuming fits is monotone (0 if none fits).

    Gallop from ``start`` by offsets 1, 2, 4, ... (up while it fits, down while it does not),
    then bisect the bracket; ``fits`` is called once per b at most."""
    memo: dict[int, bool] = dict(known or {})

    def f(b: int) -> bool:
        if b not in memo:
            memo[b] = fits(b)
        return memo[b]

    start = max(1, min(start, b_max))
    if f(start):
        lo, hi, step = start, None, 1
        while hi is None:
            nxt = lo + step
            if nxt > b_max:
                if lo == b_max or f(b_max):
                    return b_max
                hi = b_max
            elif f(nxt):
                lo, step = nxt, step * 2
            else:
                hi = nxt
    else:
        hi, lo, step = start, None, 1
        while lo is None:
            nxt = hi - step
            if nxt < 1:
                if hi == 1 or not f(1):
                    return 0
                lo = 1
            elif f(nxt):
                lo = nxt
            else:
                hi, step = nxt, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if f(mid):
            lo = mid
        else:
            hi = mid
    return lo


def capacity(
    optimizer: str,
    mode: str,
    setup: Setup,
    guess: int = 1,
    log: Callable[[dict], None] = lambda r: None,
    first: list[dict] | None = None,
) -> dict:
    """Search one optimizer's largest fitting microbatch; every probe is kept."""
    probes: list[dict] = list(first or [])
    failed: list[str] = []

    def fits(b: int) -> bool:
        r = run_probe(optimizer, b, mode, setup)
        probes.append(r)
        log(r)
        if not r["ok"]:
            failed.append(r["error"])
            raise _Stop
        return r["fits"]

    try:
        best = search(fits, guess, known={p["b"]: p["fits"] for p in probes if p["ok"]})
    except _Stop:
        return dict(optimizer=optimizer, mode=mode, best=None, error=failed[-1], probes=probes)
    at = next((p for p in probes if p["b"] == best), None)
    return dict(
        optimizer=optimizer,
        mode=mode,
        best=best,
        probes=probes,
        tokens_per_s=at["tokens_per_s"] if at else None,
        net_peak_bytes=at["net_peak_bytes"] if at else None,
        baseline_bytes=at["baseline_bytes"] if at else None,
        peak_bytes=at["peak_bytes"] if at else None,
        state_bytes=at["state_bytes"] if at else None,
    )


class _Stop(Exception):
    pass


def per_sample_slope(probes: list[dict]) -> float | None:
    """Least-squares bytes of net peak per sample of microbatch, over successful probes."""
    pts = [(p["b"], p["net_peak_bytes"]) for p in probes if p.get("ok")]
    if len({b for b, _ in pts}) < 2:
        return None
    mb = statistics.fmean(b for b, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    num = sum((b - mb) * (y - my) for b, y in pts)
    den = sum((b - mb) ** 2 for b, _ in pts)
    return num / den if den else None


def guess_from(slope: float | None, one: dict | None, budget: float) -> int:
    if not slope or slope <= 0 or not one or not one.get("ok"):
        return 1
    return max(1, 1 + int((budget - one["net_peak_bytes"]) / slope))


def secant(one: dict, other: dict, budget: float) -> int | None:
    """The b where the line through two probes' net peaks meets the budget."""
    if not (one.get("ok") and other.get("ok")) or other["b"] == one["b"]:
        return None
    slope = (other["net_peak_bytes"] - one["net_peak_bytes"]) / (other["b"] - one["b"])
    if slope <= 0:
        return None
    return max(1, one["b"] + int((budget - one["net_peak_bytes"]) / slope))


def run_mode(
    mode: str, optimizers: list[str], setup: Setup, log: Callable[[dict], None]
) -> list[dict]:
    """All optimizers under one mode. The first searches from b = 1; each later one probes
    b = 1 and a guess from the first one's per-sample slope, then searches from where the line
    through its own two probes meets the budget (fewer probes; every answer still probed)."""
    results: list[dict] = []
    slope = None
    budget = setup.budget_mib * MiB
    for name in optimizers:
        if not slope:
            res = capacity(name, mode, setup, 1, log)
            slope = per_sample_slope(res["probes"])
            results.append(res)
            continue
        one = run_probe(name, 1, mode, setup)
        log(one)
        if not one["ok"]:
            results.append(
                dict(optimizer=name, mode=mode, best=None, error=one["error"], probes=[one])
            )
            continue
        known = [one]
        guess = guess_from(slope, one, budget)
        if guess > 1 and one["fits"]:
            two = run_probe(name, guess, mode, setup)
            log(two)
            if two["ok"]:
                known.append(two)
                guess = secant(one, two, budget) or guess
        res = capacity(name, mode, setup, guess, log, first=known)
        results.append(res)
    return results


def _mib(r: dict, k: str) -> str:
    return f"{r[k] / MiB:.0f}" if r.get(k) is not None else "-"


def table(results: list[dict], setup: Setup) -> str:
    """Markdown: per mode and optimizer, the largest fitting microbatch and its measurements."""
    from gefen_dist.bench import peers

    lines = [
        "| mode | budget MiB | optimizer | momentum | largest microbatch | tokens/s | "
        "net peak MiB | baseline MiB | total peak MiB | state MiB/rank | probes |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        peer = peers.PEERS[r["optimizer"]]
        n = len(r["probes"])
        mode = f"{r['mode']} | {r.get('budget_mib', setup.budget_mib):.0f}"
        if r.get("best") is None:
            lines.append(
                f"| {mode} | {peer.label} | {peer.momentum} | n/a: "
                f"{r['error'][:80]} | | | | | | {n} |"
            )
            continue
        tps = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "-"
        state = f"{r['state_bytes'] / MiB:.1f}" if r.get("state_bytes") is not None else "-"
        lines.append(
            f"| {mode} | {peer.label} | {peer.momentum} | {r['best']} | {tps} | "
            f"{_mib(r, 'net_peak_bytes')} | {_mib(r, 'baseline_bytes')} | "
            f"{_mib(r, 'peak_bytes')} | {state} | {n} |"
        )
    return "\n".join(lines)


def verdict(results: list[dict]) -> list[str]:
    """Per mode: does each Gefen fit a larger microbatch than AdamW and every momentum peer?"""
    from gefen_dist.bench import peers

    out = []
    for mode in dict.fromkeys(r["mode"] for r in results):
        rs = {r["optimizer"]: r for r in results if r["mode"] == mode}
        for g in ("gefen4", "gefen8"):
            if g not in rs or rs[g].get("best") is None:
                continue
            others = [
                o
                for o, r in rs.items()
                if not o.startswith("gefen")
                and peers.PEERS[o].momentum
                and r.get("best") is not None
            ]
            beaten = [o for o in others if rs[g]["best"] > rs[o]["best"]]
            lost = [f"{o} ({rs[o]['best']})" for o in others if o not in beaten]
            label = f"{mode}: {peers.PEERS[g].label} microbatch {rs[g]['best']}"
            if not others or not rs[g]["best"]:
                out.append(f"{label}: no comparison (nothing fitted or no momentum peer ran)")
            elif lost:
                out.append(f"{label} not > every momentum peer; not larger than {', '.join(lost)}")
            else:
                out.append(f"{label} > every momentum peer that ran ({', '.join(others)})")
    return out


def plot(results: list[dict], path: Path, setup: Setup) -> None:
    """Bars: largest microbatch per optimizer, one panel per mode; tokens/s written on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gefen_dist.bench import peers

    modes = list(dict.fromkeys(r["mode"] for r in results))
    fig, axes = plt.subplots(
        1, len(modes), figsize=(max(8.0, 5.8 * len(modes)), 5.5), squeeze=False
    )
    for ax, mode in zip(axes[0], modes, strict=True):
        rs = [r for r in results if r["mode"] == mode]
        labels = [peers.PEERS[r["optimizer"]].label.replace(" (", "\n(") for r in rs]
        vals = [r["best"] or 0 for r in rs]
        colors = [
            "tab:green"
            if r["optimizer"].startswith("gefen")
            else ("tab:gray" if not peers.PEERS[r["optimizer"]].momentum else "tab:blue")
            for r in rs
        ]
        bars = ax.barh(range(len(rs)), vals, color=colors)
        for bar, r in zip(bars, rs, strict=True):
            txt = (
                f" {r['best']}  ({r['tokens_per_s']:.0f} tok/s)"
                if r.get("tokens_per_s")
                else " n/a"
                if r.get("best") is None
                else f" {r['best']}"
            )
            ax.text(
                bar.get_width(), bar.get_y() + bar.get_height() / 2, txt, va="center", fontsize=8
            )
        ax.set_yticks(range(len(rs)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("largest microbatch that fits (sequences per rank)")
        budget = rs[0].get("budget_mib", setup.budget_mib)
        ax.set_title(f"{mode}: budget {budget:.0f} MiB net RSS per rank")
        ax.set_xlim(0, max(vals + [1]) * 1.45)
    fig.suptitle(
        f"Largest microbatch under a memory budget: GPT {setup.n_layer} layers "
        f"x d={setup.n_embd}, seq {setup.block_size}, CPU\n"
        "green: Gefen, blue: peers with momentum, gray: no momentum; "
        "tokens/s at that microbatch in brackets",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    from gefen_dist.bench import peers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/bench/capacity")
    ap.add_argument(
        "--optimizers",
        default=",".join(peers.DEFAULT),
        help="the first one sets the per-sample slope; AdamW by default",
    )
    ap.add_argument("--modes", default="single,ddp,fsdp2")
    ap.add_argument(
        "--dist-optimizers",
        default=",".join(DIST_OPTIMIZERS),
        help="those run under DDP and FSDP2 (time: ~1 min per optimizer and mode)",
    )
    ap.add_argument("--budget-mib", type=float, help="net peak RSS per rank (MiB)")
    ap.add_argument("--n-embd", type=int)
    ap.add_argument("--n-layer", type=int)
    ap.add_argument("--block-size", type=int)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny model, AdamW and Gefen 4-bit, single process (< 60 s)",
    )
    ap.add_argument(
        "--merge",
        action="append",
        default=[],
        metavar="DIR",
        help="with --replot: take these runs' modes (their own budgets) from DIR",
    )
    ap.add_argument(
        "--replot",
        action="store_true",
        help="rewrite capacity.md and capacity.png from --out's capacity.json",
    )
    args = ap.parse_args(argv)
    if args.replot:
        _write(Path(args.out), None, [Path(m) for m in args.merge])
        return
    setup = SMOKE if args.smoke else Setup()
    over = {
        k: v
        for k, v in dict(
            budget_mib=args.budget_mib,
            n_embd=args.n_embd,
            n_layer=args.n_layer,
            block_size=args.block_size,
        ).items()
        if v is not None
    }
    setup = Setup(**{**asdict(setup), **over})
    optimizers = [o for o in args.optimizers.split(",") if o]
    modes = [m for m in args.modes.split(",") if m]
    if args.smoke:
        optimizers = [o for o in optimizers if o in ("adamw", "gefen4")] or ["adamw", "gefen4"]
        modes = ["single"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    preload(optimizers, setup)

    def log(r: dict) -> None:
        if r["ok"]:
            print(
                f"  {r['mode']:6} {r['optimizer']:18} b={r['b']:4}  net "
                f"{r['net_peak_bytes'] / MiB:7.1f} MiB  (base {r['baseline_bytes'] / MiB:.0f})"
                f"  {'fits' if r['fits'] else 'over'}  {r['wall_s']:.1f} s",
                flush=True,
            )
        else:
            print(
                f"  {r['mode']:6} {r['optimizer']:18} b={r['b']:4}  error: {r['error'][-200:]}",
                flush=True,
            )

    dist_opts = [o for o in args.dist_optimizers.split(",") if o in optimizers]
    results: list[dict] = []
    for mode in modes:
        print(f"{mode}:", flush=True)
        results += run_mode(mode, optimizers if mode == "single" else dist_opts, setup, log)
        (out / "capacity.json").write_text(
            json.dumps(
                dict(setup=asdict(setup), results=results, wall_s=time.perf_counter() - t0),
                indent=1,
            )
        )
    _write(out, dict(setup=asdict(setup), results=results, wall_s=time.perf_counter() - t0))


def _write(out: Path, data: dict | None, merge: list[Path] | None = None) -> None:
    """capacity.json (when given new data), capacity.md and capacity.png; ``merge``: other
    runs' folders whose modes replace this run's (e.g. FSDP2 run with its own budget)."""
    if data is None:
        data = json.loads((out / "capacity.json").read_text())
        if "wall_s" not in data and (out / "capacity.md").exists():  # written by an older run
            import re

            m = re.search(r"Wall time (\d+) s", (out / "capacity.md").read_text())
            data["wall_s"] = float(m.group(1)) if m else float("nan")
    setup, results = Setup(**data["setup"]), data["results"]
    for r in results:
        r.setdefault("budget_mib", setup.budget_mib)
    for other in merge or []:
        more = json.loads((other / "capacity.json").read_text())
        budget = more["setup"]["budget_mib"]
        done = {r["mode"] for r in more["results"]}
        results[:] = [r for r in results if r["mode"] not in done]
        results += [dict(r, budget_mib=r.get("budget_mib", budget)) for r in more["results"]]
        data.setdefault("merged", []).append(
            dict(dir=str(other), setup=more["setup"], wall_s=more.get("wall_s"))
        )
    lines = verdict(results)
    data["verdict"] = lines
    extra = "".join(
        f" Merged: {m['dir']} (budget {m['setup']['budget_mib']:.0f} MiB, "
        f"{m['wall_s'] or float('nan'):.0f} s)."
        for m in data.get("merged", [])
    )
    text = (
        f"Budget: {setup.budget_mib:.0f} MiB of net peak RSS per rank (VmHWM of the forked "
        f"probe minus its RSS at the fork: every optimizer imported and warmed up in the "
        f"parent, so the baseline is the same for all). GPT {setup.n_layer} layers, "
        f"d={setup.n_embd}, {setup.n_head} heads, seq {setup.block_size}, byte-level, "
        f"stdlib corpus; {setup.steps} steps per probe, tokens/s from the median step after "
        f"the first (all ranks' tokens). Wall time {data['wall_s']:.0f} s.{extra}\n\n"
        + table(results, setup)
        + "\n\n"
        + "\n".join(f"- {v}" for v in lines)
        + "\n"
    )
    (out / "capacity.md").write_text(text)
    (out / "capacity.json").write_text(json.dumps(data, indent=1))
    plot(results, out / "capacity.png", setup)
    print(text)


if __name__ == "__main__":
    main()
