"""Gefen from a DeepSpeed JSON under pipeline parallelism: 2 stages, ZeRO-1, on 2 CPU ranks.

Run by tests/test_pipeline.py under the deepspeed launcher: ``ds_pipeline.py OUT CKPT`` writes
OUT/rank{r}.json. Two ranks and two stages leave a data-parallel world of 1, so ZeRO-1 forms one
flat partition per stage holding the whole of that stage's layers, and each stage's Gefen is a
separate optimizer that sees only its own layers' gradients. The single-process reference is
therefore built per stage: the same four layers, seeded alike, run in one process on the same
micro-batches, with one Gefen over each stage's layers (and, for comparison, one Gefen over all of
them). Each rank builds it itself; the model is small enough that this costs less than a launch.
"""

import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

import gefen_dist
import gefen_dist.integrations.deepspeed as gd
from gefen_dist import Gefen
from gefen_dist.demo.model import Block, GPTConfig
from gefen_dist.integrations.deepspeed.binding import binding_of
from teardown import finish

torch.set_num_threads(1)
gefen_dist.register()

TINY = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=64)
STEPS, SAVE_AT, MICRO = 6, 3, 2
CONFIG = json.loads((Path(__file__).parents[2] / "configs/ds_pipeline_zero1_cpu.json").read_text())
"""The shipped config: ZeRO-1, Gefen from the JSON, no clipping (DeepSpeed's default is 1.0;
the reference does not clip), MICRO micro-batches per step."""
PARAMS = CONFIG["optimizer"]["params"]
assert CONFIG["gradient_accumulation_steps"] == MICRO


class Embed(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    """ln_f and an untied lm_head: a tied embedding would be a weight shared across stages,
    which the pipeline all-reduces between them (TiedLayerSpec), a layout this test leaves out."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def layers(seed: int) -> list[nn.Module]:
    """Embed, the blocks, Head: with "uniform" partitioning stage 0 holds Embed and block 0."""
    torch.manual_seed(seed)
    out = [Embed(TINY), *(Block(TINY) for _ in range(TINY.n_layer)), Head(TINY)]
    for m in out:
        for p in m.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
    return out


def micro_batch(step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh tokens every step, from 16 of the 256 byte values: a loss the model can lower in a
    few steps (from ln 256 towards ln 16), where uniform bytes leave it flat."""
    g = torch.Generator().manual_seed(1000 + 10 * step + m)
    x = torch.randint(0, 16, (4, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def batches(first: int, last: int):
    """What both stages pull from ``train_batch``'s iterator: stage 0 the inputs, stage 1 the
    labels, MICRO micro-batches a step."""
    return iter([micro_batch(s, m) for s in range(first, last) for m in range(MICRO)])


def kwargs() -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in PARAMS.items()}


# -- single-process reference ------------------------------------------------------------------
def reference(stage_of: dict[str, int]) -> dict:
    """One process, the same layers and micro-batches, (loss_m / MICRO).backward() per
    micro-batch as the pipeline engine scales them; one Gefen per stage's layers, and one over
    the whole model, fed copies of the same gradients."""
    model = nn.Sequential(*layers(0))
    whole = nn.Sequential(*layers(0))
    named = list(model.named_parameters())
    per_stage = [
        Gefen([p for n, p in named if stage_of[n] == s], **kwargs())
        for s in sorted(set(stage_of.values()))
    ]
    whole_opt = Gefen(whole.parameters(), **kwargs())
    losses, whole_losses, after1 = [], [], None
    for s in range(STEPS):
        for net, out in ((model, losses), (whole, whole_losses)):
            net.zero_grad(set_to_none=True)
            total = torch.zeros(())
            for m in range(MICRO):
                x, y = micro_batch(s, m)
                loss = loss_fn(net(x), y)
                (loss / MICRO).backward()
                total += loss.detach()
            out.append(float(total / MICRO))
        for opt in per_stage:
            opt.step()
        whole_opt.step()
        if s == 0:
            after1 = {n: p.detach().clone() for n, p in named}
    return dict(
        losses=losses,
        whole_losses=whole_losses,
        blocks={n: int(opt_state(per_stage, p)["layout"][0, 3]) for n, p in named},
        whole_blocks={
            n: int(whole_opt.state[p]["layout"][0, 3]) for n, p in whole.named_parameters()
        },
        codebooks=[opt.codebooks[PARAMS["bits"]].tolist() for opt in per_stage],
        whole_codebook=whole_opt.codebooks[PARAMS["bits"]].tolist(),
        after1=after1,
        final={n: p.detach().clone() for n, p in named},
        stage_state_bytes=[opt.memory_report()["state_bytes"] for opt in per_stage],
    )


def opt_state(opts: list[Gefen], p: torch.Tensor) -> dict:
    return next(o.state[p] for o in opts if p in o.state)


# -- pipeline ----------------------------------------------------------------------------------
def engine(seed: int, specs=None, config=None):
    module = PipelineModule(
        layers=specs or layers(seed), num_stages=2, loss_fn=loss_fn, partition_method="uniform"
    )
    cfg = config or CONFIG
    eng, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    return eng


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((p - b[n]).abs().max()) for n, p in a.items())


def adamw_state_bytes() -> int:
    """Bytes of exp_avg and exp_avg_sq that AdamW named in the same JSON keeps on this stage."""
    cfg = {**CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": PARAMS["lr"]}}}
    eng = engine(0, config=cfg)
    eng.train_batch(batches(0, 1))
    return sum(
        v.numel() * v.element_size()
        for st in eng.optimizer.optimizer.state.values()
        for k, v in st.items()
        if torch.is_tensor(v) and k != "step"
    )


class TiedEmbedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cfg.vocab_size, cfg.n_embd) * 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight)


def tied_refusal(stage: int) -> str | None:
    """The error for an input embedding tied to the output head across the two stages."""
    specs = [
        TiedLayerSpec("embed", TiedEmbedding, TINY, tied_weight_attr="weight"),
        LayerSpec(Block, TINY),
        LayerSpec(Block, TINY),
        TiedLayerSpec("embed", TiedEmbedding, TINY, forward_fn=lambda m, x: x @ m.weight.t()),
    ]
    cfg = {**CONFIG, "zero_optimization": {"stage": stage}}
    try:
        engine(0, specs=specs, config=cfg)
    except ValueError as e:
        return str(e)
    return None


def local_params(eng) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in eng.module.named_parameters()}


def gefen_state(eng) -> list[dict[str, torch.Tensor]]:
    opt = eng.optimizer.optimizer
    return [
        {k: v.clone() for k, v in opt.state[f.tensor].items() if torch.is_tensor(v)}
        for f in binding_of(eng).flats
    ]


def states_equal(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def train(eng, first: int, last: int) -> list[float]:
    it = batches(first, last)
    return [float(eng.train_batch(it)) for _ in range(first, last)]


def run(ckpt: str) -> dict:
    eng = engine(0)
    stage = eng.stage_id
    mine = set(n for n, _ in eng.module.named_parameters())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (stage, sorted(mine)))
    stage_of = {n: s for s, names in every for n in names}
    ref = reference(stage_of)

    wrapper = eng.optimizer
    gefen = wrapper.optimizer
    held = sum(f.tensor.numel() for f in binding_of(eng).flats)
    losses = train(eng, 0, 1)
    after1 = max_diff(local_params(eng), ref["after1"])
    losses += train(eng, 1, SAVE_AT)
    eng.save_checkpoint(ckpt, tag="pipe")
    losses += train(eng, SAVE_AT, STEPS)
    final, final_state = local_params(eng), gefen_state(eng)

    resumed = engine(1)
    fresh_differs = any(not torch.equal(p, final[n]) for n, p in local_params(resumed).items())
    resumed.load_checkpoint(ckpt, tag="pipe")
    resumed_losses = train(resumed, SAVE_AT, STEPS)
    mem = {k: v for k, v in gd.memory_report(eng).items() if k != "tensors"}
    return dict(
        stage=stage,
        names=sorted(mine),
        engine=type(eng).__name__,
        wrapper=type(wrapper).__name__,
        basic=type(eng.basic_optimizer).__name__,
        inner_is_gefen=isinstance(gefen, Gefen) and gefen is eng.basic_optimizer,
        dp_world_size=eng.dp_world_size,
        partitions=len(binding_of(eng).flats),
        held_numel=held,
        memory=mem,
        blocks=gd.block_sizes(eng),
        codebook=gefen.codebooks[PARAMS["bits"]].tolist(),
        losses=losses,
        after1_diff_vs_ref=after1,
        final_diff_vs_ref=max_diff(final, ref["final"]),
        adamw_state_bytes=adamw_state_bytes(),
        tied_refused={s: tied_refusal(s) for s in (0, 1)},
        fresh_differs=fresh_differs,
        resumed_losses=resumed_losses,
        resume_params_exact=all(torch.equal(p, final[n]) for n, p in local_params(resumed).items()),
        resume_state_exact=states_equal(final_state, gefen_state(resumed)),
        ref={k: ref[k] for k in ref if k not in ("final", "after1")},
    )


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out_dir, ckpt = Path(args[0]), args[1]
    deepspeed.init_distributed(dist_backend="gloo")
    res = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), **run(ckpt)}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
    finish()
