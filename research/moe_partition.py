"""Why grouped expert weights fall back to B = 1, measured on the MoE LM in its four storages.

    python research/moe_partition.py [--seeds 0 1 2] [--batch-size 8] [--seq 64]
        [--dim 128] [--hidden 160] [--bits 4 8] [--jsonl research/results/moe_partition.jsonl]

For each storage of ``gefen_dist.bench.moe`` (grouped (E, F, D)/(E, D, F), transposed, fused
gate+up, a ModuleList of nn.Linear) and each seed, one first batch of the bench's LM data:

- Gefen(model.parameters()) at each bit width, one step; bytes/param overall and over the
  experts (``memory_report``), next to per-element state (bf16 m and v: 4 bytes/param);
- per expert tensor, from the same g0: the block size B today's rule picks, the share of its
  (leading-index) slices whose g0 is all zero (unrouted experts), the spread c (step 6), and R
  at the blocks that matter for a batch of matrices (S slices of (r, c)):
    R_row  = R(c): a row of the last dim inside one slice (a candidate today),
    R_sl   = R(r c): one whole slice (a candidate today; today's "row"),
    R_colx = today's columns: period r c, a column runs across the S slices (S elements),
    R_colw = a column inside one slice (period c, blocks (slice, j)): not a candidate today,
    Jmax   = the largest jump among today's contiguous candidates, and at which p;
  and ``batched``: the prototype rule of research/moe_partition.md, today's 2-D rule applied
  to each slice as a matrix (all-zero slices left out), with the slices' choices and their
  agreement.
- ``--late``: the linear storage's unrouted experts over three small first steps;
- ``--dense`` lists every tensor of 3 or more dims in the demo GPT and the bench's tasks and
  whether the prototype's gate (last two dims each >= MIN_BLOCK) would take it.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gefen_dist import Gefen  # noqa: E402
from gefen_dist.bench import moe, tasks  # noqa: E402
from gefen_dist.method import partition as pt  # noqa: E402

PER_ELEMENT = 4.0  # bf16 m and v per element: what B = 1 keeps, for scale


def r_within(x: torch.Tensor, groups: torch.Tensor) -> float:
    """R (partition step 2) of an arbitrary grouping: ``x`` (n,) and ``groups`` (n,) ids."""
    x = x.double()
    n = x.numel()
    total = float(((x - x.mean()) ** 2).sum()) / (n - 1)
    if not total > 0:
        return float("inf")
    k = int(groups.max()) + 1
    sums = torch.zeros(k, dtype=torch.float64).index_add_(0, groups, x)
    cnt = torch.zeros(k, dtype=torch.float64).index_add_(0, groups, torch.ones_like(x))
    within = float((x * x).sum() - (sums * sums / cnt).sum()) / (n - k)
    return max(within, 0.0) / total


def batched_gate(shape: tuple[int, ...]) -> bool:
    """The prototype's test for "a batch of matrices": 3+ dims, the last two each at least
    MIN_BLOCK and a slice at least MIN_SHARED_NUMEL (a 3x3 conv kernel is not a matrix)."""
    return (
        len(shape) >= 3
        and shape[-1] >= pt.MIN_BLOCK
        and shape[-2] >= pt.MIN_BLOCK
        and shape[-1] * shape[-2] >= pt.MIN_SHARED_NUMEL
    )


def batched_choice(g: torch.Tensor) -> tuple[int | None, dict[int, int]]:
    """Prototype: today's 2-D rule on each (r, c) slice of ``g``; all-zero slices abstain and
    take the others' choice. Returns (the most common choice, None where every slice is zero;
    the choices' counts)."""
    r, c = g.shape[-2], g.shape[-1]
    slices = g.reshape(-1, r, c)
    votes = collections.Counter(
        pt.block_size_for(s.contiguous()) for s in slices if bool((s != 0).any())
    )
    if not votes:
        return None, {}
    best = max(votes.items(), key=lambda kv: (kv[1], kv[0]))[0]
    return best, dict(votes)


def analyse(name: str, g: torch.Tensor) -> dict:
    shape = tuple(g.shape)
    flat = g.reshape(-1).double()
    x = flat * flat
    n = flat.numel()
    row = pt.row_length(shape)
    cands = pt.candidate_block_sizes(shape)
    period = pt.column_period(shape)
    stats = pt.segment_stats(flat, 0, cands, period)
    today = pt.choose_block_size(stats, n, row)
    rs = dict(zip(cands, pt.heterogeneity(stats, n), strict=True)) if cands else {}
    jmax, jat = 0.0, 0
    for i, p in enumerate(cands):
        nxt = next((rs[q] for q in cands[i + 1 :] if q % p == 0), 1.0)
        j = nxt / rs[p] if rs[p] > 0 else float("inf")
        if j > jmax:
            jmax, jat = j, p
    rec = dict(
        name=name,
        shape=list(shape),
        B_today=today,
        c=pt.spread(stats, n),
        Jmax=jmax,
        Jmax_at=jat,
        R_colx=pt.column_heterogeneity(stats, n) if period else None,
    )
    if len(shape) >= 3:
        s, rr, cc = n // (shape[-1] * shape[-2]), shape[-2], shape[-1]
        slices = g.reshape(s, -1)
        rec["zero_slices"] = int((slices == 0).all(dim=1).sum())
        rec["slices"] = s
        rec["R_row"] = rs.get(cc)
        rec["R_sl"] = rs.get(rr * cc)
        idx = torch.arange(n)
        rec["R_colw"] = r_within(x, (idx // (rr * cc)) * cc + idx % cc)
        b, votes = batched_choice(g)
        rec["B_batched"], rec["votes"] = b, {str(k): v for k, v in votes.items()}
    else:
        rec["zero_slices"] = int(bool((flat == 0).all()))
        rec["slices"] = 1
    return rec


def expert_tensors(model: moe.MoELM) -> dict[str, torch.Tensor]:
    return dict(model.expert_parameters())


def batched_estimate(model: moe.MoELM, bits: int) -> dict:
    """State bytes/param if every tensor the gate takes were blocked slice by slice with
    today's 2-D rule: the slices as parameters of their own, measured by Gefen's own
    memory_report. All-zero slices would get B = 1 there; the prototype gives them the other
    slices' choice, so their bytes are counted at the non-zero slices' bytes/param."""
    params, zero_numel = [], 0
    for p in model.parameters():
        if batched_gate(tuple(p.shape)):
            for s, g in zip(
                p.detach().reshape(-1, *p.shape[-2:]),
                p.grad.reshape(-1, *p.shape[-2:]),
                strict=True,
            ):
                if bool((g != 0).any()):
                    q = torch.nn.Parameter(s.clone())
                    q.grad = g.clone()
                    params.append((q, True))
                else:
                    zero_numel += g.numel()
        else:
            q = torch.nn.Parameter(p.detach().clone())
            q.grad = p.grad.clone()
            params.append((q, False))
    opt = Gefen([q for q, _ in params], lr=0.0, bits=bits)
    opt.step()
    rep = opt.memory_report()
    rows = dict(zip([id(q) for q, _ in params], rep["tensors"], strict=True))
    sl = [rows[id(q)] for q, is_slice in params if is_slice]
    sl_bytes, sl_numel = sum(r["state_bytes"] for r in sl), sum(r["numel"] for r in sl)
    per = sl_bytes / sl_numel if sl_numel else 0.0
    total = rep["state_bytes"] + per * zero_numel
    return dict(
        bytes_per_param=total / (rep["params"] + zero_numel),
        expert_bytes_per_param=per,
        slice_fallback_share=sum(r["fallback_numel"] for r in sl) / sl_numel if sl_numel else 0,
    )


def run(
    storage: str, seed: int, bits: list[int], batch: int, seq: int, dim: int, hidden: int
) -> dict:
    torch.manual_seed(seed)
    model = moe.MoELM(moe.MoEConfig(storage=storage, seq=seq, dim=dim, hidden=hidden))
    xb = next(moe.lm_batches(seed, dict(batch=batch, seq=seq)))
    moe.lm_loss(model, xb).backward()
    experts = expert_tensors(model)
    # an unrouted expert of the linear storage never ran: its grad is None (a zero slice of
    # the grouped storages), and Gefen gives it no state until a step where it has one
    grads = {
        n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in experts.items()
    }
    no_grad = sum(p.numel() for p in experts.values() if p.grad is None)
    counts = [layer.moe.last_counts.tolist() for layer in model.layers]
    names = {id(p): n for n, p in model.named_parameters()}
    out = dict(
        storage=storage,
        seed=seed,
        batch=batch,
        seq=seq,
        dim=dim,
        hidden=hidden,
        counts=counts,
        expert_numel_without_grad=no_grad,
        bits={},
    )
    for b in bits:
        opt = Gefen(model.parameters(), lr=0.0, bits=b)
        # the first step reads the gradients; lr 0 keeps the weights for the next bit width
        opt.step()
        rep = opt.memory_report()
        stepped = [p for p, st in opt.state.items() if st]
        by_param = {names[id(p)]: r for p, r in zip(stepped, rep["tensors"], strict=True)}
        ex = [r for n, r in by_param.items() if n in experts]
        ex_numel = sum(r["numel"] for r in ex)
        out["bits"][b] = dict(
            bytes_per_param=rep["bytes_per_param"],
            expert_bytes_per_param=sum(r["state_bytes"] for r in ex) / ex_numel,
            expert_fallback_share=sum(r["fallback_numel"] for r in ex) / ex_numel,
            blocks={n: r["block_sizes"] for n, r in by_param.items() if n in experts},
        )
        if storage != "linear":
            out["bits"][b]["batched"] = batched_estimate(model, b)
    if storage == "linear":
        # one row per projection and layer: the per-expert tensors as a stacked (E, r, c) g0
        stacked: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
        for n, g in grads.items():
            parts = n.split(".")
            stacked[".".join(parts[:3] + ["experts[*]"] + parts[5:])].append(g)
        out["tensors"] = [
            dict(
                analyse(n, torch.stack(gs)),
                per_expert_today=[pt.block_size_for(g) for g in gs],
            )
            for n, gs in stacked.items()
        ]
    else:
        out["tensors"] = [analyse(n, g) for n, g in grads.items()]
    return out


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def show(rec: dict) -> None:
    print(
        f"\n## {rec['storage']} seed {rec['seed']} (d {rec['dim']}, F {rec['hidden']}, batch "
        f"{rec['batch']}x{rec['seq']}); "
        f"tokens per expert {rec['counts']}"
        + (
            f"; {rec['expert_numel_without_grad']} expert elements without a grad (no state yet)"
            if rec["expert_numel_without_grad"]
            else ""
        )
    )
    for b, r in rec["bits"].items():
        print(
            f"  {b}-bit: {r['bytes_per_param']:.3f} B/param overall, experts "
            f"{r['expert_bytes_per_param']:.3f} ({100 * r['expert_fallback_share']:.0f} % at "
            f"B = 1); per-element state: {PER_ELEMENT:.1f}"
        )
        if "batched" in r:
            e = r["batched"]
            print(
                f"         batched prototype: {e['bytes_per_param']:.3f} overall, experts "
                f"{e['expert_bytes_per_param']:.3f} ({100 * e['slice_fallback_share']:.0f} % "
                "of non-zero slices at B = 1)"
            )
    print(
        "  | tensor | shape | B today | zero slices | c | R_row | R_sl | R_colx | R_colw "
        "| Jmax (at p) | batched B (votes) |"
    )
    for t in rec["tensors"]:
        extra = f" per-expert today {t['per_expert_today']}" if "per_expert_today" in t else ""
        print(
            f"  | {t['name']} | {tuple(t['shape'])} | {t['B_today']} | "
            f"{t['zero_slices']}/{t['slices']} | {fmt(t['c'])} | {fmt(t.get('R_row'))} | "
            f"{fmt(t.get('R_sl'))} | {fmt(t['R_colx'])} | {fmt(t.get('R_colw'))} | "
            f"{t['Jmax']:.3f} ({t['Jmax_at']}) | {t.get('B_batched')} {t.get('votes')} |{extra}"
        )


def dense() -> None:
    """Which tensors of the demo GPT and the suite's dense tasks the partition's batch-of-matrices
    rule (``partition.matrix_batch``) takes, and which have an all-zero first gradient of 2+
    dims (step 7 gives those rows): none of either means their blocks do not move."""
    from gefen_dist.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=64))
    idx = torch.randint(
        0, gpt.config.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0)
    )
    gpt(idx[:, :-1], idx[:, 1:])[1].backward()
    models = {"demo GPT": gpt}
    for name in tasks.DEFAULT_TASKS:
        inst = tasks.build(tasks.TASKS[name], 0)
        inst.loss(inst.model, next(inst.batches)).backward()
        models[name] = inst.model
    for mname, m in models.items():
        params = list(m.named_parameters())
        many = [(n, tuple(p.shape)) for n, p in params if p.dim() >= 3]
        taken = [(n, s) for n, s in many if pt.matrix_batch(s) is not None]
        zero = [n for n, p in params if p.dim() >= 2 and p.grad is not None and not p.grad.any()]
        print(
            f"{mname}: {len(many)} tensors of 3+ dims; the batch-of-matrices rule takes "
            f"{taken or 'none'}; all-zero first gradients of 2+ dims: {zero or 'none'}"
        )
        for n, s in many:
            print(f"    {n} {s} -> {'batch of matrices' if (n, s) in taken else 'unchanged'}")


def late(seed: int = 1, steps: int = 3) -> None:
    """The linear storage with 1 x 16-byte batches: which experts have no grad at each step,
    which have state after it, and the blocks each expert's gate_proj got."""
    torch.manual_seed(seed)
    m = moe.MoELM(moe.MoEConfig(storage="linear", seq=16))
    batches = moe.lm_batches(seed, dict(batch=1, seq=16))
    opt = Gefen(m.parameters(), lr=1e-3, bits=4)
    gates = [e.gate_proj.weight for e in m.layers[0].moe.experts]
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        moe.lm_loss(m, next(batches)).backward()
        print(
            f"step {step}: layer 0 tokens {m.layers[0].moe.last_counts.tolist()}, "
            f"no grad {[i for i, g in enumerate(gates) if g.grad is None]}"
        )
        opt.step()
        print(f"  with state: {[i for i, g in enumerate(gates) if opt.state.get(g)]}")
    rows = [
        r
        for p, r in zip(
            [p for p, s in opt.state.items() if s], opt.memory_report()["tensors"], strict=True
        )
        if any(p is g for g in gates)
    ]
    print("  gate_proj blocks:", [r["block_sizes"] for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--storages", nargs="+", default=list(moe.STORAGES))
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=moe.MoEConfig.dim)
    ap.add_argument("--hidden", type=int, default=moe.MoEConfig.hidden)
    ap.add_argument("--jsonl", default="")
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--late", action="store_true", help="unrouted experts of the linear storage")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.dense:
        dense()
        return
    if a.late:
        late()
        return
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    header = dict(
        command="python " + " ".join(sys.argv),
        revision=rev,
        machine=f"{platform.node()} {platform.processor() or platform.machine()}, CPU, torch "
        f"{torch.__version__}",
    )
    print(json.dumps(header))
    lines = [json.dumps(header)]
    for storage in a.storages:
        for seed in a.seeds:
            rec = run(storage, seed, a.bits, a.batch_size, a.seq, a.dim, a.hidden)
            show(rec)
            lines.append(json.dumps(rec))
    if a.jsonl:
        Path(a.jsonl).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
