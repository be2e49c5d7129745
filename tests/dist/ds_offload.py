"""ZeRO-Offload with Gefen from the shipped configs (configs/ds_zero{2,3}_offload_cpu.json).

Run by tests/test_offload.py under the deepspeed launcher: ``ds_offload.py OUT CKPT`` builds,
for each config, the engine from the JSON as it ships (Gefen named in its ``"optimizer"``),
trains STEPS steps with ``engine.save_checkpoint`` after SAVE_AT, then builds the engine afresh,
loads the checkpoint and trains SAVE_AT .. STEPS again; and builds one engine from a client
``Gefen`` instance under the ZeRO-2 offload config without its ``"optimizer"`` section. Each
rank writes OUT/rank{r}.json.
"""

import gc
import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

import gefen_dist
import gefen_dist.integrations.deepspeed as gd
from gefen_dist import Gefen
from gefen_dist.demo.model import GPT, GPTConfig
from teardown import finish

torch.set_num_threads(1)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=64)
STEPS, SAVE_AT = 6, 3


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's batch; every 2 steps the same again, so that the loss must fall on it."""
    g = torch.Generator().manual_seed(1000 + 10 * (step % 2) + dist.get_rank())
    x = torch.randint(0, 256, (4, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def engine(config: dict, optimizer=None):
    torch.manual_seed(0)
    model = GPT(TINY)
    eng, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), optimizer=optimizer, config=config
    )
    return eng


def train(eng, start: int, stop: int) -> list[float]:
    losses = []
    for s in range(start, stop):
        loss = eng(*batch(s))[1]
        eng.backward(loss)
        eng.step()
        losses.append(float(loss))
    return losses


def weights(eng) -> dict[str, list[float]]:
    named = list(eng.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {n: p.detach().float().reshape(-1)[:64].tolist() for n, p in named}


def state_digest(eng) -> list:
    """Every Gefen state tensor of this rank's partitions, as plain numbers."""
    opt = eng.optimizer.optimizer
    out = []
    for st in opt.state.values():
        for k in sorted(st):
            t = st[k]
            out.append([k, t.double().sum().item() if t.is_floating_point() else t.sum().item()])
    return out


def run(config: dict, ckpt: Path) -> dict:
    eng = engine(config)
    w = eng.optimizer
    flats = getattr(w, "single_partition_of_fp32_groups", None) or w.fp32_partitioned_groups_flat
    host = {str(t.device) for t in flats}
    losses = train(eng, 0, SAVE_AT)
    rep = gd.memory_report(eng)
    eng.save_checkpoint(str(ckpt))
    losses += train(eng, SAVE_AT, STEPS)
    final, state = weights(eng), state_digest(eng)
    del eng
    gc.collect()
    again = engine(config)
    path, _ = again.load_checkpoint(str(ckpt))
    resumed = train(again, SAVE_AT, STEPS)
    return dict(
        wrapper=rep["wrapper"],
        backend=gd.memory_report(again)["backend"],
        host=sorted(host),
        losses=losses,
        resumed=resumed,
        loaded=path is not None,
        weights_exact=weights(again) == final,
        state_exact=state_digest(again) == state,
        state_bytes=rep["state_bytes"],
        adamw_bytes=rep["adamw_bytes"],
    )


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out, ckpt = Path(args[0]), Path(args[1])
    gefen_dist.register("deepspeed")
    deepspeed.init_distributed(dist_backend="gloo")
    res = {"rank": dist.get_rank(), "world": dist.get_world_size()}
    for stage in (2, 3):
        config = json.loads((CONFIGS / f"ds_zero{stage}_offload_cpu.json").read_text())
        res[f"zero{stage}"] = run(config, ckpt / f"zero{stage}")
    config = json.loads((CONFIGS / "ds_zero2_offload_cpu.json").read_text())
    params = config.pop("optimizer")["params"]
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = Gefen(model.parameters(), **{k: tuple(v) if isinstance(v, list) else v
                                       for k, v in params.items()})  # fmt: skip
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    res["client"] = dict(losses=train(eng, 0, 2), wrapper=gd.memory_report(eng)["wrapper"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
    finish()
