"""Watch a Gefen run go bad above AdamW's best lr, step by step, and switch its parts off.

Why (issue 43): Gefen fell apart at 3x AdamW's best lr on a recurrent LM while AdamW trained.
This runs Gefen through the reference backend (``gefen_dist.backends.reference``, the spec) with
the per-segment updates wrapped, and records per tensor and step:

- ``upd``: RMS of the step's parameter change without weight decay, lr * |m / denom|;
- ``amp``: the shared denominator against the element's own: sqrt(v_elem) / (sqrt(v_b) * c_j),
  with v_elem a shadow per-element EMA of g^2 (AdamW's v) kept alongside; its RMS of log
  (``amp_log_rms``), its max, and the fraction of elements stepped > 3x too far (``amp_gt3``);
- ``clamp``: the fraction of the tensor's factor entries at ``CROSS_FLOOR``;
- ``sat``: the fraction of m's codes at |level| >= 0.99 (saturated at the block's absmax);
- ``blocks``: the block size the partition chose.

AdamW's own ``upd`` per tensor comes from the same seed's AdamW run.

Variants (``variant``, also used by ``research/high_lr_rnn.py --variant``):
``ref`` (reference backend only), ``per_element`` (B = 1 everywhere: bf16 m and v),
``no_factor`` (no ``v_cross``), ``exact_m`` (m kept in fp32 beside the codes, used instead of
the dequantised one: codes off), ``elem_v`` (the denominator from the per-element shadow v:
sharing off for v only, m still coded), ``rows`` (every 2-D tensor forced to row blocks),
``fix`` (the prototype ``bounded_denominator``, rejected: research/results/high_lr_rnn.md).

    PYTHONPATH=. python research/high_lr_probe.py --task gru_odd --lr 3e-2 --seed 0 --bits 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections import defaultdict
from dataclasses import replace

import torch

from gefen_dist.backends import reference
from gefen_dist.method import codes as mcodes
from gefen_dist.method.state import CROSS_FLOOR

RECORD: dict[str, list] = defaultdict(list)
"""Per tensor name: one dict of statistics per step (filled while ``watch`` is on)."""
_NAMES: dict[int, str] = {}
_SHADOW: dict[int, torch.Tensor] = {}
_EXACT: dict[tuple[int, int], torch.Tensor] = {}
_FLAGS: dict[str, bool] = {}


def _update_blocks(p, g, st, a, b, blocks, h, levels, mids, bits, f) -> None:
    """``reference._update_blocks`` with the probe's switches and statistics (same maths
    when every switch is off)."""
    g32 = g.float()
    absmax, v = st.absmax[blocks], st.v[blocks]
    m = levels[mcodes.read_codes(st.codes, a, b, bits).long()].view_as(g32).mul_(absmax[:, None])
    key = (p.untyped_storage().data_ptr(), st.start + a)
    if _FLAGS.get("exact_m") and key in _EXACT:
        m = _EXACT[key].clone()
    m.lerp_(g32, 1.0 - h.beta1)
    v.mul_(h.beta2).add_(g32.square().mean(dim=1), alpha=1.0 - h.beta2)
    sv = _SHADOW.get(key)
    sv = torch.zeros_like(g32) if sv is None else sv
    sv.mul_(h.beta2).addcmul_(g32, g32, value=1.0 - h.beta2)
    _SHADOW[key] = sv
    p32 = p if p.dtype == torch.float32 else p.float()
    p32.mul_(1.0 - h.lr * h.weight_decay)
    if f is None:
        denom = (v.sqrt() / h.bc2_sqrt)[:, None].expand_as(g32).clone()
    else:
        denom = v.sqrt()[:, None] * f[None, :]
    own = sv.sqrt() / h.bc2_sqrt
    if _FLAGS.get("elem_v"):
        denom = own.clone()
    if _FLAGS.get("fix"):
        denom = bounded_denominator(denom, m, h)
    denom = denom.add_(h.eps)
    step = m / denom * h.step_size
    p32.sub_(step)
    mcodes.write_param(p, p32, h.bf16_stochastic_round, h.step, st.start + a)
    amax = m.abs().amax(dim=1)
    absmax.copy_(amax)
    if _FLAGS.get("exact_m"):
        _EXACT[key] = m.clone()
    q = m / torch.where(amax > 0, amax, torch.ones_like(amax))[:, None]
    new = reference.requantize(q, st.start + a, h.step, levels, mids, bits)
    mcodes.write_codes(st.codes, a, b, new, bits)
    if _FLAGS.get("watch"):
        amp = (own + h.eps) / denom
        lam = amp.clamp(min=1e-12).log()
        name = _NAMES.get(key[0], "?")
        rec = dict(
            step=h.step,
            upd=float(step.square().mean().sqrt()),
            amp_log_rms=float(lam.square().mean().sqrt()),
            amp_max=float(amp.max()),
            amp_gt3=float((amp > 3).float().mean()),
            over=float((step.abs() > h.lr * adam_bound(h) * 1.0001).float().mean()),
            step_max=float(step.abs().max() / h.lr),
            sat=float((levels[new.long()].abs() >= 0.99).float().mean()),
            clamp=float((f * h.bc2_sqrt).square().le(CROSS_FLOOR * 1.0001).float().mean())
            if f is not None
            else None,
            blocks=st.block_size,
            w_rms=float(p32.square().mean().sqrt()),
        )
        parts = int(_FLAGS.get("gates", 0))
        if parts and st.v.numel() % parts == 0 and st.block_size > 0:
            idx = torch.arange(blocks.start, blocks.stop)
            part = (idx * parts // st.v.numel())[:, None].expand_as(
                lam
            )  # the gate section of each block's row
            rec["gate_amp_log_rms"] = [
                round(float(lam[part == k].square().mean().sqrt()), 3) for k in range(parts)
            ]
            rec["gate_upd"] = [
                round(float(step[part == k].square().mean().sqrt()), 5) for k in range(parts)
            ]
            rec["gate_over"] = [
                round(float((step[part == k].abs() > h.lr * adam_bound(h)).float().mean()), 4)
                for k in range(parts)
            ]
        RECORD[name].append(rec)


def bounded_denominator(denom: torch.Tensor, m: torch.Tensor, h) -> torch.Tensor:
    """The rejected prototype: the denominator raised where a shared v would step an element
    further than AdamW ever can, |step| <= lr * adam_bound (no constant of its own: the bound
    follows from the betas and the step)."""
    floor = m.abs() * (h.step_size / (h.lr * adam_bound(h)))
    return torch.maximum(denom, floor)


def adam_bound(h) -> float:
    """The most |m_hat / sqrt(v_hat)| of one element can be in AdamW at step t (eps = 0), by
    Cauchy-Schwarz on the two EMAs of its own gradients: with rho = b1^2 / b2,
    (1 - b1) / sqrt(1 - b2) * sqrt((1 - rho^t) / (1 - rho)) * sqrt(1 - b2^t) / (1 - b1^t);
    1 at t = 1, (1 - b1) / sqrt((1 - b2)(1 - rho)) late (1.17 for betas (0.9, 0.95))."""
    b1, b2, t = h.beta1, h.beta2, h.step
    rho = b1 * b1 / b2
    return (
        (1 - b1)
        / math.sqrt(1 - b2)
        * math.sqrt((1 - rho**t) / (1 - rho))
        * math.sqrt(1 - b2**t)
        / (1 - b1**t)
    )


def _dense_watch(orig):
    def dense(p, g, st, h):
        before = p.detach().float().clone()
        orig(p, g, st, h)
        if _FLAGS.get("watch"):
            upd = (p.detach().float() - before * (1 - h.lr * h.weight_decay)).square().mean()
            RECORD[_NAMES.get(p.untyped_storage().data_ptr(), "?")].append(
                dict(step=h.step, upd=float(upd.sqrt()), blocks=1)
            )

    return dense


@contextlib.contextmanager
def variant(name: str, watch: bool = False, gates: int = 0):
    """Run Gefen under switch ``name`` (module docstring) inside the block."""
    from gefen_dist import optimizer as gopt
    from gefen_dist.method import partition, state

    saved = dict(
        impl=gopt.Gefen._impl,
        ub=reference._update_blocks,
        dense=gopt.dense_update,
        cbs=partition.choose_block_size,
        cl=state.cross_length,
    )
    _FLAGS.clear()
    _FLAGS.update({name: True, "watch": watch, "gates": gates})
    _SHADOW.clear()
    _EXACT.clear()
    gopt.Gefen._impl = lambda self, p, g: "reference"
    reference._update_blocks = _update_blocks
    gopt.dense_update = _dense_watch(saved["dense"])
    if name == "per_element":
        partition.choose_block_size = lambda stats, numel, row=0: 1
    if name == "rows":
        partition.choose_block_size = lambda stats, numel, row=0: row if row > 1 else 1
    if name == "no_factor":
        state.cross_length = lambda block_size, tensor_numel: 0
    try:
        yield
    finally:
        gopt.Gefen._impl = saved["impl"]
        reference._update_blocks = saved["ub"]
        gopt.dense_update = saved["dense"]
        partition.choose_block_size = saved["cbs"]
        state.cross_length = saved["cl"]
        _FLAGS.clear()


def probe(
    task_name: str,
    lr: float,
    seed: int,
    optimizer: str,
    name: str,
    steps: list[int],
    gates: int = 0,
):
    """One run with statistics; AdamW's per-tensor update RMS from a hook on its steps."""
    from gefen_dist.bench import peers, tasks
    from gefen_dist.demo import loop

    torch.set_num_threads(1)
    t = tasks.TASKS[task_name]
    h = replace(t.hyper, lr=lr)
    inst = tasks.build(replace(t, hyper=h), seed)
    model = inst.model
    RECORD.clear()
    _NAMES.clear()
    _NAMES.update({p.untyped_storage().data_ptr(): n for n, p in model.named_parameters()})
    with variant(name, watch=optimizer != "adamw", gates=gates):
        opt = peers.build(optimizer, model, h.lr, betas=h.betas, weight_decay=h.weight_decay)
        losses = []
        for s in range(1, h.steps + 1):
            peers.set_lr(opt, tasks.lr_factor(s - 1, h))
            if optimizer == "adamw":
                before = {n: p.detach().clone() for n, p in model.named_parameters()}
            losses.append(
                loop.plain_step(model, opt, lambda: inst.loss(model, next(inst.batches)), 1.0)
            )
            if optimizer == "adamw":
                lr_now = opt.param_groups[0]["lr"]
                for n, p in model.named_parameters():
                    d = p.detach() - before[n] * (1 - lr_now * h.weight_decay)
                    RECORD[n].append(dict(step=s, upd=float(d.square().mean().sqrt())))
            if not math.isfinite(losses[-1]):
                break
        val = inst.evaluate(model)["val_loss"]
    return dict(val=val, losses=losses, record={k: list(v) for k, v in RECORD.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="gru_odd")
    ap.add_argument("--lr", type=float, default=3e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optimizer", default="gefen8")
    ap.add_argument("--variant", default="ref")
    ap.add_argument("--steps", default="1,2,5,10,25,50,100,200,300,400,500")
    ap.add_argument("--gates", type=int, default=0, help="split block rows in N sections")
    ap.add_argument("--out", default="research/results/high_lr_probe.jsonl")
    a = ap.parse_args()
    steps = [int(x) for x in a.steps.split(",")]
    r = probe(a.task, a.lr, a.seed, a.optimizer, a.variant, steps, a.gates)
    keep = {n: [x for x in v if x["step"] in steps] for n, v in r["record"].items()}
    rec = dict(vars(a), val=r["val"], loss_every_25=r["losses"][::25], record=keep)
    with open(a.out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(a.optimizer, a.variant, "val", round(r["val"], 4))
    for n, v in keep.items():
        for x in v:
            print(
                n,
                json.dumps({k: (round(y, 4) if isinstance(y, float) else y) for k, y in x.items()}),
            )


if __name__ == "__main__":
    main()
