"""Which tensors' sharing costs quality: a bench task with Gefen's block choice overridden per
tensor, paired with AdamW over seeds.

Each config is a list of ``pattern=value`` rules applied to the block size the partition chose
for every parameter whose name contains ``pattern``: ``1`` (no sharing: per-element state),
``rows`` (the contiguous rule alone, no columns) or an integer block size. One subprocess per
(config, seed), at most two at once, each with one torch thread; the same init, data and
schedule as ``python -m gefen_dist.bench compare``.

    python benchmarks/sharing_ablation.py --task llama --optimizer gefen4 \\
        --configs "" "embed=1" "self_attn=1" "mlp=1" "down_proj=rows" "."=1

``--rounding nearest|stochastic`` is a diagnostic, not a Gefen option: every Gefen run then uses
the reference update with m requantised that way at every bit width (Gefen itself rounds 8-bit
codes to the nearest level and 4-bit codes stochastically, ``reference.requantize``). Nearest
rounding has a dead zone: an entry whose change in a step is under half a level spacing keeps
its code, so a small m stops decaying when its gradient does; stochastic rounding decays it in
expectation. Comparing the two says how much of a task's gap that dead zone is.

``--second-moment shared`` is another diagnostic: Gefen without its cross factor, one v per block
as the seeds describe (``reference``, the factor). It measures what the factor earns
(``research/results/factored_v_diagnostic.md``).

``--second-moment current`` (through the reference update): the cross factor from this step's
own fold, as Gefen had it before e80940f, where it now takes the factor from v_cross as the
steps before left it. ``research/results/stale_factor.md`` ran the same pair the other way round, at
9b5b00c, as ``stale`` against the then as-built: what the one step of lag costs.

``--lr-factor F`` trains at F x the task's lr, exactly as ``python -m gefen_dist.bench compare
--lr-sweep`` does (``sweep.swept``: the peak lr scaled, schedule and everything else unchanged),
so a gap the sweep reports at AdamW's best lr can be taken apart at that lr (the GRU's is x3,
``research/results/gru_high_lr.md``).

``--out runs.jsonl`` appends every run's record (config, seed, lr factor, diagnostics, final
metrics, chosen blocks, a hash of the package's sources) and reuses a record with the same key
on a rerun: AdamW's seeds are trained once for every ablation of one task and lr, and an
interrupted batch resumes. The hash keeps records of edited code (a new block rule) apart.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _force_rounding(gopt, reference, rounding: str) -> None:
    """Run Gefen through the reference update, requantising m ``rounding``-wise at every width."""
    from gefen_dist.method import codes

    def requantize(x, first, step, levels, mids, bits):
        x = x.reshape(-1)
        if rounding == "nearest":
            return codes.quantize(x, mids)
        return reference.stochastic_codes(x, first, step, levels)

    reference.requantize = requantize
    gopt.Gefen._impl = lambda self, p, g: "reference"


def _force_shared() -> None:
    """Gefen with one v per block and no cross factor (the seeds' shared v): no segment keeps a
    ``v_cross``, so every backend divides by its block's v alone."""
    from gefen_dist.method import state

    state.cross_length = lambda block_size, tensor_numel: 0


def _force_current(gopt) -> None:
    """The cross factor from this step's own fold (the method before e80940f), through the
    reference update."""
    import torch

    from gefen_dist.backends import reference

    def current(st, h, mean_sq):
        st.v_cross.mul_(h.beta2).add_(mean_sq, alpha=1.0 - h.beta2)
        total = st.v_cross.mean()
        c = st.v_cross / torch.where(total > 0, total, torch.ones_like(total))
        return c.clamp_(min=reference.CROSS_FLOOR).sqrt_().div_(h.bc2_sqrt)

    gopt.cross_factor = current
    gopt.Gefen._impl = lambda self, p, g: "reference"


def _child(
    task: str,
    optimizer: str,
    seed: int,
    config: str,
    scale: float,
    rounding: str,
    v: str,
    lr_factor: float,
) -> None:
    sys.path.insert(0, str(ROOT))
    from gefen_dist import optimizer as gopt
    from gefen_dist.backends import reference
    from gefen_dist.bench import suite, sweep, tasks
    from gefen_dist.method import partition

    if rounding != "as-built":
        _force_rounding(gopt, reference, rounding)
    if v == "shared":
        _force_shared()
    if v == "current":
        _force_current(gopt)

    spec = sweep.swept(tasks.scaled(tasks.TASKS[task], scale), lr_factor)
    names = [n for n, p in tasks.build(spec, seed).model.named_parameters() if p.requires_grad]
    rules = [r.split("=") for r in config.split(",") if r]
    chosen = partition.choose_block_size
    calls: list[tuple[str, int]] = []

    def override(stats, numel, row=0):
        name = names[len(calls)]  # parameters are partitioned in order, one call each
        b = chosen(stats, numel, row)
        for pattern, value in rules:
            if pattern in name:
                b = partition._contiguous(stats, numel)[0] if value == "rows" else int(value)
        calls.append((name, b))
        return b

    partition.choose_block_size = override  # first_step reads it from the module
    rec = suite.run_one(spec, optimizer, seed)
    if rec["status"] != "ok":  # diverged: a loss of inf, so that the table shows it
        rec = dict(final=dict(val_loss=float("inf")), bytes_per_param=float("nan"), **rec)
    print(
        json.dumps(
            dict(
                final=rec["final"],
                bytes_per_param=rec["bytes_per_param"],
                blocks=calls,
                curve=rec.get("curve", []),
            )
        )
    )


def source_hash() -> str:
    """Hash of the package's Python sources: a record is reused only for the code it ran."""
    h = hashlib.sha1()
    for f in sorted((ROOT / "gefen_dist").rglob("*.py")):
        h.update(f.relative_to(ROOT).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


RECORD_FIELDS = (
    "task",
    "optimizer",
    "seed",
    "config",
    "scale",
    "lr_factor",
    "rounding",
    "second_moment",
    "src",
)
"""A record's identity, in the order its key joins them."""


def _key(values: tuple) -> str:
    return "|".join(map(str, values))


def _append(out: str, values: tuple, rec: dict) -> None:
    """One run's record (its key, ``RECORD_FIELDS`` = ``values``, the child's body) onto ``out``."""
    row = dict(key=_key(values), **dict(zip(RECORD_FIELDS, values, strict=True)), **rec)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


def _run(task, optimizer, seed, config, scale, rounding, v, lr_factor, cache, out) -> dict:
    gefen = optimizer.startswith("gefen")
    rounding, v = (rounding, v) if gefen else ("as-built", "as-built")
    values = (task, optimizer, seed, config, scale, lr_factor, rounding, v, cache["src"])
    key = _key(values)
    if key in cache:
        return cache[key]
    cmd = [sys.executable, __file__, "--child", task, optimizer, str(seed), config, str(scale)]
    cmd += [rounding, v, str(lr_factor)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rec = json.loads(proc.strip().splitlines()[-1])
    if out:
        _append(out, values, rec)
    cache[key] = rec
    return rec


def labelled_parser(doc: str) -> argparse.ArgumentParser:
    """The options every ``labelled_runs`` diagnostic takes; each adds its own."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--task", default="mlp")
    ap.add_argument("--optimizer", default="gefen4")
    ap.add_argument("--lr-factor", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    return ap


def labelled_runs(
    script: str,
    task: str,
    optimizer: str,
    lr_factor: float,
    seeds: range,
    label: str,
    out: str,
    extra: list[str],
) -> None:
    """Run ``script --child TASK OPTIMIZER SEED LR_FACTOR *extra`` (which prints a record body
    as ``_child`` does) for each seed not yet in ``out``, appending its record with
    ``second_moment`` = ``label``: how a diagnostic of its own (``factor_off.py``,
    ``resolution_floor.py``) writes runs that ``paired_table.py`` pairs with AdamW's."""
    src = source_hash()
    done = set()
    if Path(out).exists():
        done = {json.loads(line)["key"] for line in Path(out).read_text().splitlines()}
    for seed in seeds:
        values = (task, optimizer, seed, "", 1.0, lr_factor, "as-built", label, src)
        if _key(values) in done:
            continue
        cmd = [sys.executable, script, "--child", task, optimizer, str(seed), str(lr_factor)]
        proc = subprocess.run(cmd + extra, capture_output=True, text=True, check=True).stdout
        rec = json.loads(proc.strip().splitlines()[-1])
        _append(out, values, rec)
        print(seed, rec["final"]["val_loss"], flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        task, optimizer, seed, config, scale, rounding, v, lr_factor = sys.argv[2:10]
        _child(task, optimizer, int(seed), config, float(scale), rounding, v, float(lr_factor))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="llama")
    ap.add_argument("--optimizer", default="gefen4")
    ap.add_argument("--configs", nargs="+", default=[""])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument(
        "--lr-factor",
        type=float,
        default=1.0,
        help="peak lr = this x the task's lr, as the lr sweep scales it (sweep.swept)",
    )
    ap.add_argument("--out", help="JSONL of runs: appended, and matching records reused")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--rounding", choices=("as-built", "nearest", "stochastic"), default="as-built")
    ap.add_argument(
        "--second-moment",
        choices=("as-built", "shared", "current"),
        nargs="+",
        default=["as-built"],
        help="shared: a diagnostic, one v per block without the cross factor (_force_shared); "
        "current: the factor from this step's own fold (_force_current); several: each "
        "config with each, paired",
    )
    args = ap.parse_args()
    moments = args.second_moment
    jobs = [("adamw", "", "as-built", s) for s in range(args.seeds)]
    jobs += [
        (args.optimizer, c, v, s) for c in args.configs for v in moments for s in range(args.seeds)
    ]
    cache: dict = {"src": source_hash()}
    if args.out and Path(args.out).exists():
        for line in Path(args.out).read_text().splitlines():
            r = json.loads(line)
            cache[r["key"]] = r
    with ThreadPoolExecutor(args.jobs) as pool:
        futs = {
            j: pool.submit(
                _run,
                args.task,
                j[0],
                j[3],
                j[1],
                args.scale,
                args.rounding,
                j[2],
                args.lr_factor,
                cache,
                args.out,
            )
            for j in jobs
        }
        res = {j: f.result() for j, f in futs.items()}
    metric = "val_loss"
    seeds = range(args.seeds)
    base = {s: res[("adamw", "", "as-built", s)]["final"][metric] for s in seeds}
    acc = "val_acc" in res[("adamw", "", "as-built", 0)]["final"]
    print(
        f"task {args.task}, {args.optimizer}, scale {args.scale}, lr x{args.lr_factor:g}, "
        f"seeds 0..{args.seeds - 1}, sources {cache['src']}, "
        f"rounding of m: {args.rounding}, second moment: {', '.join(moments)}"
    )
    print(
        "| config | val loss (mean) | vs AdamW, paired (mean ± std, t) | vs the first config, "
        f"paired (mean ± std, t) |{' val acc vs AdamW (points) |' if acc else ''} bytes/param |"
    )
    print(f"|---|---|---|---|{'---|' if acc else ''}---|")
    print(f"| AdamW | {statistics.mean(base.values()):.4f} | | |{' |' if acc else ''} 8.00 |")
    first = None
    for c, v in ((c, v) for c in args.configs for v in moments):
        vals = {s: res[(args.optimizer, c, v, s)]["final"][metric] for s in seeds}
        first = first or vals
        diffs = [100 * (vals[s] / base[s] - 1) for s in seeds]
        rel = [100 * (vals[s] / first[s] - 1) for s in seeds]
        bpp = res[(args.optimizer, c, v, 0)]["bytes_per_param"]
        cells = [
            (c or "as chosen") + ("" if len(moments) == 1 else f", {v}"),
            f"{statistics.mean(vals.values()):.4f}",
            _mean_sd(diffs, "%", t=True),
            "" if vals is first else _mean_sd(rel, "%", t=True),
        ]
        if acc:
            pts = [
                100
                * (
                    res[(args.optimizer, c, v, s)]["final"]["val_acc"]
                    - res[("adamw", "", "as-built", s)]["final"]["val_acc"]
                )
                for s in seeds
            ]
            cells.append(_mean_sd(pts, "pt"))
        print("| " + " | ".join(cells) + f" | {bpp:.2f} |")


def _mean_sd(xs: list[float], unit: str, t: bool = False) -> str:
    m = statistics.mean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    out = f"{m:+.2f} {unit} ± {sd:.2f}"
    if t and sd > 0:
        out += f", t {m / (sd / len(xs) ** 0.5):+.1f}"
    return out


if __name__ == "__main__":
    main()
