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

The probe's contiguous-block update is its own copy of the reference's as it was before the
update took ``split_osc`` as its overshoot rule (``reference.overshoot_denominator``): every
variant, ``ref`` included, steps contiguous blocks without the rule unless it names ``split_osc``;
column-blocked tensors go through the reference's ``column_update``, rule included.

Variants (``variant``, also used by ``research/high_lr_rnn.py --variant``):
``ref`` (reference backend only), ``per_element`` (B = 1 everywhere: bf16 m and v),
``no_factor`` (no ``v_cross``), ``exact_m`` (m kept in fp32 beside the codes, used instead of
the dequantised one: codes off), ``elem_v`` (the denominator from the per-element shadow v:
sharing off for v only, m still coded), ``rows`` (every 2-D tensor forced to row blocks),
``fix`` (the prototype ``bounded_denominator``, rejected: research/results/high_lr_rnn.md).

Zero-memory candidates (issue 43, ``research/results/high_lr_codes.md``; all rejected): ``mf``
(m coded in the factor's units, m / sqrt(c_j), and read back with the factor it was written in),
``zero`` (the 4-bit codebook learned with 0 pinned as well, ``zero_pinned_codebook``), ``dyn``
(the signed dynamic map instead of the learned codebook), ``own_g`` (AdamW's recursion with the
shared past: this step's fold per element, g_i^2, instead of the block's mean g^2 x c_j),
``qr`` (4-bit stochastic rounding with u from a per-element low-discrepancy sequence over steps,
u_t = frac(u_0(index) + t * phi), ``quasi_random_codes``, instead of a fresh hash each step).

Fourth study (issue 43, ``research/results/high_lr_head.md``): ``gN`` (m's absmax per run of N
elements of a row, ``group_absmax``, instead of one per block), ``mcol`` (m coded under a rank-1
envelope, row absmax x column scale max_i |m_ij| / absmax_i), ``mcolT`` (the envelope from the
columns' absmax first), ``near`` (4-bit codes rounded to the nearest level, ``nearest_codes``),
``ef`` (the coding error of the m stored now moved into the weight at once, by what the next
steps will add through beta1^k: zero memory), ``exact_m:NAME`` (fp32 m only on tensors whose name
contains NAME; with ``part_cols``, ``part_rows`` or ``part_small`` only on the columns above
the median column, the rows above the median row absmax, or the elements under a sixteenth
of their row's absmax). With ``watch`` on, each record also carries ``nsr_q`` and ``nsr_upd``
(``_rounding_noise``: stochastic rounding's variance over the power of m and of the update).

Fifth study (issue 43, ``research/results/high_lr_design.md``), how a kernel could hold
``mcol,gN``: ``shardN`` (the column scale's max taken within each of N equal runs of a chunk's
rows, as each rank of a dim-0 sharding would without a collective), ``stale`` (this step's m
coded under the column scale measured on the previous step's, so a kernel needs one pass; the
groups' absmax keeps |q| <= 1), ``long`` (the column scale only on blocks longer than a group),
``short`` (only on blocks of at most 64, where without groups a frozen scale clamps codes),
``cliponly`` (with ``mcol0``: m / absmax clipped to +-s_j and coded as built: the clamp
without the finer codes), ``clipname:NAME`` (the column scale only on tensors whose name
holds NAME),
``bf16g`` (the groups' absmax stored in bf16, rounded up: ``bf16_up``), ``mcol0`` (with
``mcol``: the column scale of the first m, (1 - beta1) g0, kept for the run), ``bf16s`` (the
column scale stored in bf16, rounded to nearest: the groups' absmax keeps |q| <= 1), ``env``
(with ``mcol``, no groups: each block's absmax taken over m / s_j, the rank-1 envelope's row
side, so a frozen column scale clamps no code and the absmax stays one per block).

Trigger variants (issue 43, ``research/results/high_lr_trigger.md``): every step from the
second on, each blocked tensor's spread c of step 6 of the partition (``partition.spread``:
c = CV^2 of the elements' own variances around the one they share) is measured against the
shared denominator the step uses, v_b * c_j, and the tensor is switched once c has grown over
its first reading c_0 by the partition's own ALIKE, 1 + c > (1 + c_0)(1 + ALIKE)
(``trigger_spread``, ``TriggerState``; with ``abs`` added, at c > ALIKE). ``trig`` only logs;
``trig_b1`` switches the tensor to B = 1 (bf16 m and v, ``reference.dense_update``) initialised
from its state (m = codes x absmax, v = v_b * c_j); ``trig_c`` keeps coded m and switches v to a
per-element EMA initialised at v_b * c_j, with ``exact_c``'s floored denominator (row blocks with
a factor; other tensors as ``trig_b1``).

Second trigger study (issue 43, helper h43b; ``research/results/high_lr_trigger2.md``):
``trig2`` logs every step's ``tail_stats`` (lower-tail, covariance, fractional-moment and
witness readings of the shared model, and the per-element truth) per blocked tensor
(``TRIG2_LOG``); ``trig2_b1,rule_NAME`` switches a tensor to B = 1 (as ``trig_b1``) once rule
NAME of ``RULES`` fires on it (``Trigger2``).

    PYTHONPATH=. python research/high_lr_probe.py --task gru_odd --lr 3e-2 --seed 0 --bits 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import torch

from gefen_dist.backends import reference
from gefen_dist.method import codebook as mcb
from gefen_dist.method import codes as mcodes
from gefen_dist.method import partition
from gefen_dist.method.state import CROSS_FLOOR

RECORD: dict[str, list] = defaultdict(list)
"""Per tensor name: one dict of statistics per step (filled while ``watch`` is on)."""
_NAMES: dict[int, str] = {}
_SHADOW: dict[int, torch.Tensor] = {}
_EXACT: dict[tuple[int, int], torch.Tensor] = {}
_FLAGS: dict[str, bool] = {}
_PREVF: dict[tuple[int, int], torch.Tensor] = {}
"""``mf``: per chunk, sqrt(c_j) of the factor its codes were written in."""
_CELEM: set[tuple[int, int]] = set()
"""Chunks (keys as ``_SHADOW``'s) whose denominator is ``exact_c``'s after a ``trig_c`` switch."""


def _update_blocks(p, g, st, a, b, blocks, h, levels, mids, bits, f) -> None:
    """``reference._update_blocks`` with the probe's switches and statistics (same maths
    when every switch is off)."""
    g32 = g.float()
    absmax, v = st.absmax[blocks], st.v[blocks]
    m = levels[mcodes.read_codes(st.codes, a, b, bits).long()].view_as(g32).mul_(absmax[:, None])
    key = (p.untyped_storage().data_ptr(), st.start + a)
    if _FLAGS.get("exact_m") and key in _EXACT:
        m = _EXACT[key].clone()
    only = next((k[8:] for k in _FLAGS if k.startswith("exact_m:")), None)
    if only is not None and only in _NAMES.get(key[0], "") and key in _EXACT:
        ex = _EXACT[key]
        part = next((k for k in _FLAGS if k in ("part_cols", "part_rows", "part_small")), None)
        if part is None:
            m = ex.clone()
        else:
            a_ = ex.abs()
            r_ = a_.amax(dim=1, keepdim=True).clamp(min=1e-30)
            if part == "part_cols":  # the columns whose mean |m| / row absmax is above median
                cm = (a_ / r_).mean(dim=0)
                sel = (cm > cm.median())[None, :].expand_as(m)
            elif part == "part_rows":  # the rows whose absmax is above the median row's
                sel = (r_ > r_.median()).expand_as(m)
            else:  # the elements under a sixteenth of their row's absmax
                sel = a_ < r_ / 16
            m = torch.where(sel, ex, m)
    if key in _GABS:
        m = levels[mcodes.read_codes(st.codes, a, b, bits).long()].view_as(g32)
        m.mul_(per_element(_GABS[key], _group(), g32.shape[1]))
    if key in _MCOL:
        m.mul_(_broadcast(_MCOL[key]))
    if _FLAGS.get("mf") and key in _PREVF:
        m.mul_(_PREVF[key][None, :])
    if key[0] in _TRIG_FIRED_C and key not in _CELEM and f is not None:
        # trig_c's switch: the per-element v starts as the shared one, v_b * c_j
        _SHADOW[key] = v[:, None] * (f * h.bc2_sqrt).square()[None, :]
        _CELEM.add(key)
    m.lerp_(g32, 1.0 - h.beta1)
    v.mul_(h.beta2).add_(g32.square().mean(dim=1), alpha=1.0 - h.beta2)
    sv = _SHADOW.get(key)
    sv = torch.zeros_like(g32) if sv is None else sv
    sv.mul_(h.beta2).addcmul_(g32, g32, value=1.0 - h.beta2)
    _SHADOW[key] = sv
    p32 = p if p.dtype == torch.float32 else p.float()
    p32.mul_(1.0 - h.lr * h.weight_decay)
    whole = f is not None and blocks.start == 0 and blocks.stop == st.v.numel()
    gates = int(_FLAGS.get("gates", 0)) or 1
    cols = None
    if whole:
        cols = _columns(key, g32, h, gates if _FLAGS.get("gate_c") else 1)
    if whole and _FLAGS.get("check"):
        ref_f = cols.c_lag[0].clamp(min=CROSS_FLOOR).sqrt() / h.bc2_sqrt
        _FLAGS.setdefault("check_err", []).append(float((ref_f / f - 1).abs().max()))
    if f is None:
        denom = (v.sqrt() / h.bc2_sqrt)[:, None].expand_as(g32).clone()
    elif whole and _FLAGS.get("half_v"):
        denom = _half_denominator(key, g32, cols.c_lag[0], h)
    elif whole and (_FLAGS.get("fresh_c") or _FLAGS.get("gate_c")):
        c = cols.c_fresh if _FLAGS.get("fresh_c") else cols.c_lag
        c = c[cols.row_group(blocks, st.v.numel())] if c.shape[0] > 1 else c
        denom = v.sqrt()[:, None] * c.clamp(min=CROSS_FLOOR).sqrt() / h.bc2_sqrt
    else:
        denom = v.sqrt()[:, None] * f[None, :]
    own = sv.sqrt() / h.bc2_sqrt
    if _FLAGS.get("split") or _FLAGS.get("split_osc") or _FLAGS.get("osc_m"):
        # the block's v read as a shared noise plus each element's own signal m_hat^2:
        # v_ij = s_ij (1 - mean m_hat^2 / mean s) + m_hat_ij^2, s_ij the shared estimate
        s2 = denom.square()
        mh2 = (m / (1.0 - h.beta1**h.step)).square()
        keep = 1.0 - mh2.mean(dim=1, keepdim=True) / s2.mean(dim=1, keepdim=True).clamp(min=1e-30)
        split = (s2 * keep.clamp(min=0.0) + mh2).sqrt()
        if _FLAGS.get("osc_m"):
            # the same without the block's noise term: |m_hat| alone as the floor
            denom = torch.where(m * g32 < 0, torch.maximum(denom, mh2.sqrt()), denom)
        elif _FLAGS.get("split_osc"):
            # only where this gradient opposes m (the last steps overshot), and never a
            # longer step than the shared v's
            denom = torch.where(m * g32 < 0, torch.maximum(denom, split), denom)
        else:
            denom = split
    if _FLAGS.get("elem_v"):
        denom = own.clone()
    if (_FLAGS.get("exact_c") or key in _CELEM) and f is not None:
        # sharing on, the rank-1 factor replaced by the element's own g^2 ratio (floored as c)
        vb = (v.sqrt() / h.bc2_sqrt)[:, None]
        denom = torch.maximum(own, vb * math.sqrt(CROSS_FLOOR))
    if _FLAGS.get("own_g") and f is not None:
        # AdamW's recursion with the shared past: this step's fold per element (g_i^2) instead
        # of the block's mean g^2 times the factor
        c = (f * h.bc2_sqrt).square()[None, :]
        past = (v[:, None] - (1.0 - h.beta2) * g32.square().mean(dim=1, keepdim=True)) * c
        denom = (past + (1.0 - h.beta2) * g32.square()).clamp(min=0).sqrt() / h.bc2_sqrt
    if _FLAGS.get("fix"):
        denom = bounded_denominator(denom, m, h)
    denom = denom.add_(h.eps)
    step = m / denom * h.step_size
    p32.sub_(step)
    if _FLAGS.get("ef"):
        # the coding error of the m stored now reaches the next steps as beta1^k of itself:
        # move the weight now by what those steps will add, at this step's size and denominator
        amx = m.abs().amax(dim=1)
        qq = m / _or_one(amx)[:, None]
        nc = reference.requantize(qq, st.start + a, h.step, levels, mids, bits)
        err = levels[nc.long()].view_as(m) * amx[:, None] - m
        p32.add_(err / denom * (h.step_size * h.beta1 / (1.0 - h.beta1)))
    mcodes.write_param(p, p32, h.bf16_stochastic_round, h.step, st.start + a)
    if _FLAGS.get("exact_m") or only is not None:
        _EXACT[key] = m.clone()
    if _FLAGS.get("mf") and f is not None:
        # m coded in the factor's units: m / sqrt(c_j), so a level spacing is one in the update
        sf = (f * h.bc2_sqrt).clone()
        _PREVF[key] = sf
        m = m / sf[None, :]
    amax = m.abs().amax(dim=1)
    absmax.copy_(amax)
    q = m / _or_one(amax)[:, None]
    named = next((k[9:] for k in _FLAGS if k.startswith("clipname:")), None)
    if _FLAGS.get("mcol") and not (
        (_FLAGS.get("long") and m.shape[1] <= _group())
        or (_FLAGS.get("short") and m.shape[1] > _SHORT)
        or (named is not None and named not in _NAMES.get(key[0], ""))
    ):
        s = column_scale(m, _shards())
        if _FLAGS.get("bf16s"):
            s = s.to(torch.bfloat16).float()
        if _FLAGS.get("mcol0"):
            # the scale of the first m, (1 - beta1) g0, kept for the whole run
            s = _MCOL_FIRST.setdefault(key, s)
        if _FLAGS.get("stale"):
            # code this step's m under the scale the previous step measured (one pass in a
            # kernel); the groups' absmax below keeps every |q| <= 1
            s, _MCOL_NEXT[key] = _MCOL_NEXT.get(key, s), s
        if _FLAGS.get("cliponly"):
            # the clamp without the finer codes: m / absmax clipped to +-s_j, coded as built
            bound = _broadcast(s)
            q = torch.maximum(torch.minimum(m / _or_one(amax)[:, None], bound), -bound)
            if _FLAGS.get("exact_m"):
                # with m kept exact, the clip acts on the exact m the next step reads
                _EXACT[key] = q * _or_one(amax)[:, None]
        else:
            _MCOL[key] = s
            if _FLAGS.get("env"):
                # the row scale over m / s_j, so a frozen column scale clamps no code
                amax = (m.abs() / _or_one(_broadcast(s))).amax(dim=1)
                absmax.copy_(amax)
            q = m / (_or_one(amax)[:, None] * _or_one(_broadcast(s)))
    if _FLAGS.get("mcolT"):
        # the rank-1 envelope |m_ij| <= r_i s_j from the other side: each column's absmax
        # first, then each row's max over its column-scaled entries (<= 1)
        a_ = m.abs()
        s = _or_one(a_.amax(dim=0))
        r = (a_ / s[None, :]).amax(dim=1)
        absmax.copy_(r)
        _MCOL[key] = s
        q = m / (_or_one(r)[:, None] * s[None, :])
    if _group() and m.shape[1] > _group():
        # with ``mcol`` too, the groups' absmax is taken over m / s_j (both scales kept)
        sc = _MCOL.get(key)
        lev = m / _or_one(_broadcast(sc)) if sc is not None else m
        gabs = group_absmax(lev, _group())
        if _FLAGS.get("bf16g"):
            gabs = bf16_up(gabs)
        _GABS[key] = gabs
        q = lev / _or_one(per_element(gabs, _group(), m.shape[1]))
    new = reference.requantize(q, st.start + a, h.step, levels, mids, bits)
    mcodes.write_codes(st.codes, a, b, new, bits)
    if _FLAGS.get("watch"):
        amp = (own + h.eps) / denom
        lam = amp.clamp(min=1e-12).log()
        name = _NAMES.get(key[0], "?")
        over_el = step.abs() > h.lr * adam_bound(h) * 1.0001
        rec = dict(
            step=h.step,
            upd=float(step.square().mean().sqrt()),
            amp_log_rms=float(lam.square().mean().sqrt()),
            amp_log_mean=float(lam.mean()),
            amp_max=float(amp.max()),
            amp_gt3=float((amp > 3).float().mean()),
            over=float(over_el.float().mean()),
            step_max=float(step.abs().max() / h.lr),
            sat=float((levels[new.long()].abs() >= 0.99).float().mean()),
            clamp=float((f * h.bc2_sqrt).square().le(CROSS_FLOOR * 1.0001).float().mean())
            if f is not None
            else None,
            blocks=st.block_size,
            w_rms=float(p32.square().mean().sqrt()),
            alike_c=_alike_spread(g32, denom - h.eps, h),
            **_rounding_noise(q, levels, amax, m, denom),
        )
        if cols is not None and cols.c_lag.shape[0] == 1:
            rec.update(_column_stats(cols, lam, over_el, own, v, h, step, m))
        parts = int(_FLAGS.get("gates", 0))
        if parts and st.v.numel() % parts == 0 and st.block_size > 0:
            idx = torch.arange(blocks.start, blocks.stop)
            part = (idx * parts // st.v.numel())[:, None].expand_as(
                lam
            )  # the gate section of each block's row
            rec["gate_amp_log_rms"] = [
                round(float(lam[part == k].square().mean().sqrt()), 3) for k in range(parts)
            ]
            rec["gate_amp_log_mean"] = [
                round(float(lam[part == k].mean()), 3) for k in range(parts)
            ]
            rec["gate_upd"] = [
                round(float(step[part == k].square().mean().sqrt()), 5) for k in range(parts)
            ]
            rec["gate_over"] = [
                round(float((step[part == k].abs() > h.lr * adam_bound(h)).float().mean()), 4)
                for k in range(parts)
            ]
        RECORD[name].append(rec)
        if h.step in DUMP_STEPS:
            DUMP[(name, h.step)] = dict(
                own=own.clone(),
                denom=denom.clone(),
                m=m.clone(),
                v=v.clone(),
                over=over_el.clone(),
                f=f,
            )


def _rounding_noise(q, levels, amax, m, denom) -> dict:
    """Stochastic rounding's variance against the signal it carries: ``nsr_q`` in m's own
    units (mean (q - l_lo)(l_hi - q) over mean q^2), ``nsr_upd`` in the update's
    (each element's variance times (absmax / denom)^2 over mean (m / denom)^2)."""
    flat = q.reshape(-1).clamp(-1.0, 1.0)
    i = torch.searchsorted(levels, flat).clamp(1, levels.numel() - 1)
    var = ((flat - levels[i - 1]) * (levels[i] - flat)).clamp(min=0).view_as(q)
    scale = (amax[:, None] / denom).square()
    return dict(
        nsr_q=float(var.mean() / q.square().mean().clamp(min=1e-30)),
        nsr_upd=float((var * scale).mean() / (m / denom).square().mean().clamp(min=1e-30)),
    )


_GABS: dict[tuple[int, int], torch.Tensor] = {}
"""``gN``: per chunk, m's absmax per group of N elements of a block's row."""


_MCOL: dict[tuple[int, int], torch.Tensor] = {}
"""``mcol``: per chunk, m's column scale under its rows' absmax, max_i |m_ij| / absmax_i."""


def _or_one(x: torch.Tensor) -> torch.Tensor:
    """x with its zeros (scales of all-zero rows, columns or groups) read as 1, to divide by."""
    return torch.where(x > 0, x, torch.ones_like(x))


_SHORT = 64
"""``short``: the longest chunk row (block) the column scale is applied to."""
_MCOL_NEXT: dict[tuple[int, int], torch.Tensor] = {}
"""``stale``: per chunk, the column scale measured on this step's m, used to code the next."""
_MCOL_FIRST: dict[tuple[int, int], torch.Tensor] = {}
"""``mcol0``: per chunk, the column scale of its first m, used for the whole run."""


def _broadcast(s: torch.Tensor) -> torch.Tensor:
    """A column scale over a chunk's rows: one per column, or (``shardN``) one per element."""
    return s if s.dim() == 2 else s[None, :]


def column_scale(m: torch.Tensor, shards: int = 0) -> torch.Tensor:
    """``mcol``'s column scale: max over rows of |m_ij| / the row's absmax (<= 1). With
    ``shards`` (variant ``shardN``) the max is taken within each of N equal runs of rows, as
    each rank of a dim-0 sharding would without a collective, and returned per row."""
    a = m.abs()
    r = a / _or_one(a.amax(dim=1, keepdim=True))
    if not shards:
        return r.amax(dim=0)
    parts = torch.tensor_split(torch.arange(m.shape[0]), shards)
    return torch.cat([r[i].amax(dim=0, keepdim=True).expand(len(i), -1) for i in parts])


def _shards() -> int:
    return next((int(k[5:]) for k in _FLAGS if re.fullmatch(r"shard\d+", k)), 0)


def bf16_up(x: torch.Tensor) -> torch.Tensor:
    """x >= 0 rounded up to bf16 (variant ``bf16g``): the scale a kernel would store, never
    under the absmax it stands for, so every |q| stays <= 1."""
    h = x.to(torch.bfloat16)
    bits = h.view(torch.int16) + (h.float() < x).to(torch.int16)
    return bits.view(torch.bfloat16).float()


def _group() -> int:
    return next((int(k[1:]) for k in _FLAGS if re.fullmatch(r"g\d+", k)), 0)


def group_absmax(m: torch.Tensor, n: int) -> torch.Tensor:
    """m's absmax over each run of ``n`` elements of a row (the last run may be short)."""
    rows, cols = m.shape
    groups = -(-cols // n)
    padded = torch.nn.functional.pad(m.abs(), (0, groups * n - cols))
    return padded.view(rows, groups, n).amax(dim=2)


def per_element(gabs: torch.Tensor, n: int, cols: int) -> torch.Tensor:
    """``group_absmax``'s scales spread back over the ``cols`` elements of each row."""
    return gabs.repeat_interleave(n, dim=1)[:, :cols]


DUMP: dict[tuple[str, int], dict] = {}
"""Per (tensor, step) in ``DUMP_STEPS``: the chunk's own v, denominator, m, block v."""
DUMP_STEPS: set[int] = set()


def _alike_spread(g32: torch.Tensor, denom: torch.Tensor, h) -> float:
    """The partition's "alike" statistic (docs/method.md, step 5) of this step's gradient
    against the shared denominator: with z = g / denom, c = (CV^2(z^2) - 2) / 3 is the spread
    (CV^2) of the elements' own variances around v_b c_j, for Gaussian g; 0 where the shared
    denominator is each element's own. Read from this step's g alone: no per-element state."""
    z2 = (g32 / (denom * h.bc2_sqrt).clamp(min=1e-30)).square()
    cv2 = float(z2.var() / z2.mean().square().clamp(min=1e-30))
    return (cv2 - 2.0) / 3.0


_VC: dict[tuple[int, int], torch.Tensor] = {}
_HV: dict[tuple[int, int], torch.Tensor] = {}


@dataclass
class Columns:
    """The probe's own copy of a tensor's column statistics (``reference.cross_factor``'s,
    kept per gate section where ``groups`` > 1), one row per section: ``c_lag`` as the steps
    before this one left it (what the kernels use), ``c_fresh`` with this step's g^2 folded
    in; both unfloored ratios to their section's mean."""

    c_lag: torch.Tensor
    c_fresh: torch.Tensor
    fold: torch.Tensor  # this step's mean g^2 per column and section, as a ratio to its mean

    def row_group(self, blocks: slice, rows: int) -> torch.Tensor:
        """The section of each row of the chunk (rows of equal sections, as the gates)."""
        idx = torch.arange(blocks.start, blocks.stop)
        return idx * self.c_lag.shape[0] // rows


def _ratio(x: torch.Tensor) -> torch.Tensor:
    mean = x.mean(dim=1, keepdim=True)
    return x / _or_one(mean)


def _columns(key, g32: torch.Tensor, h, groups: int) -> Columns:
    """Fold this step's mean g^2 per column (and section) into the probe's v_cross; groups = 1
    reproduces ``reference.cross_factor`` (lagged, this step's fold where none came before)."""
    sq = g32.square().view(groups, -1, g32.shape[1]).mean(dim=1)
    vc = _VC.get(key)
    vc = torch.zeros_like(sq) if vc is None else vc
    before = vc.clone()
    vc.mul_(h.beta2).add_(sq, alpha=1.0 - h.beta2)
    _VC[key] = vc
    fresh = _ratio(vc)
    lag = _ratio(before) if float(before.abs().sum()) > 0 else fresh
    return Columns(c_lag=lag, c_fresh=fresh, fold=_ratio(sq))


def _half_denominator(key, g32: torch.Tensor, c: torch.Tensor, h, parts: int = 2):
    """Blocks half a row long (v per half-row, the probe's own EMA) with the column factor
    renormalised inside each half: what B = row / 2 with an ideal factor would give."""
    rows, width = g32.shape
    w = width // parts
    sq = g32[:, : w * parts].square().view(rows, parts, w).mean(dim=2)
    hv = _HV.get(key)
    hv = torch.zeros_like(sq) if hv is None else hv
    hv.mul_(h.beta2).add_(sq, alpha=1.0 - h.beta2)
    _HV[key] = hv
    cp = _ratio(c[: w * parts].view(parts, w)).reshape(-1)
    cp = torch.cat([cp, c[w * parts :]]).clamp(min=CROSS_FLOOR)
    vcol = hv.repeat_interleave(w, dim=1)
    if width > w * parts:
        vcol = torch.cat([vcol, hv[:, -1:].expand(rows, width - w * parts)], dim=1)
    return (vcol * cp[None, :]).sqrt() / h.bc2_sqrt


def _column_stats(cols: Columns, lam, over_el, own, v, h, step, m) -> dict:
    """Hypotheses 1 and 2: is the over-stepping in floored (near-dead) columns, which way does
    the shared denominator err there, and how far is the lagged factor from this step's."""
    floored = cols.c_lag[0] <= CROSS_FLOOR
    fl = floored[None, :].expand_as(lam)
    lag_err = (cols.c_lag[0].clamp(min=CROSS_FLOOR) / cols.c_fresh[0].clamp(min=CROSS_FLOOR)).log()
    # the element's true ratio: own v against the row's v (both as EMAs)
    c_true = (own.square() / (v / h.bc2_sqrt**2)[:, None].clamp(min=1e-30)).mean(dim=0)
    n_over = int(over_el.sum())
    out = dict(
        floored_cols=int(floored.sum()),
        lam_mean_floored=float(lam[fl].mean()) if bool(floored.any()) else None,
        lam_mean_free=float(lam[~fl].mean()),
        lam_rms_free=float(lam[~fl].square().mean().sqrt()),
        over_floored=float(over_el[fl].float().mean()) if bool(floored.any()) else None,
        over_free=float(over_el[~fl].float().mean()),
        over_in_floored=float(over_el[fl].sum() / n_over) if n_over else None,
        upd_floored=float(step[fl].square().mean().sqrt()) if bool(floored.any()) else None,
        upd_free=float(step[~fl].square().mean().sqrt()),
        lag_log_rms=float(lag_err.square().mean().sqrt()),
        lag_log_max=float(lag_err.abs().max()),
        fold_vs_lag_log_rms=float(
            (cols.fold[0].clamp(min=CROSS_FLOOR) / cols.c_lag[0].clamp(min=CROSS_FLOOR))
            .log()
            .square()
            .mean()
            .sqrt()
        ),
        c_true_min=float(c_true.min()),
        c_true_floored=float(c_true[floored].mean()) if bool(floored.any()) else None,
        # the per-row spread the rank-1 fit misses: own / (v_b c_j) within a column
        rank1_log_rms=float(
            (
                own.square()
                / ((v / h.bc2_sqrt**2)[:, None] * cols.c_lag[0][None, :]).clamp(min=1e-30)
            )
            .clamp(min=1e-30)
            .log()
            .mul(0.5)
            .square()
            .mean()
            .sqrt()
        ),
    )
    return out


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


_TRIG: dict[int, TriggerState] = {}
_TRIG_FIRED_C: set[int] = set()
_B1: dict[tuple[int, int], SimpleNamespace] = {}
TRIGGER_LOG: dict[str, dict] = {}
"""Per tensor name (its storage where unnamed): its numel and block size, the first reading c_0
(``accept``), the limit, the step the trigger fired at (None: never), the largest c and a trace
(steps 3-9 and every 10th, and the step it fired) of (step, c_t, exp(Cov_t) - 1, c (EMA),
exp(EMA of Cov) - 1, R_t), as ``trigger_spread`` and ``TriggerState.add`` define them."""


def trigger_spread(g: torch.Tensor, m_prev: torch.Tensor, d2: torch.Tensor):
    """The partition's spread c (step 6: how far the elements' own variances spread around the
    one they share) of the shared model d2 = v_b * c_j, read without per-element state and
    without the Gaussian assumption: (c_cv, Cov(ln a, ln b), R), or None where nothing is
    measurable (R: step 2's heterogeneity read on the element variances, logged only).

    With a = g_t^2 / d2 and b = m_{t-1}^2 / d2, both have expectations given the element
    proportional to its r = E[g^2] / d2 (m_{t-1} an EMA of earlier gradients, independent of
    g_t's draw), so across the tensor's elements

    - c_cv = mean(a b) / (mean(a) mean(b)) - 1 = CV^2(r), step 6's c itself; heavy-tailed r or
      noise make it a mean of few elements;
    - Cov(ln a, ln b) = Var(ln r) where the noise is multiplicative and independent between
      the two draws, and exp(Var) - 1 is the c of lognormal r with that spread, the reading
      ALIKE was calibrated in (partition docstring: c 0.5 <-> an RMS of 0.5 |ln(v_i / v_block)|
      ~ 0.33). Elements with g or m exactly 0 are left out of it.

    The step-1 statistic (CV^2(g^2) - 2) / 3 reads c from one draw, which needs g Gaussian;
    the recurrent gradients are not (research/results/high_lr_rnn.md, ``alike_c``: 34-399)."""
    ok = d2 > 0
    if not bool(ok.any()):
        return None
    d2 = d2[ok].double()
    a = g.double()[ok].square() / d2
    b = m_prev.double()[ok].square() / d2
    ma, mb = float(a.mean()), float(b.mean())
    if not (ma > 0 and mb > 0):
        return None
    c_cv = float((a * b).mean()) / (ma * mb) - 1.0
    nz = (a > 0) & (b > 0)
    if int(nz.sum()) < 2:
        return None
    la, lb = a[nz].log(), b[nz].log()
    cov = float(((la - la.mean()) * (lb - lb.mean())).mean())
    # R of step 2 read on the element variances: the share of their spread (Cov of the two
    # draws across elements, in g^2 units) that the shared model leaves unexplained
    x, y = a * d2, b * d2
    total = float(((x - x.mean()) * (y - y.mean())).mean())
    fit = d2 / d2.mean()
    resid = float(((x - x.mean() * fit) * (y - y.mean() * fit)).mean())
    r_model = resid / total if total > 0 else float("inf")
    return c_cv, cov, r_model


@dataclass
class TriggerState:
    """One tensor's trigger: EMAs (b2, bias-corrected as v is) of its per-step c_cv and
    Cov(ln a, ln b) (``trigger_spread``). It fires, and stays fired, once the spread c (the EMA
    of c_cv) has grown past what the partition accepted by more than one ALIKE:

        1 + c > (1 + c_0) (1 + ALIKE),   c_0 = max(the first reading, 0),

    i.e. the elements' variances, as ratios to the shared model r = r_0 * r_new, carry on top
    of the spread c_0 the blocks had when the partition accepted them (CV^2 composes as
    1 + c = (1 + c_0)(1 + c_new) for independent factors) a new spread c_new beyond step 6's
    ALIKE, the most one shared v is allowed to absorb. ``absolute`` fires at c > ALIKE
    instead (its first reading is above ALIKE on 153 of 178 tensor-runs of lstm, gru_wide and
    gpt2: research/results/high_lr_trigger.md)."""

    name: str
    numel: int
    block_size: int
    ema_cv: float = 0.0
    ema_log: float = 0.0
    count: int = 0
    fired: int | None = None
    trace: list = field(default_factory=list)
    peak: float = float("-inf")
    accept: float | None = None
    absolute: bool = False

    def limit(self) -> float:
        """The spread c at which the tensor's trigger fires."""
        if self.absolute or self.accept is None:
            return partition.ALIKE
        return (1.0 + max(self.accept, 0.0)) * (1.0 + partition.ALIKE) - 1.0

    def estimate(self, beta2: float) -> tuple[float, float]:
        bc = 1.0 - beta2**self.count
        return self.ema_cv / bc, math.expm1(min(self.ema_log / bc, 50.0))

    def add(self, c: tuple[float, float], step: int, beta2: float) -> None:
        self.count += 1
        self.ema_cv = beta2 * self.ema_cv + (1.0 - beta2) * c[0]
        self.ema_log = beta2 * self.ema_log + (1.0 - beta2) * c[1]
        cv, clog = self.estimate(beta2)
        if self.accept is None:
            self.accept = cv
            return
        self.peak = max(self.peak, cv)
        row = (
            step,
            round(c[0], 3),
            round(math.expm1(min(c[1], 50.0)), 3),
            round(cv, 3),
            round(clog, 3),
            round(c[2], 3),
        )
        if step % 10 == 0 or step < 10:
            self.trace.append(row)
        if self.fired is None and cv > self.limit():
            self.fired = step
            self.trace.append(row)


def _shared_model(g, st, h, levels, bits, f):
    """(m_{t-1}, d2) as (rows, cols) views of a whole tensor's segment: m as the codes hold it,
    d2 = v_b * c_j per element (v before this step's fold, c the factor this step uses)."""
    n, b = st.numel, st.block_size
    m = levels[mcodes.read_codes(st.codes, 0, n, bits).long()].float()
    c = None if f is None else (f.float() * h.bc2_sqrt).square()
    if b > 0:
        m = m.view(-1, b) * st.absmax[:, None]
        d2 = st.v[:, None].expand_as(m)
        if c is not None:
            d2 = d2 * c[None, :]
        return m, d2.float(), g.float().view(-1, b)
    period = -b
    m = m.view(-1, period) * st.absmax[None, :]
    d2 = st.v[None, :].expand_as(m)
    if c is not None:
        d2 = d2 * c[: m.shape[0], None]
    return m, d2.float(), g.float().view(-1, period)


def _switched_b1(p, g, st, h, levels, bits, factor, ptr):
    """One step of a tensor a trigger switched to B = 1 (bf16 m and v, ``dense_update``),
    its state made at the first such step from the blocked one: m from the codes, v the
    shared model v_b c_j per element."""
    key = (ptr, st.start)
    if key not in _B1:
        m, d2, _ = _shared_model(g, st, h, levels, bits, factor)
        _B1[key] = SimpleNamespace(
            start=st.start,
            numel=st.numel,
            exp_avg=m.reshape(-1).to(torch.bfloat16),
            exp_avg_sq=d2.reshape(-1).to(torch.bfloat16),
        )
    reference.dense_update(p, g, _B1[key], h)


def _triggered(orig):
    """``block_update`` / ``column_update`` with the trigger read before the update and, once
    it fired and a switch variant is on, the tensor's own per-element update instead."""

    def update(p, g, st, h, levels, mids, bits, factor=None):
        ptr = p.untyped_storage().data_ptr()
        whole = st.start == 0 and st.numel == p.numel()
        trig = _TRIG.get(ptr)
        if trig is None:
            trig = _TRIG[ptr] = TriggerState(
                _NAMES.get(ptr, str(ptr)),
                st.numel,
                st.block_size,
                absolute=_FLAGS.get("abs", False),
            )
        mode = "b1" if _FLAGS.get("trig_b1") else "c" if _FLAGS.get("trig_c") else ""
        if trig.fired is not None and mode:
            if mode == "c" and st.block_size > 0 and factor is not None:
                _TRIG_FIRED_C.add(ptr)
                return orig(p, g, st, h, levels, mids, bits, factor)
            return _switched_b1(p, g, st, h, levels, bits, factor, ptr)
        if whole and h.step > 1:
            m, d2, gv = _shared_model(g, st, h, levels, bits, factor)
            c = trigger_spread(gv, m, d2)
            if c is not None:
                trig.add(c, h.step, h.beta2)
        out = orig(p, g, st, h, levels, mids, bits, factor)
        TRIGGER_LOG[trig.name] = dict(
            numel=trig.numel,
            block_size=trig.block_size,
            fired=trig.fired,
            peak=round(trig.peak, 3),
            accept=None if trig.accept is None else round(trig.accept, 3),
            limit=round(trig.limit(), 3),
            last=[round(x, 3) for x in trig.estimate(h.beta2)] if trig.count else None,
            trace=trig.trace,
        )
        return out

    return update


# --- issue 43, helper h43b: lower-tail statistics, an EMA reference, an EMA of R ---------------

TRIG2_LOG: dict[str, dict] = {}
"""Per tensor name (``trig2`` / ``trig2_b1``): numel, block size, the step a rule fired at (None:
never) and ``rows``, one per step t >= 2 of ``tail_stats``'s values (``TAIL_FIELDS``)."""
_TRIG2: dict[int, Trigger2] = {}
_OWN2: dict[int, torch.Tensor] = {}
TAIL_FIELDS = (
    "step",
    "cv",
    "R",
    "la1",
    "la2",
    "sa1",
    "sa2",
    "lt",
    "st",
    "mlr",
    "cvt",
    "lb",
    "sb",
    "lbn",
    "sbn",
    "cfh",
    "cfn",
    "vt",
    "qh",
    "q1",
    "qt",
    "lw",
    "nw",
    "cw",
)


def tail_stats(g, m_prev, d2, own, t: int, beta1: float, beta2: float) -> dict | None:
    """How far the shared denominator over-estimates the elements' own variances, read from the
    shared model d2 = v_b c_j (raw EMAs, before this step's fold) and this step's draws.

    With the model bias-corrected, d = d2 / (1 - b2^(t-1)), the one-draw ratio a = g_t^2 / d and
    the two-draw one sqrt(a b), b = m_{t-1}^2 / d rescaled to mean(a) (m's scale against g^2
    depends on its signal share, so only its shape is used), per tensor:

    - ``la1`` / ``la2``: mean of ln max(ratio, CROSS_FLOOR) (the floor the factor itself has:
      below it the method treats a position as dead), one-draw / two-draw;
    - ``sa1`` / ``sa2``: share of elements with ratio < CROSS_FLOOR;
    - ``cv`` (= ``trigger_spread``'s c_t) and ``R`` (its R of step 2 on the element variances);
    - ``lb`` / ``sb``: the same of m's own reading, b = m_hat^2 / d (m_hat = m_{t-1} / (1 -
      b1^(t-1)), bias-corrected as AdamW's; m is an EMA over ~1 / (1 - b1) steps, so it reads an
      element's scale from several draws, which one g_t^2 cannot on bursty gradients);
      ``lbn`` / ``sbn`` with b in units of a noise-only element, bn = b (1 + b1) / (1 - b1)
      (E[m^2] = (1 - b1) / (1 + b1) E[g^2] for independent zero-mean draws);
    - ``cfh`` / ``cfn``: the floored log covariance of the two draws, Cov(ln max(a, F),
      ln max(b', F)) with b' = ``lb``'s / ``lbn``'s b (F = CROSS_FLOOR): Var(ln max(r, F)) where
      the two draws' noises are independent; the floor bounds what a near-dead element adds
      (unfloored, ``trigger_spread``'s Cov reached exp(Var) - 1 ~ 1e14);
    - ``qh`` / ``q1``: the step shortfall, a fractional moment the shared denominator's lower
      tail lowers: ln(mean (a b)^(1/4) / mean((a b)^(1/2))^(1/2)) (two draws) and
      ln(mean a^(1/2) / mean(a)^(1/2)) (one draw); each is ln(E sqrt(r) / sqrt(E r)) plus a
      constant of the draws' shape (a reference cancels it while the shape holds); ``qt`` its
      truth, ln(mean sqrt(r) / sqrt(mean r)); for lognormal r, -Var(ln r) / 8;
    - the truth the rule may not read (a per-element EMA of g^2, ``own``, AdamW's v): with
      r = own / d2, ``lt`` = mean ln max(r, CROSS_FLOOR), ``st`` = share r < CROSS_FLOOR,
      ``mlr`` = mean ln r, ``cvt`` = CV^2(r).
    """
    ok = d2 > 0
    if not bool(ok.any()) or t < 2:
        return None
    base = trigger_spread(g, m_prev, d2)
    if base is None:
        return None
    d = d2[ok].double() / (1.0 - beta2 ** (t - 1))
    a = g.double()[ok].square() / d
    b = m_prev.double()[ok].square() / d
    ma, mb = float(a.mean()), float(b.mean())
    bh = b / (1.0 - beta1 ** (t - 1)) ** 2
    bn = bh * (1.0 + beta1) / (1.0 - beta1)
    b = b * (ma / mb)
    two = (a * b).sqrt()
    fl = CROSS_FLOOR
    r = own.double()[ok] / d2[ok].double()
    la = a.clamp(min=fl).log()
    mr = float(r.mean())
    return dict(
        step=t,
        cv=base[0],
        R=base[2],
        la1=float(a.clamp(min=fl).log().mean()),
        la2=float(two.clamp(min=fl).log().mean()),
        sa1=float((a < fl).double().mean()),
        sa2=float((two < fl).double().mean()),
        lt=float(r.clamp(min=fl).log().mean()),
        st=float((r < fl).double().mean()),
        mlr=float(r.clamp(min=1e-30).log().mean()),
        cvt=float(r.var(unbiased=False) / (mr * mr)) if mr > 0 else float("nan"),
        lb=float(bh.clamp(min=fl).log().mean()),
        sb=float((bh < fl).double().mean()),
        lbn=float(bn.clamp(min=fl).log().mean()),
        sbn=float((bn < fl).double().mean()),
        cfh=_cov(la, bh.clamp(min=fl).log()),
        cfn=_cov(la, bn.clamp(min=fl).log()),
        vt=float(r.clamp(min=fl).log().var(unbiased=False)),
        qh=_half(a * bh),
        q1=float((a.sqrt().mean() / a.mean().sqrt()).log()),
        qt=float((r.sqrt().mean() / r.mean().sqrt()).log()) if mr > 0 else float("nan"),
    )


def _half(x: torch.Tensor) -> float:
    """ln(mean x^(1/4) / mean(x^(1/2))^(1/2)): the shortfall of sqrt(r) read from x ~ r^2."""
    q = x.sqrt()
    return float((q.sqrt().mean() / q.mean().sqrt()).log()) if float(q.mean()) > 0 else 0.0


def _cov(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(((x - x.mean()) * (y - y.mean())).mean())


def witness_index(shape: tuple[int, int], column_blocks: bool) -> torch.Tensor:
    """One element per block, on the diagonal of the (blocks, B) view (row blocks: block i's
    element i mod B) or of the (rows, P) view (column blocks: column j's row j mod rows), so
    the witnesses of a row-factored tensor fall in every column, not one: flat indices."""
    rows, cols = shape
    if column_blocks:
        j = torch.arange(cols)
        return (j % rows) * cols + j
    i = torch.arange(rows)
    return i * cols + i % cols


def witness_tail(own: torch.Tensor, d2: torch.Tensor, column_blocks: bool) -> dict:
    """``lt`` read on one witness element per block (``witness_index``): the own v (an EMA of
    g^2, AdamW's) of the witnesses only, 4 bytes (fp32; 2 as bf16) per block, against the
    shared model d2 = v_b c_j: ``lw`` = mean ln max(r_w, CROSS_FLOOR), ``nw`` witnesses, ``cw``
    = CV^2(r_w) (``cvt`` on the witnesses: the spread step 6 of the partition bounds)."""
    idx = witness_index(tuple(d2.shape), column_blocks)
    o, d = own.reshape(-1)[idx].double(), d2.reshape(-1)[idx].double()
    ok = d > 0
    r = o[ok] / d[ok]
    lw = float(r.clamp(min=CROSS_FLOOR).log().mean()) if int(ok.sum()) else float("nan")
    mr = float(r.mean()) if int(ok.sum()) else 0.0
    cw = float(r.var(unbiased=False) / (mr * mr)) if mr > 0 else float("nan")
    return dict(lw=lw, nw=int(ok.sum()), cw=cw)


def horizon(beta2: float) -> int:
    """The b2 EMA's horizon in steps, 1 / (1 - b2) (20 for b2 = 0.95)."""
    return round(1.0 / (1.0 - beta2))


RULES = (
    "tail1",
    "tail2",
    "tailb",
    "tailbn",
    "covh",
    "covn",
    "half",
    "half1",
    "cvh",
    "Rema",
    "witness",
    "truth",
    "at50",
    "at150",
    "at300",
)
"""The online rules ``Trigger2`` can act on (``trig2_b1,rule_NAME``), each from an EMA (b2,
bias-corrected) of one per-step statistic of ``tail_stats``, with the reference read at the b2
horizon (step 1 + horizon(b2), the first step whose EMA averages a full horizon):

- ``tail1`` / ``tail2`` / ``tailb`` / ``tailbn``: the lower-tail mean m = EMA of ``la1`` /
  ``la2`` / ``lb`` / ``lbn``; fires when it has
  fallen below its reference by ln(1 + ALIKE) / 2. Why this value: for lognormal ratios with
  mean 1 (the shared v is the block's mean), E ln r = -Var(ln r) / 2 and 1 + c = exp Var(ln r),
  so a drop of the mean log by ln(1 + ALIKE) / 2 is the spread growing by the factor
  (1 + ALIKE) that the partition's step 6 lets one shared v absorb (the growth rule of
  ``TriggerState``, with the lower tail's reading of the spread);
- ``covh`` / ``covn``: the floored log covariance (EMA of ``cfh`` / ``cfn``, Var ln max(r, F))
  has grown over its reference by ln(1 + ALIKE): the lognormal spread 1 + c = exp Var(ln r)
  grown by the factor (1 + ALIKE);
- ``half`` / ``half1``: the step shortfall (EMA of ``qh`` / ``q1``, ln E sqrt(r) / sqrt(E r) plus
  the draws' shape constant) has fallen below its reference by ln(1 + ALIKE) / 8: for lognormal
  r it is -Var(ln r) / 8, so that is the spread grown by the factor (1 + ALIKE);
- ``witness`` / ``truth``: the lower-tail rule on the own v's reading itself (no EMA: own v is
  one), of one witness element per block (``witness_tail``'s ``lw``: a per-block fp32 state) /
  of every element (``lt``: an oracle, it needs the per-element v the fallback would add);
- ``cvh``: ``TriggerState``'s growth rule, 1 + c > (1 + c_ref)(1 + ALIKE), its reference the
  EMA at the horizon instead of the first reading;
- ``Rema``: EMA of R > STRUCTURE (the shared model explains less of the element variances'
  covariance than the partition asked of a block, 1 - STRUCTURE);
- ``at50`` / ``at150`` / ``at300``: every tensor at that step, whatever the statistics: not a
  rule but a diagnosis (does per-element state from late in the run close a gap the first
  steps did not open?)."""


@dataclass
class Trigger2:
    """One tensor's EMAs of ``tail_stats``'s readings and the step each rule of ``RULES`` fired."""

    name: str
    numel: int
    block_size: int
    beta2: float
    count: int = 0
    ema: dict = field(default_factory=dict)
    ref: dict = field(default_factory=dict)
    fired: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)

    def add(self, x: dict) -> None:
        self.count += 1
        bc = 1.0 - self.beta2**self.count
        est = {}
        for k in ("cv", "R", "la1", "la2", "lb", "lbn", "cfh", "cfn", "qh", "q1"):
            v = x[k] if math.isfinite(x[k]) else self.ema.get(k, 0.0) / max(bc, 1e-12)
            self.ema[k] = self.beta2 * self.ema.get(k, 0.0) + (1.0 - self.beta2) * v
            est[k] = self.ema[k] / bc
        if self.count == horizon(self.beta2):
            self.ref = dict(est, lw=x["lw"], lt=x["lt"])
        drop = math.log1p(partition.ALIKE) / 2.0
        if self.ref:
            checks = dict(
                tail1=est["la1"] < self.ref["la1"] - drop,
                tail2=est["la2"] < self.ref["la2"] - drop,
                tailb=est["lb"] < self.ref["lb"] - drop,
                tailbn=est["lbn"] < self.ref["lbn"] - drop,
                covh=est["cfh"] > self.ref["cfh"] + 2.0 * drop,
                covn=est["cfn"] > self.ref["cfn"] + 2.0 * drop,
                half=est["qh"] < self.ref["qh"] - drop / 4.0,
                half1=est["q1"] < self.ref["q1"] - drop / 4.0,
                witness=x["lw"] < self.ref["lw"] - drop,
                truth=x["lt"] < self.ref["lt"] - drop,
                cvh=1.0 + est["cv"] > (1.0 + max(self.ref["cv"], 0.0)) * (1.0 + partition.ALIKE),
                Rema=est["R"] > partition.STRUCTURE,
                at50=x["step"] >= 50,
                at150=x["step"] >= 150,
                at300=x["step"] >= 300,
            )
            for k, hit in checks.items():
                if hit and k not in self.fired:
                    self.fired[k] = x["step"]
        self.rows.append([x["step"]] + [round(x[k], 4) for k in TAIL_FIELDS[1:]])


def _triggered2(orig):
    """``block_update`` / ``column_update`` with ``tail_stats`` read before the update and, under
    ``trig2_b1,rule_NAME``, the tensor switched to B = 1 (as ``trig_b1``) once rule NAME fired."""

    def update(p, g, st, h, levels, mids, bits, factor=None):
        ptr = p.untyped_storage().data_ptr()
        whole = st.start == 0 and st.numel == p.numel()
        trig = _TRIG2.get(ptr)
        if trig is None:
            trig = _TRIG2[ptr] = Trigger2(
                _NAMES.get(ptr, str(ptr)), st.numel, st.block_size, h.beta2
            )
        rule = next((k[5:] for k in _FLAGS if k.startswith("rule_")), None)
        if _FLAGS.get("trig2_b1") and rule in trig.fired:
            return _switched_b1(p, g, st, h, levels, bits, factor, ptr)
        if whole:
            m, d2, gv = _shared_model(g, st, h, levels, bits, factor)
            own = _OWN2.get(ptr)
            if own is not None and h.step > 1:
                x = tail_stats(gv, m, d2, own.view_as(d2), h.step, h.beta1, h.beta2)
                if x is not None:
                    x.update(witness_tail(own.view_as(d2), d2, st.block_size < 0))
                    trig.add(x)
            own = torch.zeros(gv.numel()) if own is None else own
            own.mul_(h.beta2).add_(gv.reshape(-1).square(), alpha=1.0 - h.beta2)
            _OWN2[ptr] = own
        out = orig(p, g, st, h, levels, mids, bits, factor)
        TRIG2_LOG[trig.name] = dict(
            numel=trig.numel,
            block_size=trig.block_size,
            fired=dict(trig.fired),
            ref={k: round(v, 4) for k, v in trig.ref.items()},
            rows=trig.rows,
        )
        return out

    return update


def _naming(orig):
    """``tasks.build`` that also names the model's parameters for the trigger's log."""

    def build(task, seed):
        inst = orig(task, seed)
        for n, q in inst.model.named_parameters():
            _NAMES[q.untyped_storage().data_ptr()] = n
        return inst

    return build


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


def zero_pinned_codebook(counts, bits: int) -> torch.Tensor:
    """``codebook.learn_codebook`` with 0 pinned as well as -1 and +1 (variant ``zero``): the
    exact optimum over [-1 | free | 0 | free | +1], each half solved by the pinned DP on the
    half mapped onto [-1, 1] (a uniform scale of the error, so the same optimum), and the free
    levels split between the halves at the least total error."""
    import numpy as np

    from gefen_dist.method import codebook as cb

    w = cb._as_counts(counts)
    x = cb.bin_centers(w.size).numpy()
    n_free = (1 << bits) - 3
    halves = []
    for sel, to in ((x < 0, lambda y: 2 * y + 1), (x > 0, lambda y: 2 * y - 1)):
        xs, ws = to(x[sel]), w[sel]
        nz = ws > 0
        halves.append((np.ascontiguousarray(xs[nz]), np.ascontiguousarray(ws[nz])))
    best = None
    for k in range(n_free + 1):
        (xn, wn), (xp, wp) = halves
        ln, cn = cb._pinned_dp(xn, wn, k + 2)
        lp, cp = cb._pinned_dp(xp, wp, n_free - k + 2)
        if best is None or cn + cp < best[0]:
            best = (cn + cp, (ln - 1) / 2, (lp + 1) / 2)
    levels = np.concatenate([best[1][:-1], best[2]])
    return cb._to_float32_levels(cb._fill_empty(levels))


_PHI = (5**0.5 - 1) / 2


def quasi_random_codes(x: torch.Tensor, first: int, step: int, levels: torch.Tensor):
    """``reference.stochastic_codes`` with each element's u walking its own golden-ratio
    sequence over steps: for an m that stays in one cell, the rounding's running sum stays
    within one spacing of the exact one instead of growing as sqrt(steps)."""
    index = torch.arange(first, first + x.numel(), device=x.device)
    u0 = mcodes.uniforms(0, index).double()
    u = torch.frac(u0 + (step * _PHI) % 1.0).float()
    return mcodes.stochastic_quantize(x, levels, u)


def nearest_codes(x: torch.Tensor, first: int, step: int, levels: torch.Tensor):
    """4-bit codes rounded to the nearest level (variant ``near``), as 8-bit codes are and as
    torchao's 4-bit state is, instead of stochastically."""
    return reference.quantize(x, (levels[1:] + levels[:-1]) / 2)


def _scaled_bins(orig):
    """``first_step._bin_scaled`` that counts g0 under ``mcol,gN``'s scales (variant ``cbn``):
    the codebook is then learned from the values it will code, not from g0 / row absmax. It
    takes the rows ``bin_segment`` hands it (one chunk's, so the column scale is that chunk's,
    not the whole tensor's); column blocks and rows of N or fewer are counted as built."""

    def bin_scaled(x: torch.Tensor, amax: torch.Tensor, acc: torch.Tensor) -> None:
        n = _group()
        if not n or amax.dim() != 2 or amax.shape[1] != 1 or x.shape[1] <= n:
            return orig(x, amax, acc)
        lev = x / _or_one(column_scale(x))[None, :]
        orig(lev, per_element(group_absmax(lev, n), n, lev.shape[1]), acc)

    return bin_scaled


@contextlib.contextmanager
def variant(name: str, watch: bool = False, gates: int = 0):
    """Run Gefen under switch ``name`` (module docstring) inside the block."""
    from gefen_dist import optimizer as gopt
    from gefen_dist.bench import tasks
    from gefen_dist.method import partition, state

    saved = dict(
        impl=gopt.Gefen._impl,
        ub=reference._update_blocks,
        dense=gopt.dense_update,
        cbs=partition.choose_block_size,
        cl=state.cross_length,
        bu=gopt.block_update,
        cu=gopt.column_update,
        build=tasks.build,
        learn=mcb.learn_codebook,
        sc=reference.stochastic_codes,
    )
    if "qr" in name.split(","):
        reference.stochastic_codes = quasi_random_codes
    from gefen_dist import first_step

    saved["bins"] = first_step._bin_scaled
    if "cbn" in name.split(","):
        first_step._bin_scaled = _scaled_bins(saved["bins"])
    if "near" in name.split(","):
        reference.stochastic_codes = nearest_codes
    if "zero" in name.split(","):
        mcb.learn_codebook = zero_pinned_codebook
    if "dyn" in name.split(","):
        mcb.learn_codebook = lambda counts, bits: mcb.dynamic_levels(bits)
    _FLAGS.clear()
    _FLAGS.update({k: True for k in name.split(",")})
    _FLAGS.update({"watch": watch, "gates": gates or (4 if "gate_c" in _FLAGS else 0)})
    _SHADOW.clear()
    _EXACT.clear()
    _VC.clear()
    _HV.clear()
    _CELEM.clear()
    _PREVF.clear()
    _GABS.clear()
    _MCOL.clear()
    _MCOL_NEXT.clear()
    _MCOL_FIRST.clear()
    _TRIG.clear()
    _TRIG_FIRED_C.clear()
    _B1.clear()
    TRIGGER_LOG.clear()
    gopt.Gefen._impl = lambda self, p, g: "reference"
    reference._update_blocks = _update_blocks
    gopt.dense_update = _dense_watch(saved["dense"])
    if "per_element" in _FLAGS:
        partition.choose_block_size = lambda stats, numel, row=0: 1
    if "rows" in _FLAGS:
        partition.choose_block_size = lambda stats, numel, row=0: row if row > 1 else 1
    if "no_factor" in _FLAGS:
        state.cross_length = lambda block_size, tensor_numel: 0
    _TRIG2.clear()
    _OWN2.clear()
    TRIG2_LOG.clear()
    if {"trig2", "trig2_b1"} & _FLAGS.keys():
        gopt.block_update = _triggered2(saved["bu"])
        gopt.column_update = _triggered2(saved["cu"])
        tasks.build = _naming(saved["build"])
    if any(k.startswith(("exact_m:", "clipname:")) for k in _FLAGS):
        tasks.build = _naming(saved["build"])
    if {"trig", "trig_b1", "trig_c"} & _FLAGS.keys():
        gopt.block_update = _triggered(saved["bu"])
        gopt.column_update = _triggered(saved["cu"])
        tasks.build = _naming(saved["build"])
    try:
        yield
    finally:
        gopt.Gefen._impl = saved["impl"]
        reference._update_blocks = saved["ub"]
        gopt.dense_update = saved["dense"]
        partition.choose_block_size = saved["cbs"]
        state.cross_length = saved["cl"]
        gopt.block_update = saved["bu"]
        gopt.column_update = saved["cu"]
        tasks.build = saved["build"]
        mcb.learn_codebook = saved["learn"]
        reference.stochastic_codes = saved["sc"]
        first_step._bin_scaled = saved["bins"]
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
