"""A fuzz of ``Gefen.load_state_dict``: each mutated state dict is refused, naming the parameter
and the key, or loads and steps to finite parameters. Never a crash, never NaN.

Why: a fuzz of 300 mutated state dicts had found 12 that loaded and turned the parameters
non-finite and 14 that loaded and then crashed inside ``step()`` (``gefen_dist.method.load_check``).
This one runs in CI, seeded, over a state of every kind Gefen keeps: B = 1 (bf16 m and v),
row blocks and column blocks, each factored (``v_cross``) and not. The gradients are fixed
tensors rather than a loss's: the test asks what the optimizer does with a state, and a loss
would add the model's answer to a parameter that a permuted v moved by lr * m / eps (finite,
and what such a state means). ``docs/fuzz.md`` records a run's summary (``python -m pytest
tests/test_load_fuzz.py -q -s`` prints it).
"""

from __future__ import annotations

import copy
import io
import math
import random
import time
from collections import Counter, defaultdict

import pytest
import torch
from dist_util import read_results, torchrun

import gefen_dist
from gefen_dist import Gefen
from gefen_dist.method.partition import MAX_BLOCK
from gefen_dist.method.state import STATE_KEYS

pytestmark = pytest.mark.unit

torch.set_num_threads(1)

# name: (shape, how its gradients vary, block sizes memory_report must show, v_cross entries)
MODEL = {
    "fc1.weight": ((256, 192), "rows", [192], 192),  # row blocks, 256 of them: factored
    "fc2.weight": ((256, 192), "cols", [-192], 256),  # column blocks, factored per row
    "head.weight": ((8, 512), "rows", [512], 0),  # 8 row blocks: too few to factor
    "proj.weight": ((512, 8), "cols", [-8], 0),  # columns of 8: too few to factor
    "fc1.bias": ((192,), "elements", [1], 0),  # under partition.MIN_SHARED_NUMEL
    "norm.weight": ((5000,), "elements", [1], 0),  # scales in no pattern: B = 1
}
TRAIN, STEPS = 3, 3  # steps before the state is saved; steps after each accepted load
PER_KIND = 16  # mutations of each kind at each bit width
FLOAT_KEYS = ("step", "codebook", "absmax", "v", "v_cross", "exp_avg", "exp_avg_sq")


def _grad(how: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if how == "rows":
        return torch.exp(torch.randn(shape[0], 1, generator=g)) * torch.randn(shape, generator=g)
    if how == "cols":
        return torch.exp(torch.randn(1, shape[1], generator=g)) * torch.randn(shape, generator=g)
    return torch.exp(torch.randn(shape, generator=g)) * torch.randn(shape, generator=g)


GRADS = [
    {n: _grad(how, shape, 100 * t + i) for i, (n, (shape, how, _, _)) in enumerate(MODEL.items())}
    for t in range(TRAIN + STEPS)
]
WEIGHTS = {
    n: 0.1 * torch.randn(shape, generator=torch.Generator().manual_seed(i))
    for i, (n, (shape, _, _, _)) in enumerate(MODEL.items())
}
NAMES = list(MODEL)


def _optimizer(params: dict[str, torch.Tensor], bits: int) -> Gefen:
    return Gefen(list(params.items()), lr=1e-3, weight_decay=0.1, bits=bits)


def _step(opt: Gefen, params: dict[str, torch.Tensor], t: int) -> None:
    for n, p in params.items():
        p.grad = GRADS[t][n]
    opt.step()


@pytest.fixture(scope="module", params=[4, 8])
def saved(request):
    """A state dict after TRAIN steps, as bytes (each mutation loads its own copy)."""
    bits = request.param
    params = {n: w.clone().requires_grad_() for n, w in WEIGHTS.items()}
    opt = _optimizer(params, bits)
    for t in range(TRAIN):
        _step(opt, params, t)
    rows = {r["name"]: r for r in opt.memory_report()["tensors"]}
    for n, (shape, _, blocks, cross) in MODEL.items():
        row = rows[f"parameter {n!r} {shape}"]
        assert row["block_sizes"] == blocks, (n, row["block_sizes"])
        assert opt.state[params[n]]["v_cross"].numel() == cross, n
    kinds = {tuple(r["block_sizes"]) for r in rows.values()}
    assert (1,) in kinds and any(b[0] > 1 for b in kinds) and any(b[0] < 0 for b in kinds)
    factored = [n for n in MODEL if opt.state[params[n]]["v_cross"].numel()]
    assert len(factored) == 2 and len(factored) < sum(b != [1] for _, _, b, _ in MODEL.values())
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return bits, buf.getvalue()


def _load(blob: bytes) -> dict:
    return torch.load(io.BytesIO(blob), weights_only=True)


# -- mutations: each changes one thing of one parameter's entry, and says which key ------------
def _pick(rng, sd, keys, min_numel=1):
    """A (parameter index, key) whose tensor has at least ``min_numel`` elements."""
    pool = [
        (pid, k)
        for pid, st in sorted(sd["state"].items())
        for k in keys
        if isinstance(st.get(k), torch.Tensor) and st[k].numel() >= min_numel
    ]
    return rng.choice(pool)


def _one(rng, t: torch.Tensor) -> int:
    return rng.randrange(t.numel())


def _set(t: torch.Tensor, i: int, value) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[i] = value
    return t


def m_dtype(rng, sd):
    pid, k = _pick(rng, sd, STATE_KEYS, 0)
    t = sd["state"][pid][k]
    choices = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32]
    choices += [torch.int64, torch.uint8, torch.bool]
    dt = rng.choice([d for d in choices if d != t.dtype])
    sd["state"][pid][k] = t.to(dt)
    return pid, k, f"{t.dtype} -> {dt}"


def m_shape(rng, sd):
    pid, k = _pick(rng, sd, STATE_KEYS, 0)
    t = sd["state"][pid][k]
    how = rng.choice(["unsqueeze", "grow", "flatten-2d"])
    if how == "unsqueeze":
        new = t.unsqueeze(0)
    elif how == "grow":
        new = torch.cat([t.reshape(-1), t.new_zeros(1)])
    else:
        new = t.reshape(-1) if t.dim() == 2 else t.reshape(1, -1)
    sd["state"][pid][k] = new
    return pid, k, f"{tuple(t.shape)} -> {tuple(new.shape)}"


def m_nan(rng, sd):
    pid, k = _pick(rng, sd, FLOAT_KEYS)
    t = sd["state"][pid][k]
    i = _one(rng, t)
    sd["state"][pid][k] = _set(t, i, float("nan"))
    return pid, k, f"[{i}] = nan"


def m_inf(rng, sd):
    pid, k = _pick(rng, sd, FLOAT_KEYS)
    t = sd["state"][pid][k]
    i, sign = _one(rng, t), rng.choice([1, -1])
    sd["state"][pid][k] = _set(t, i, sign * math.inf)
    return pid, k, f"[{i}] = {sign * math.inf}"


def m_times_1e30(rng, sd):
    pid, k = _pick(rng, sd, FLOAT_KEYS)
    t = sd["state"][pid][k]
    if rng.random() < 0.5:
        sd["state"][pid][k] = t * 1e30
        return pid, k, "all * 1e30"
    i = _one(rng, t)
    sd["state"][pid][k] = _set(t, i, float(t.reshape(-1)[i]) * 1e30)
    return pid, k, f"[{i}] * 1e30"


def m_negative(rng, sd):
    pid, k = _pick(rng, sd, FLOAT_KEYS + ("layout",))
    t = sd["state"][pid][k]
    if rng.random() < 0.5:
        sd["state"][pid][k] = -t
        return pid, k, "all negated"
    i = _one(rng, t)
    sd["state"][pid][k] = _set(t, i, -abs(t.reshape(-1)[i].item()) - 1)
    return pid, k, f"[{i}] = -(|x| + 1)"


def m_permutation(rng, sd):
    pid, k = _pick(rng, sd, STATE_KEYS, 2)
    t = sd["state"][pid][k]
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    perm = torch.randperm(t.numel(), generator=g)
    sd["state"][pid][k] = t.reshape(-1)[perm].reshape(t.shape)
    return pid, k, "elements permuted"


def m_key_removed(rng, sd):
    pid, k = _pick(rng, sd, STATE_KEYS, 0)
    del sd["state"][pid][k]
    return pid, k, "removed"


def m_key_added(rng, sd):
    pid = rng.choice(sorted(sd["state"]))
    k = rng.choice(["exp_avg_max", "momentum_buffer", "v_row", "codebook_v2"])
    value = rng.choice([torch.zeros(3), torch.tensor(1.0), 0.5, "x"])
    sd["state"][pid][k] = value
    return pid, k, f"added ({type(value).__name__})"


def m_bit_flip(rng, sd):
    pid, k = _pick(rng, sd, STATE_KEYS)
    t = sd["state"][pid][k].clone().contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    flips = []
    for _ in range(rng.randint(1, 3)):
        i, b = rng.randrange(raw.numel()), rng.randrange(8)
        raw[i] ^= 1 << b
        flips.append(f"byte {i} bit {b}")
    sd["state"][pid][k] = t
    return pid, k, ", ".join(flips)


def m_truncation(rng, sd):
    pid, k = _pick(rng, sd, STATE_KEYS)
    t = sd["state"][pid][k]
    n = rng.randrange(t.numel())
    sd["state"][pid][k] = t.reshape(-1)[:n].clone()
    return pid, k, f"{t.numel()} -> {n} elements"


STEP_VALUES = {
    "nan": lambda: torch.tensor(math.nan),
    "inf": lambda: torch.tensor(math.inf),
    "-inf": lambda: torch.tensor(-math.inf),
    "-1": lambda: torch.tensor(-1.0),
    "2.5": lambda: torch.tensor(2.5),
    "empty": lambda: torch.zeros(0),
    "shape (2,)": lambda: torch.tensor([3.0, 3.0]),
    "shape (1,)": lambda: torch.tensor([3.0]),
    "1e30": lambda: torch.tensor(1e30),
    "2**24 + 1 (int64)": lambda: torch.tensor(2**24 + 1),
    "2**24": lambda: torch.tensor(float(2**24)),
    "bool": lambda: torch.tensor(True),
    "complex": lambda: torch.tensor(3 + 0j),
    "int64 7": lambda: torch.tensor(7),
    "float64 3": lambda: torch.tensor(3.0, dtype=torch.float64),
    "python float": lambda: 3.0,
    "0": lambda: torch.tensor(0.0),
}


def m_step(rng, sd):
    pid = rng.choice(sorted(sd["state"]))
    what = rng.choice(sorted(STEP_VALUES))
    sd["state"][pid]["step"] = STEP_VALUES[what]()
    return pid, "step", what


def m_strided_view(rng, sd):
    """The same values as a strided view, as torch.save keeps them: must load."""
    pid, k = _pick(rng, sd, STATE_KEYS, 2)
    t = sd["state"][pid][k]
    view = torch.stack([t, t], dim=-1)[..., 0]
    assert not view.is_contiguous() and torch.equal(view, t)
    sd["state"][pid][k] = view
    return pid, k, "strided view"


def m_not_a_tensor(rng, sd):
    pid, k = _pick(rng, sd, STATE_KEYS, 0)
    t = sd["state"][pid][k]
    sd["state"][pid][k] = rng.choice([t.tolist(), None, float(t.numel())])
    return pid, k, f"replaced by {type(sd['state'][pid][k]).__name__}"


def m_alias(rng, sd):
    """One tensor under two keys of one entry, as a careless converter might write it."""
    pairs = [("v", "absmax"), ("absmax", "v"), ("exp_avg", "exp_avg_sq"), ("exp_avg_sq", "exp_avg")]
    pid, k = _pick(rng, sd, [a for a, _ in pairs])
    other = dict(pairs)[k]
    sd["state"][pid][k] = sd["state"][pid][other]
    return pid, k, f"is {other!r}"


def m_codebook(rng, sd):
    pid = rng.choice(sorted(sd["state"]))
    levels = sd["state"][pid]["codebook"]
    n = levels.numel()
    how = rng.choice(
        ["end inward", "end outward", "swap", "duplicate", "fp64 inexact", "fp64 exact", "fp16"]
        + ["other width", "uniform"]
    )
    new = levels.clone()
    if how == "end inward":
        new[rng.choice([0, -1])] *= 0.99
    elif how == "end outward":
        new[rng.choice([0, -1])] *= 1.5
    elif how == "swap":
        i = rng.randrange(n - 1)
        new[[i, i + 1]] = new[[i + 1, i]]
    elif how == "duplicate":
        i = rng.randrange(1, n - 1)
        new[i] = new[i + 1]
    elif how == "fp64 inexact":
        new = new.double()
        new[rng.randrange(1, n - 1)] += 1e-12
    elif how == "fp64 exact":
        new = new.double()
    elif how == "fp16":
        new = new.half()
    elif how == "other width":
        new = torch.linspace(-1, 1, 272 - n)
    else:
        new = torch.linspace(-1, 1, n)
    sd["state"][pid]["codebook"] = new
    return pid, "codebook", how


def m_codes(rng, sd):
    """Random code bytes: every byte is a valid code (pair), so these must load and step."""
    pid, k = _pick(rng, sd, ["codes"])
    t = sd["state"][pid][k]
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    sd["state"][pid][k] = torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g)
    return pid, k, "random bytes"


def m_layout(rng, sd):
    pid = rng.choice(sorted(sd["state"]))
    layout = sd["state"][pid]["layout"].clone()
    col = rng.choice([0, 1, 2, 3, 3, 3, 4])
    old = int(layout[0, col])
    if col == 3:
        new = [old + 1, 2 * old, -old, 1, 0, MAX_BLOCK + 1, 10**12, old // 2 or 2]
    else:
        new = [old + 1, old - 1, old + 10**6]
    new = rng.choice([n for n in new if n != old])
    layout[0, col] = new
    sd["state"][pid]["layout"] = layout
    return pid, "layout", f"column {col}: {old} -> {new}"


def m_entry(rng, sd):
    """The whole entry replaced: the refusal can name only the parameter."""
    pid = rng.choice(sorted(sd["state"]))
    how = rng.choice(["tensor", "none", "empty dict", "another parameter's"])
    if how == "tensor":
        sd["state"][pid] = torch.zeros(3)
    elif how == "none":
        sd["state"][pid] = None
    elif how == "empty dict":
        sd["state"][pid] = {}
    else:
        sd["state"][pid] = dict(sd["state"][rng.choice(sorted(sd["state"]))])
    return pid, None, how


def m_value(rng, sd):
    """One element set to a finite value of any magnitude and sign."""
    pid, k = _pick(rng, sd, FLOAT_KEYS)
    t = sd["state"][pid][k]
    i = _one(rng, t)
    value = rng.choice([1, -1]) * 10.0 ** rng.uniform(-40, 38)
    sd["state"][pid][k] = _set(t, i, value)
    return pid, k, f"[{i}] = {value:.3g}"


MUTATIONS = {
    "dtype": m_dtype,
    "shape": m_shape,
    "nan": m_nan,
    "inf": m_inf,
    "x1e30": m_times_1e30,
    "negative": m_negative,
    "permutation": m_permutation,
    "key removed": m_key_removed,
    "key added": m_key_added,
    "bit flip": m_bit_flip,
    "truncation": m_truncation,
    "step value": m_step,
    "strided view": m_strided_view,
    "not a tensor": m_not_a_tensor,
    "alias": m_alias,
    "codebook": m_codebook,
    "random codes": m_codes,
    "layout": m_layout,
    "whole entry": m_entry,
    "any finite value": m_value,
}
MUST_LOAD = {"strided view", "random codes"}  # nothing wrong with these: refusing them is a bug


# -- the outcome of one mutated load -------------------------------------------------------------
def _snapshot(opt: Gefen) -> tuple:
    state = {p: {k: (v, v.clone()) for k, v in st.items()} for p, st in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return state, copy.deepcopy(groups), dict(opt.codebooks)


def _unchanged(opt: Gefen, snap: tuple) -> bool:
    state, groups, books = snap
    if set(opt.state) != set(state) or dict(opt.codebooks) != books:
        return False
    for p, st in state.items():
        if set(opt.state[p]) != set(st):
            return False
        for k, (obj, copy_) in st.items():
            if opt.state[p][k] is not obj or not torch.equal(obj, copy_):
                return False
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups


def _attempt(bits: int, blob: bytes, sd: dict, pid: int, key: str | None) -> tuple[str, str]:
    """('refused' | 'loaded', '') or ('failure', what went wrong)."""
    params = {n: w.clone().requires_grad_() for n, w in WEIGHTS.items()}
    opt = _optimizer(params, bits)
    opt.load_state_dict(_load(blob))  # a state that a refused load must leave as it was
    snap = _snapshot(opt)
    name = f"{NAMES[pid]!r}"
    try:
        opt.load_state_dict(sd)
    except (ValueError, TypeError) as e:
        msg = str(e)
        if name not in msg or (key is not None and f"'{key}'" not in msg):
            return "failure", f"refused without naming {name} and {key!r}: {msg}"
        if not _unchanged(opt, snap):
            return "failure", f"a refused load changed the optimizer: {msg}"
        return "refused", msg
    except Exception as e:  # noqa: BLE001 - any other error is the crash this test hunts
        return "failure", f"load crashed: {type(e).__name__}: {e}"
    try:
        for t in range(TRAIN, TRAIN + STEPS):
            _step(opt, params, t)
    except Exception as e:  # noqa: BLE001
        return "failure", f"step crashed: {type(e).__name__}: {e}"
    bad = [n for n, p in params.items() if not bool(torch.isfinite(p).all())]
    if bad:
        return "failure", f"non-finite parameters {bad}"
    try:  # what the accepted state stepped into is itself a state that loads
        _optimizer(params, bits).load_state_dict(opt.state_dict())
    except Exception as e:  # noqa: BLE001
        return "failure", f"the stepped state no longer loads: {type(e).__name__}: {e}"
    return "loaded", ""


@pytest.mark.slow  # PER_KIND mutations of each kind, each loaded and stepped, per width
def test_every_mutation_is_refused_by_name_or_steps_finite(saved):
    bits, blob = saved
    rng = random.Random(1000 + bits)
    counts: dict[str, Counter] = defaultdict(Counter)
    failures = []
    t0 = time.perf_counter()
    for i in range(PER_KIND * len(MUTATIONS)):
        kind = list(MUTATIONS)[i % len(MUTATIONS)]
        sd = _load(blob)
        pid, key, what = MUTATIONS[kind](rng, sd)
        outcome, detail = _attempt(bits, blob, sd, pid, key)
        if outcome == "refused" and kind in MUST_LOAD:
            outcome, detail = "failure", f"a sound state was refused: {detail}"
        counts[kind][outcome] += 1
        if outcome == "failure":
            failures.append(f"{kind} {NAMES[pid]} {key} ({what}): {detail}")
    wall = time.perf_counter() - t0
    total = sum(counts.values(), Counter())
    lines = [f"bits={bits}: {sum(total.values())} mutations in {wall:.1f} s"]
    lines.append(f"{'kind':<18} {'tried':>5} {'refused':>8} {'loaded, finite':>15} {'failed':>7}")
    for kind in MUTATIONS:
        c = counts[kind]
        lines.append(
            f"{kind:<18} {sum(c.values()):>5} {c['refused']:>8} {c['loaded']:>15} {c['failure']:>7}"
        )
    lines.append(
        f"{'all':<18} {sum(total.values()):>5} {total['refused']:>8} {total['loaded']:>15} "
        f"{total['failure']:>7}"
    )
    print("\n" + "\n".join(lines))
    assert not failures, "\n".join(failures[:20])
    for kind in MUTATIONS:  # each kind ran, and the dangerous ones were refused at least once
        assert sum(counts[kind].values()) == PER_KIND
    for kind in ("nan", "inf", "x1e30", "key removed", "truncation", "step value"):
        assert counts[kind]["refused"], kind


# -- what the fuzz asks, one case at a time ------------------------------------------------------
def _trained(bits: int = 4) -> tuple[dict[str, torch.Tensor], Gefen]:
    params = {n: w.clone().requires_grad_() for n, w in WEIGHTS.items()}
    opt = _optimizer(params, bits)
    for t in range(TRAIN):
        _step(opt, params, t)
    return params, opt


def test_a_refusal_names_the_parameter_the_key_and_what_is_wrong():
    _, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    v = sd["state"][0]["v"]
    v[[17, 40, 41]] = torch.tensor([math.nan, math.inf, -math.inf])
    with pytest.raises(ValueError) as e:
        _optimizer(_trained()[0], 4).load_state_dict(sd)
    assert str(e.value) == (
        "Gefen state of parameter 'fc1.weight' (256, 192): 'v' has 3 non-finite values "
        "(first at index 17: nan)"
    )


def test_a_refused_load_leaves_the_optimizer_as_it_was():
    """Every parameter is checked before any is installed: a state dict whose last parameter is
    bad changes nothing, not the earlier parameters' state, not the param groups' settings, and
    the optimizer then steps exactly as its twin that never saw the load."""
    params, opt = _trained()
    twin_params, twin = _trained()
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():  # a state that would change everything, had it loaded
        st["v"] = st["v"] * 4
        st["step"] = st["step"] + 10
    sd["param_groups"][0]["lr"] = 0.5
    last = max(sd["state"])
    sd["state"][last]["exp_avg_sq"] = -sd["state"][last]["exp_avg_sq"]
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match=r"'norm.weight'.*'exp_avg_sq' has .* negative"):
        opt.load_state_dict(sd)
    assert _unchanged(opt, snap)
    assert opt.param_groups[0]["lr"] == 1e-3
    for t in range(TRAIN, TRAIN + STEPS):
        _step(opt, params, t)
        _step(twin, twin_params, t)
    for n in params:
        assert torch.equal(params[n], twin_params[n]), n


@pytest.mark.parametrize("what", sorted(STEP_VALUES))
def test_step_values(what):
    """A whole number from 0 to 2**24 in a float or integer scalar loads (as fp32) and counts
    on; anything else is refused naming 'step'."""
    params, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["step"] = STEP_VALUES[what]()
    fresh = _optimizer(params, 4)
    value = sd["state"][0]["step"]
    sound = (
        isinstance(value, torch.Tensor)
        and value.shape == ()
        and value.dtype not in (torch.bool, torch.complex64)
        and 0 <= float(value) <= 2**24
        and float(value) == int(float(value))
    )
    if not sound:
        with pytest.raises((ValueError, TypeError), match=r"'fc1.weight'.*'step'"):
            fresh.load_state_dict(sd)
        return
    fresh.load_state_dict(sd)
    _step(fresh, params, TRAIN)
    st = fresh.state[params["fc1.weight"]]["step"]
    assert st.dtype == torch.float32 and st.device.type == "cpu"
    assert float(st) == min(float(value) + 1, 2**24)
    assert all(bool(torch.isfinite(p).all()) for p in params.values())


def test_an_accepted_view_or_fp32_moment_loads_as_the_state_it_stands_for():
    """A strided view is copied contiguous, an fp32 B = 1 moment (an earlier version's) is
    rounded to bf16 once: the run goes on exactly as from the state as saved."""
    params, opt = _trained()
    sd = opt.state_dict()
    weights = {n: p.detach().clone() for n, p in params.items()}
    odd = copy.deepcopy(sd)
    for st in odd["state"].values():
        st["v"] = torch.stack([st["v"], st["v"]], dim=-1)[..., 0]
        st["exp_avg"] = st["exp_avg"].float()
    runs = []
    for d in (copy.deepcopy(sd), odd):
        ps = {n: w.clone().requires_grad_() for n, w in weights.items()}
        o = _optimizer(ps, 4)
        o.load_state_dict(d)
        for t in range(TRAIN, TRAIN + STEPS):
            _step(o, ps, t)
        runs.append(ps)
    for n in params:
        assert torch.equal(runs[0][n], runs[1][n]), n


# -- non-finite gradients (load_check's docstring, docs/faults.md) ------------------------------
def test_the_first_step_refuses_a_non_finite_gradient_and_writes_nothing():
    """Refused by name at the first step, before any state is allocated or any count moves; a
    parameter that already has state, stepped in the same call, is left as it was."""
    params, opt = _trained()
    late = torch.zeros(64, 96, requires_grad=True)
    opt.add_param_group({"params": [late], "param_names": ["late.weight"]})
    snap = _snapshot(opt)
    before = {n: p.detach().clone() for n, p in params.items()}
    for n, p in params.items():
        p.grad = GRADS[TRAIN][n]
    late.grad = torch.randn(64, 96)
    late.grad[3, 5] = math.nan
    with pytest.raises(ValueError, match=r"non-finite gradient in parameter 'late.weight'"):
        opt.step()
    assert _unchanged(opt, snap) and late not in opt.state
    assert torch.equal(late, torch.zeros(64, 96))
    for n, p in params.items():
        assert torch.equal(p, before[n]), n
    late.grad[3, 5] = 0.0
    opt.step()  # and the same call with a finite gradient goes on
    assert late in opt.state


def test_a_later_non_finite_gradient_poisons_what_the_docs_say_and_its_state_will_not_load():
    """At later steps Gefen takes the step as AdamW does. One NaN element of fc1.weight (row
    blocks of 192, factored) turns non-finite its block (row 0) and, through its v_cross
    entry, its position (column 7) in every block; one in norm.weight (B = 1) only itself.
    A checkpoint of that state is refused by name."""
    params, opt = _trained()
    for n, p in params.items():
        p.grad = GRADS[TRAIN][n].clone()
    params["fc1.weight"].grad[0, 7] = math.nan
    params["norm.weight"].grad[11] = math.inf
    opt.step()
    for t in range(TRAIN + 1, TRAIN + STEPS):
        _step(opt, params, t)
    bad = ~torch.isfinite(params["fc1.weight"])
    want = torch.zeros(256, 192, dtype=torch.bool)
    want[0, :] = want[:, 7] = True
    assert torch.equal(bad, want)
    bad = ~torch.isfinite(params["norm.weight"])
    assert bad.nonzero().view(-1).tolist() == [11]
    for n in ("fc2.weight", "head.weight", "proj.weight", "fc1.bias"):
        assert bool(torch.isfinite(params[n]).all()), n
    with pytest.raises(ValueError, match=r"'fc1.weight'.*'v' has 1 non-finite value"):
        _optimizer(params, 4).load_state_dict(opt.state_dict())


def test_check_gradients_refuses_by_name_before_anything_is_written():
    params, opt = _trained()
    for n, p in params.items():
        p.grad = GRADS[TRAIN][n].clone()
    gefen_dist.check_gradients(opt)  # finite: nothing to say
    params["head.weight"].grad[2, 3] = math.inf
    params["norm.weight"].grad[0] = math.nan
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match=r"'head.weight'.*, parameter 'norm.weight'"):
        gefen_dist.check_gradients(opt)
    assert _unchanged(opt, snap)
    # finite gradients whose norm overflows fp32 are not refused: only NaN and inf are
    for n, p in params.items():
        p.grad = GRADS[TRAIN][n].clone()
    params["fc2.weight"].grad.fill_(3e30)
    params["fc1.bias"].grad = None
    gefen_dist.check_gradients(opt)


# -- FSDP2 checkpoints through DCP, damaged in their files and values --------------------------
@pytest.fixture(scope="module")
def dcp_damage(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp_fuzz")
    t0 = time.perf_counter()
    torchrun("dcp_load_fuzz.py", str(root / "out"), str(root / "ck"), "4")
    ranks = read_results(root / "out", ranks=2)
    print(f"\nFSDP2 DCP damages: {len(ranks[0])} on 2 ranks in {time.perf_counter() - t0:.1f} s")
    for name in DCP_NAMES:
        print(f"  {name}: " + " / ".join(r[name]["stage"] for r in ranks))
    return ranks


DCP_DAMAGES = [
    "rank 1's .distcp truncated to half",
    "rank 0's .distcp short by 100 bytes",
    ".metadata truncated",
    "NaN in rank 0's v",
    "negative v on rank 1",
    "inf in rank 0's v_cross",
    "exp_avg x 1e30 on rank 1",
    "NaN in every codebook",
    "bit flips in rank 1's v, absmax, v_cross, codes",
    "step NaN",
    "rank 1's block values dropped",
    "rank 1's v truncated",
    "random codes on rank 0",
    "undamaged",
]


DCP_NAMES = [d if isinstance(d, str) else d.values[0] for d in DCP_DAMAGES]


@pytest.mark.dist
@pytest.mark.parametrize("damage", DCP_DAMAGES)
def test_a_damaged_fsdp2_checkpoint_is_refused_by_name_or_steps_finite(dcp_damage, damage):
    got = [r[damage] for r in dcp_damage]
    expect = got[0]["expect"]
    stages = [g["stage"] for g in got]
    assert not any(s.startswith("crash") for s in stages), got
    if expect == "dcp":  # DCP's reader refuses it on every rank, before any Gefen hook runs
        assert stages == ["dcp.load", "dcp.load"], got
        return
    refused = [g for g in got if g["stage"] == "refused"]
    for g in refused:  # by name, and nothing installed
        assert g["kept"] and "Gefen state " in g["message"] and "parameter '" in g["message"], g
    if expect == "load":
        assert stages == ["loaded", "loaded"] and all(g["finite"] for g in got), got
    elif expect == "either":
        assert refused or all(g["finite"] for g in got), got
    else:
        param, key = expect
        assert refused, got
        assert any(
            (param is None or f"{param!r}" in g["message"])
            and (key is None or f"{key!r}" in g["message"])
            for g in refused
        ), got


@pytest.mark.dist
def test_check_gradients_refuses_on_every_rank_where_one_rank_holds_a_nan(dcp_damage):
    """A NaN in rank 1's shard only: rank 1 names the parameter, rank 0 refuses too, so no
    rank goes on into the step's collectives alone."""
    r0, r1 = (r["check_gradients"]["refused"] for r in dcp_damage)
    assert r1 and "'transformer.h.0.mlp.c_proj.weight'" in r1
    assert r0 and "a parameter on another rank" in r0
