"""What a loaded Gefen state must hold before any of it is installed, and what a step does with a
gradient that holds NaN or inf.

Why check values at all: ``state.check_loaded`` used to check only the structure (keys, layout,
dtypes, shapes), and a fuzz of 300 mutated state dicts found 26 that passed it and then broke the
run: a NaN, an inf or a negative second moment loaded and turned the parameters non-finite a
step later, and a ``step`` of NaN, inf, -1 or an empty tensor crashed inside ``step()`` with
errors that named nothing. Each value here is checked against what a run can write, in one
read of each state tensor at load (a min/max reduction; the codes are not read at all) and
nothing at step time.

What each key may hold, and why:

- ``v``, ``exp_avg_sq``, ``v_cross``: finite and >= 0. They are EMAs of g^2; the update takes
  their square root, and ``v_cross``'s mean normalises the whole tensor's factor, so one bad
  entry reaches every element at its position (a NaN there also turns the mean, hence the
  normalisation, off for the rest).
- ``exp_avg`` (B = 1) and ``absmax`` (the scale of a block's m): |x| <= 2**64, absmax >= 0.
  Why 2**64: m is an EMA of gradients, so |m| never exceeds the largest |g| folded into it, nor
  does ``absmax``, the largest |m| of a block (each stored m is a level in [-1, 1] times it).
  A gradient of 2**64 or more has a square fp32 cannot hold (2**128 is past its largest
  value), so v, the EMA of g^2 that the check above holds finite, cannot follow it: where g^2
  is formed in fp32 (the reference and numba updates) v turns inf at once; the C++ kernel sums
  g^2 in fp64 and v overflows only once (1 - b2^t) g^2 passes fp32's largest value, so there a
  run whose gradients sit at or above 2**64 keeps a finite v, and an m past the bound, for a
  while before its v overflows too (v's fixed point, mean g^2, is past fp32). Its checkpoint
  is refused; no other run's is. The bound also keeps the update finite: its largest term,
  lr / (1 - b1) * 2**64 / eps, overflows fp32 only where eps / lr < 2**64 / ((1 - b1) *
  3.4e38), 5e-19 at b1 = 0.9. Not checked: |m| against sqrt(v). Cauchy-Schwarz bounds it, by
  (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2)) times sqrt(B v), only while b1^2 < b2, and those
  are the betas of the run's history, which the state does not record: a bound that depends
  on them would refuse good checkpoints of runs with other betas.
- ``codes``: any byte. At 8 bits each byte is one of the 256 levels; at 4 bits each nibble is
  one of 16, and the unused high nibble of a segment of odd length is never read. No code
  value is invalid, so the codes are not read.
- ``codebook``: 16 or 256 levels as the bits say, finite, strictly increasing (every kernel
  rounds by searching them in order), ends at exactly -1 and +1 (a block's absmax element is
  stored at +-1: an end inside shrinks each block's largest m at every step, one outside can
  store it larger than it was, step after step, until it overflows), in a floating dtype
  whose levels fp32, the kernels' dtype, holds exactly.
- ``step``: a scalar (shape ()) of a float or integer dtype holding a whole number in
  [0, 2**24]. The count is kept in fp32, as AdamW's, where + 1 stops counting at 2**24, so no
  run writes more; beyond it the count no longer counts. The update reads it as an integer
  (NaN, inf and an empty tensor had crashed it there, naming nothing).
- ``layout``: int64, one row per segment of the parameter (``state.check_loaded`` compares it
  with the parameter's segments), block sizes 1 to ``partition.MAX_BLOCK`` or -(row length),
  which is every block size the partition has chosen in any revision.
- Every value a dense, strided tensor with data (not meta), and no two of one parameter's
  tensors sharing memory: the update writes each in place. A tensor saved as a strided view
  is accepted (``state.upgrade`` copies it contiguous: the kernels read state as flat memory).
- No key but the nine of ``state.STATE_KEYS``: a key this version does not know was written by
  another optimizer or a later version, whose state would be dropped without a word.

A violation raises ValueError (TypeError where a value is not a tensor at all) naming the
parameter, the key and what is wrong; the optimizer's load pre-hook checks every parameter
before anything is installed, so a refused load leaves the optimizer as it was.

Non-finite gradients at run time. At the first step at which a parameter has a gradient, a
NaN or inf in it is refused by name (``Gefen._initialize``): the block partition and the
codebook are learned once from that gradient and would stay wrong for the rest of the run. The
refusal comes before any state is allocated or any step count moves, so nothing is written.
At later steps Gefen takes the step, as torch.optim.AdamW does, and does not look. Measured
(``docs/faults.md``): one NaN element turns non-finite its block's v and its B parameters,
its position's ``v_cross`` entry and, through it, that position's parameter in every block of
the tensor, and turns off the factor's normalisation for the rest of the tensor (the mean of
``v_cross`` is NaN); for B = 1, only its own m, v and parameter. Why not refuse there too: a
refusal that leaves nothing written needs a read of every gradient before the first parameter
moves, 0.2-0.3 of a CPU step on a 16M-element tensor (the kind of pass that taking the factor's
sums inside the update removed, ``docs/step_time.md``), and under sharding an all-reduce per
step so that every rank refuses together. The usual guards already
catch it before ``step()``: GradScaler skips such steps under fp16 AMP, and
``torch.nn.utils.clip_grad_norm_(..., error_if_nonfinite=True)`` raises.
``gefen_dist.check_gradients`` does the same naming the parameters, agreeing over the
optimizer's process group. A state a poisoned step left behind is refused by name when loaded,
so such a checkpoint cannot resume a run unnoticed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

MOMENT_BOUND = 2.0**64
"""Largest |exp_avg| and absmax a loaded state may hold (module docstring)."""
MAX_STEP = 2**24
"""Largest step count: fp32 counts exactly up to here, and + 1 stays here."""

KEYS = ("step", "layout", "codebook", "codes", "absmax", "v", "v_cross", "exp_avg", "exp_avg_sq")
DTYPES = {
    "layout": torch.int64,
    "codes": torch.uint8,
    "absmax": torch.float32,
    "v": torch.float32,
    "v_cross": torch.float32,
    "exp_avg": torch.bfloat16,
    "exp_avg_sq": torch.bfloat16,
}
"""Dtypes as ``state.allocate`` writes them, after ``state.upgrade``'s conversions. ``step`` and
``codebook`` take more (see ``check_step``, ``check_codebook``)."""
RANGES = {
    "absmax": (0.0, MOMENT_BOUND),
    "v": (0.0, math.inf),
    "v_cross": (0.0, math.inf),
    "exp_avg": (-MOMENT_BOUND, MOMENT_BOUND),
    "exp_avg_sq": (0.0, math.inf),
}
"""Closed range of each key's values; inf stands for the dtype's largest finite value."""


def _where(name: str) -> str:
    return f"Gefen state of {name}"


def check_entry(state: Any, name: str) -> None:
    """A parameter's entry: a dict of exactly Gefen's keys, each a dense tensor with data of the
    dtype its kind takes. First, so that the checks after it may read every value as one."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{_where(name)} is a {type(state).__name__}, not a dict of tensors: not a Gefen "
            "state dict?"
        )
    missing = [k for k in KEYS if k not in state]
    if missing:
        raise ValueError(f"{_where(name)} lacks {missing}: not a Gefen state dict?")
    unknown = [k for k in state if k not in KEYS]
    if unknown:
        raise ValueError(
            f"{_where(name)} has keys {unknown} that Gefen's state does not have ({list(KEYS)}): "
            "written by another optimizer, or by a later gefen_dist whose state this one would "
            "drop?"
        )
    for k in KEYS:
        t = state[k]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_where(name)}: {k!r} is a {type(t).__name__}, not a tensor")
        if t.layout != torch.strided:
            raise TypeError(f"{_where(name)}: {k!r} is a {t.layout} tensor, not a dense one")
        if t.device.type == "meta":
            raise ValueError(f"{_where(name)}: {k!r} is on the meta device: it holds no values")
        want = DTYPES.get(k)
        if want is not None and t.dtype != want:
            raise ValueError(f"{_where(name)}: {k!r} is {t.dtype}, expected {want}")
        if k == "codebook" and not t.is_floating_point():
            raise ValueError(
                f"{_where(name)}: 'codebook' is {t.dtype}, expected a float dtype (torch.float32)"
            )


def check_step(step: torch.Tensor, name: str) -> None:
    """The step count: its bias corrections and the stochastic rounding's hash read it as a
    whole number, and the kept plans as a host-side scalar."""
    where = f"{_where(name)}: 'step'"
    if step.dtype == torch.bool or step.is_complex():
        raise ValueError(f"{where} is {step.dtype}, expected a float or integer dtype")
    if step.shape != ():
        raise ValueError(f"{where} has shape {tuple(step.shape)}, expected a scalar, shape ()")
    value = float(step)
    if not math.isfinite(value) or value < 0 or value != math.floor(value) or value > MAX_STEP:
        raise ValueError(
            f"{where} is {value!r}, expected a whole number from 0 to 2**24 = {MAX_STEP} (the "
            "count is kept in fp32, which counts no further)"
        )


def check_codebook(levels: torch.Tensor, bits: int, name: str) -> None:
    """The levels of m, as every kernel reads them: see the module docstring."""
    where = f"{_where(name)}: 'codebook'"
    want = 1 << bits
    if levels.dim() != 1 or levels.numel() != want:
        raise ValueError(
            f"{where} holds a {levels.numel()}-level codebook of shape {tuple(levels.shape)} "
            f"but its param group asks for bits={bits} ({want} levels, shape ({want},))"
        )
    levels = _local(levels).detach().cpu()
    l32 = levels.float()
    if levels.dtype != torch.float32 and not torch.equal(l32.to(levels.dtype), levels):
        raise ValueError(
            f"{where} holds {levels.dtype} levels that fp32, the kernels' dtype, does not hold "
            "exactly"
        )
    if not bool(torch.isfinite(l32).all()) or not bool((l32[1:] > l32[:-1]).all()):
        raise ValueError(
            f"{where} must hold finite, strictly increasing levels (every kernel rounds by "
            "searching them in order)"
        )
    if float(l32[0]) != -1.0 or float(l32[-1]) != 1.0:
        raise ValueError(
            f"{where} ends at {float(l32[0])!r} and {float(l32[-1])!r}, not at -1 and +1: each "
            "block's absmax element is stored at +-1, so other ends shrink or grow every "
            "block's largest m at each step"
        )


def check_distinct(state: Mapping[str, torch.Tensor], name: str) -> None:
    """No two of one parameter's tensors share memory: each is updated in place, so a state whose
    v and absmax were one tensor would have each step overwrite one with the other. ``step`` is
    left out: the optimizer installs a copy of it."""
    spans = []
    for k in KEYS:
        t = state[k]
        if k == "step" or t.numel() == 0:
            continue
        t = _local(t)
        base = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        spans.append((t.device, base, base + t.numel() * t.element_size(), k))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    for (dev_a, _, end_a, a), (dev_b, lo_b, _, b) in zip(spans, spans[1:], strict=False):
        if dev_a == dev_b and lo_b < end_a:
            raise ValueError(
                f"{_where(name)}: {a!r} and {b!r} share memory; each must be a tensor of its own "
                "(the step writes both in place)"
            )


def check_values(state: Mapping[str, torch.Tensor], name: str) -> None:
    """Every moment and scale within its range (``RANGES``): one min/max reduction per tensor,
    and the details read again only for a refusal."""
    for k, (lo, hi) in RANGES.items():
        t = _local(state[k]).detach()
        if t.numel() == 0:
            continue
        top = torch.finfo(t.dtype).max if hi == math.inf else hi
        low = -torch.finfo(t.dtype).max if lo == -math.inf else lo
        least, most = (float(x) for x in torch.aminmax(t.reshape(-1)))
        if low <= least and most <= top:  # False for NaN, which the reduction propagates
            continue
        raise ValueError(f"{_where(name)}: {k!r} has {_faults(t, lo, hi)}")


def _faults(t: torch.Tensor, lo: float, hi: float) -> str:
    """What is wrong with a tensor's values, for the refusal's message."""
    x = t.reshape(-1).float()
    finite = torch.isfinite(x)
    bad = ~finite
    parts = []
    n = int(bad.sum())
    if n:
        parts.append(f"{n} non-finite value{'s' if n > 1 else ''}")
    if lo == 0.0:
        neg = finite & (x < 0)
        bad |= neg
        if int(neg.sum()):
            parts.append(f"{int(neg.sum())} negative value{'s' if int(neg.sum()) > 1 else ''}")
    if hi < math.inf:
        big = finite & (x.abs() > hi)
        bad |= big
        if int(big.sum()):
            parts.append(
                f"{int(big.sum())} value{'s' if int(big.sum()) > 1 else ''} beyond "
                "+-2**64, more than any gradient whose square fp32 holds can build up"
            )
    first = int(bad.nonzero()[0, 0])
    return f"{' and '.join(parts)} (first at index {first}: {float(x[first])!r})"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local values (an FSDP2 checkpoint's replicated codebook may load as one)."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local
