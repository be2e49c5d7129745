"""Gefen under DeepSpeed ZeRO-1/2/3 on the tiny GPT, against single-process Gefen.

Run by tests/test_deepspeed.py under the deepspeed launcher: ``ds_zero.py OUT CKPT`` trains on
2 ranks and writes OUT/rank{r}.json; ``ds_zero.py OUT CKPT resize`` (1 rank) tries to resume the
2-rank checkpoints. Each rank feeds its own batch; the single-process reference averages the two
ranks' gradients as ZeRO does, (g0 + g1) / 2, which is exact in fp32 for 2 ranks, so the first
gradient, and with it block sizes and codebook, is bitwise the same on both sides.
"""

import functools
import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT

import gefen_dist.integrations.deepspeed as gd
from gefen_dist import Gefen
from gefen_dist.demo.model import GPT, GPTConfig
from gefen_dist.integrations.deepspeed.binding import binding_of
from teardown import finish

torch.set_num_threads(1)

TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=64)
STEPS, SAVE_AT, LR = 6, 3, 3e-3
# 8-bit codes, as when test_deepspeed.py's tolerances were measured (the default became 4 since)
BITS = 8
Gefen8 = functools.partial(Gefen, bits=BITS)


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 + 10 * step + rank)
    x = torch.randint(0, 256, (4, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


DECAY_ORDER = ["mlp.c_fc", "mlp.c_proj", "attn.c_attn", "attn.c_proj", "wte", "wpe"]


def param_groups(model):
    """Biases and norms first: with only B = 1 tensors in it, a codebook learned from the first
    group alone would be learned from nothing. The weights are ordered so that the middle of the
    ZeRO-1 flat buffer, where the two ranks' partitions meet, cuts a block of c_attn."""
    named = list(model.named_parameters())

    def rank(n):
        return next(i for i, k in enumerate(DECAY_ORDER) if k in n)

    decay = sorted([(n, p) for n, p in named if p.dim() >= 2], key=lambda x: rank(x[0]))
    return [
        dict(params=[p for _, p in named if p.dim() < 2], weight_decay=0.0),
        dict(params=[p for _, p in decay], weight_decay=0.1),
    ]


def reference():
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = Gefen8(param_groups(model), lr=LR)
    losses, after1 = [], None
    for s in range(STEPS):
        grads, ls = [], []
        for r in range(2):
            model.zero_grad(set_to_none=True)
            loss = model(*batch(s, r))[1]
            loss.backward()
            ls.append(loss.detach())
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
            p.grad = (g0 + g1) / 2
        opt.step()
        losses.append(float((ls[0] + ls[1]) / 2))
        if s == 0:
            after1 = {n: p.detach().clone() for n, p in model.named_parameters()}
    blocks = {n: int(opt.state[p]["layout"][0, 3]) for n, p in model.named_parameters()}
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    mem = opt.memory_report()["state_bytes"]
    cb = opt.codebooks[BITS]
    return dict(losses=losses, after1=after1, final=final, blocks=blocks, codebook=cb, memory=mem)


def config(zero, extra=None):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0; the reference does not clip
        "zero_optimization": dict(zero),
        "steps_per_print": 10**6,
        **(extra or {}),
    }


def engine(run, seed=0, opt_cls=Gefen8, zero=None):
    torch.manual_seed(seed)
    model = GPT(TINY).to(run.get("dtype", torch.float32))
    opt = opt_cls(param_groups(model), lr=LR)
    cfg = config(zero or run["zero"], run.get("extra"))
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return eng


def train_step(eng, s):
    loss = eng(*batch(s, dist.get_rank()))[1]
    eng.backward(loss)
    eng.step()
    loss = loss.detach().float()
    dist.all_reduce(loss)
    return float(loss / dist.get_world_size())


def full_params(eng):
    named = list(eng.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {n: p.detach().clone() for n, p in named}


def cut_blocks(eng):
    """[tensor, lo, hi] of every block that a partition boundary cuts, over all ranks."""
    b = binding_of(eng)
    sizes = gd.block_sizes(eng)
    local = []
    for f in b.flats:
        for seg, label in zip(f.segments, f.labels, strict=True):
            bs = sizes.get(label, 1)
            if not seg.name or bs == 1:
                continue
            if bs < 0:  # columns: a piece of the tensor cuts every column it holds
                if seg.numel < seg.tensor_numel:
                    local.append((label, 0, seg.tensor_numel))
                continue
            for edge in (seg.start, seg.start + seg.numel):
                if edge % bs and 0 < edge < seg.tensor_numel:
                    lo = edge // bs * bs
                    local.append((label, lo, min(lo + bs, seg.tensor_numel)))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    return [list(c) for c in sorted({tuple(c) for part in every for c in part})]


def diffs(a, b, cuts):
    """Largest difference outside the blocks that partition boundaries cut, and inside them."""
    outside, inside = 0.0, 0.0
    for n in a:
        d = (a[n] - b[n]).abs().view(-1)
        mask = torch.zeros_like(d, dtype=torch.bool)
        for name, lo, hi in cuts:
            if name == n:
                mask[lo:hi] = True
        if (~mask).any():
            outside = max(outside, float(d[~mask].max()))
        if mask.any():
            inside = max(inside, float(d[mask].max()))
    return outside, inside


def state_bytes(opt):
    """Bytes of optimizer state proper, for an AdamW inner optimizer (exp_avg, exp_avg_sq)."""
    return sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for k, v in st.items()
        if torch.is_tensor(v) and k != "step"
    )


def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return f"{type(e).__name__}: {e}"
    return None


def run_one(name, run, ref, ckpt):
    out = {}
    eng = engine(run)
    out["wrapper"] = type(eng.optimizer).__name__
    out["partitions"] = len(binding_of(eng).flats)
    losses = [train_step(eng, 0)]
    out["cut_blocks"] = cut_blocks(eng)
    if ref is not None:
        out["after1_outside"], out["after1_inside"] = diffs(
            full_params(eng), ref["after1"], out["cut_blocks"]
        )
    for s in range(1, STEPS):
        if s == SAVE_AT:
            eng.save_checkpoint(ckpt, tag=name)
            saved = full_params(eng)
            out["saved_sums"] = {n: float(p.double().sum()) for n, p in saved.items()}
        losses.append(train_step(eng, s))
    out["losses"] = losses
    out["codebook"] = eng.optimizer.optimizer.codebooks[BITS].tolist()
    out["blocks"] = gd.block_sizes(eng)
    out["memory"] = {k: v for k, v in gd.memory_report(eng).items() if k != "tensors"}
    final = full_params(eng)

    resumed = engine(run, seed=1)
    resumed.load_checkpoint(ckpt, tag=name)
    out["resumed_losses"] = [train_step(resumed, s) for s in range(SAVE_AT, STEPS)]
    again = full_params(resumed)
    out["resume_exact"] = all(torch.equal(final[n], again[n]) for n in final)
    out["resumed_codebook"] = resumed.optimizer.optimizer.codebooks[BITS].tolist()

    if run.get("adamw"):
        adamw = engine(run, opt_cls=torch.optim.AdamW)
        train_step(adamw, 0)
        out["adamw_state_bytes"] = state_bytes(adamw.optimizer.optimizer)
    return out


RUNS = {
    "zero1": dict(zero={"stage": 1}, adamw=True),
    "zero2": dict(zero={"stage": 2, "round_robin_gradients": True}, adamw=True),
    "zero3": dict(zero={"stage": 3, "sub_group_size": 8000}, adamw=True),
    "zero2_offload": dict(
        zero={"stage": 2, "offload_optimizer": {"device": "cpu"}},
        extra={"zero_force_ds_cpu_optimizer": False},
    ),
    "bf16_zero1": dict(
        zero={"stage": 1},
        extra={"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
        dtype=torch.bfloat16,
    ),
}


def refusals(ckpt):
    """Configurations and checkpoints Gefen refuses, with the messages it gives."""
    z2 = RUNS["zero2"]
    out = {
        "elastic": error_of(lambda: engine(z2, zero={**z2["zero"], "elastic_checkpoint": True})),
        "universal": error_of(
            lambda: engine({**z2, "extra": {"checkpoint": {"load_universal": True}}})
        ),
        "zero2_into_zero1": error_of(lambda: engine(RUNS["zero1"]).load_checkpoint(ckpt, "zero2")),
        "zero2_into_zero3_engine": error_of(
            lambda: engine(RUNS["zero3"]).load_checkpoint(ckpt, "zero2")
        ),
    }
    files = sorted(Path(ckpt, "zero2").glob("*optim_states.pt"))
    saved = torch.load(files[dist.get_rank()], weights_only=False)
    gefen_sd = saved[OPTIMIZER_STATE_DICT][BASE_OPTIMIZER_STATE]
    out["zero2_state_into_zero3"] = error_of(
        lambda: engine(RUNS["zero3"]).optimizer.optimizer.load_state_dict(gefen_sd)
    )
    plain = Gefen(GPT(TINY).parameters()).state_dict()
    out["plain_state"] = error_of(lambda: engine(z2).optimizer.optimizer.load_state_dict(plain))
    return out


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out_dir, ckpt = Path(args[0]), args[1]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    res = {"rank": rank, "world_size": dist.get_world_size(), "ckpt": ckpt}
    if args[2:] == ["resize"]:
        for name in ("zero2", "zero3"):
            res[name] = error_of(lambda n=name: engine(RUNS[n]).load_checkpoint(ckpt, tag=n))
    else:
        ref = reference()
        res["ref"] = {k: ref[k] for k in ("losses", "blocks", "memory")}
        res["ref"]["codebook"] = ref["codebook"].tolist()
        for name, run in RUNS.items():
            fp32 = run.get("dtype", torch.float32) == torch.float32
            res[name] = run_one(name, run, ref if fp32 else None, ckpt)
        res["refused"] = refusals(ckpt)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
    finish()
