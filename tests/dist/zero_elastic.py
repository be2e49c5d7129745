"""Resume a DeepSpeed ZeRO checkpoint at another data-parallel degree or ZeRO stage.

Run by tests/test_zero_elastic.py under torchrun (``deepspeed.initialize`` reads torchrun's
environment; the launcher is not what these runs test). One launch runs a list of jobs in turn,
``JOBS`` a JSON file of ``[MODE, OUT, ARGS...]`` lists, each job's engines built afresh and freed
before the next: every launch pays several seconds of start-up, the jobs a fraction of that.
The modes:

- ``save OUT STAGE``: the tiny GPT under ZeRO stage STAGE on this world, data parallel over the
  same global batches at every world size (4 sequences a step, 4 / world per rank), a checkpoint
  (``engine.save_checkpoint(OUT/ckpt)``) after SAVE_AT steps, on to STEPS: the uninterrupted run.
- ``resume OUT CKPT STAGE``: the same engine built afresh at this world and stage, then just
  ``engine.load_checkpoint(CKPT)``, and steps SAVE_AT .. STEPS.
- ``from_one OUT PT``: a single-process checkpoint (``{"model": model.state_dict(), "optim":
  opt.state_dict()}`` after SAVE_AT steps) into a ZeRO-1, a ZeRO-2 and a ZeRO-3 engine in turn
  (the weights into the model before ``deepspeed.initialize``, the state through
  ``load_optimizer_state``), each stepping SAVE_AT .. STEPS; and the same state into an engine
  of another model, which must be refused.
- ``refuse OUT CKPT STAGE``: loads that must be refused by name (another model, a rank's file
  deleted, a file cut short, an entry cut short), each into a fresh engine whose weights must
  be untouched by the refused load.

Each rank writes each job's OUT/rank{r}.json.
"""

import gc
import json
import shutil
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

import gefen_dist.integrations.deepspeed as gd
from gefen_dist import Gefen
from gefen_dist.demo.model import GPT, GPTConfig
from teardown import finish

torch.set_num_threads(1)

TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=64)
WIDE = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=96)
STEPS, SAVE_AT, GLOBAL_BATCH, LR, BITS = 30, 10, 4, 3e-3, 4


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the step's global batch: the same data at every world size."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 256, (GLOBAL_BATCH, 16), generator=g)
    y = torch.roll(x, -1, dims=1)
    n = GLOBAL_BATCH // dist.get_world_size()
    r = dist.get_rank()
    return x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]


def param_groups(model):
    named = list(model.named_parameters())
    return [
        dict(params=[p for n, p in named if p.dim() < 2], weight_decay=0.0),
        dict(params=[p for n, p in named if p.dim() >= 2], weight_decay=0.1),
    ]


def engine(stage: int, cfg: GPTConfig = TINY, weights: dict | None = None):
    torch.manual_seed(0)
    model = GPT(cfg)
    if weights is not None:
        model.load_state_dict(weights)
    opt = Gefen(param_groups(model), lr=LR, bits=BITS)
    zero = {"stage": stage}
    if stage == 3:  # partition every tensor (by default ZeRO-3 keeps small ones whole)
        zero.update(stage3_param_persistence_threshold=0, sub_group_size=8000)
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "steps_per_print": 10**6,
    }
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return eng


def train(eng, start: int, stop: int) -> list[float]:
    losses = []
    for s in range(start, stop):
        loss = eng(*batch(s))[1]
        eng.backward(loss)
        eng.step()
        loss = loss.detach().float()
        dist.all_reduce(loss)
        losses.append(float(loss / dist.get_world_size()))
    return losses


def weights(eng) -> dict[str, torch.Tensor]:
    named = list(eng.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {n: p.detach().clone() for n, p in named}


def save(out: Path, stage: int) -> dict:
    eng = engine(stage)
    losses = train(eng, 0, SAVE_AT)
    eng.save_checkpoint(str(out / "ckpt"))
    losses += train(eng, SAVE_AT, STEPS)
    return dict(losses=losses, wrapper=gd.memory_report(eng)["wrapper"])


def resume(ckpt: str, stage: int) -> dict:
    eng = engine(stage)
    path, client = eng.load_checkpoint(ckpt)
    res = dict(global_steps=eng.global_steps, loaded=path is not None, client=sorted(client))
    res["blocks"] = gd.block_sizes(eng)
    res["losses"] = train(eng, SAVE_AT, STEPS)
    res["wrapper"] = gd.memory_report(eng)["wrapper"]
    return res


def from_one(pt: str) -> dict:
    tree = torch.load(pt, weights_only=True)
    res = {}
    for stage in (1, 2, 3):
        eng = engine(stage, weights=tree["model"])
        gd.load_optimizer_state(eng, tree["optim"])
        blocks = gd.block_sizes(eng)
        losses = train(eng, SAVE_AT, STEPS)
        res[f"z{stage}"] = dict(
            losses=losses, blocks=blocks, wrapper=gd.memory_report(eng)["wrapper"]
        )
        del eng
        gc.collect()
    res["another_model"] = refused(lambda e: gd.load_optimizer_state(e, tree["optim"]), 2, WIDE)
    return res


def refused(load, stage: int, cfg: GPTConfig = TINY) -> dict:
    """The message of a load that must fail, and whether the weights stayed as built."""
    eng = engine(stage, cfg)
    before = weights(eng)
    try:
        load(eng)
        msg = None
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
    after = weights(eng)
    same = all(torch.equal(before[n], after[n]) for n in before)
    return dict(error=msg, untouched=same)


def damaged(ckpt: Path, work: Path, how: str) -> Path:
    """A copy of the checkpoint with rank 1's zero file deleted, cut short, or one Gefen entry
    (its packed codes) cut short."""
    if dist.get_rank() == 0:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(ckpt, work)
        tag = (work / "latest").read_text().strip()
        (f,) = (work / tag).glob("zero_pp_rank_1_*optim_states.pt")
        if how == "deleted":
            f.unlink()
        elif how == "cut":
            data = f.read_bytes()
            f.write_bytes(data[: len(data) // 2])
        else:
            sd = torch.load(f, weights_only=False)
            gefen_sd = sd["optimizer_state_dict"]["base_optimizer_state"]
            st = gefen_sd["state"][1]
            st["codes"] = st["codes"][: st["codes"].numel() // 2].clone()
            torch.save(sd, f)
    dist.barrier()
    return work


def refuse(out: Path, ckpt: str, stage: int) -> dict:
    res = {"another_model": refused(lambda e: e.load_checkpoint(ckpt), stage, WIDE)}
    for how in ("deleted", "cut", "entry"):
        work = damaged(Path(ckpt), out / f"ckpt-{how}", how)
        res[how] = refused(lambda e, w=work: e.load_checkpoint(str(w)), stage)
    return res


def job(mode: str, out: Path, args: list[str]) -> dict:
    res = {"rank": dist.get_rank(), "world": dist.get_world_size()}
    if mode == "save":
        res.update(save(out, int(args[0])))
    elif mode == "resume":
        res.update(resume(args[0], int(args[1])))
    elif mode == "from_one":
        res.update(from_one(args[0]))
    elif mode == "refuse":
        res.update(refuse(out, args[0], int(args[1])))
    else:
        raise ValueError(f"job mode: one of save, resume, from_one, refuse, got {mode!r}")
    return res


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    jobs = json.loads(Path(args[0]).read_text())
    deepspeed.init_distributed(dist_backend="gloo")
    for mode, out, *rest in jobs:
        out = Path(out)
        res = job(mode, out, rest)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(res))
        gc.collect()  # the job's engines, before the next job builds its own
        dist.barrier()  # a later job may read what this one saved


if __name__ == "__main__":
    main()
    finish()
