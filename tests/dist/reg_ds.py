"""A Gefen optimizer named in a DeepSpeed JSON config, under ZeRO 0, 1, 2 and 3, on 2 ranks.

Run by tests/test_registration.py under the deepspeed launcher: ``reg_ds.py OUT`` writes
OUT/rank{r}.json. The script imports deepspeed first and then only ``gefen_dist``: no
``register()`` call, no ``optimizer=`` and no ``zero_allow_untested_optimizer``. Each stage
loads its config from ``configs/`` (the CPU variants) so the shipped files are what is run.
"""

import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

import gefen_dist
from gefen_dist.demo.model import GPT, GPTConfig
from teardown import finish

torch.set_num_threads(1)
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=64)
STAGES = {
    0: "ds_zero0_cpu.json",
    1: "ds_zero1_cpu.json",
    2: "ds_zero2_cpu.json",
    3: "ds_zero3_cpu.json",
}
CASES = {0: "Gefen", 1: "gefen", 2: "GEFEN", 3: "Gefen"}


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, 256, (4, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def run(stage):
    cfg = json.loads((CONFIGS / STAGES[stage]).read_text())
    assert "zero_allow_untested_optimizer" not in cfg
    cfg["optimizer"]["type"] = CASES[stage]
    cfg["optimizer"]["params"]["bits"] = 8 if stage == 2 else 4
    torch.manual_seed(0)
    eng, opt, _, _ = deepspeed.initialize(model=GPT(TINY), model_parameters=None, config=cfg)
    losses = []
    for s in range(3):
        loss = eng(*batch(s, dist.get_rank()))[1]
        eng.backward(loss)
        eng.step()
        losses.append(float(loss))
    basic = eng.basic_optimizer
    g = basic.param_groups[0] if basic.param_groups else basic.defaults
    out = {
        "basic": type(basic).__name__,
        "wrapper": type(eng.optimizer).__name__,
        "bits": g["bits"],
        "betas": list(g["betas"]),
        "weight_decay": g["weight_decay"],
        "losses": losses,
    }
    import gefen_dist.integrations.deepspeed as gd

    out["memory"] = error_of(lambda: gd.memory_report(eng))
    if isinstance(out["memory"], dict):
        del out["memory"]["tensors"]
    out["blocks"] = error_of(lambda: gd.block_sizes(eng))
    out["codebook_levels"] = len(basic.codebooks[out["bits"]])
    return out


def error_of(fn):
    """fn's result, or its error as text, so that one failure does not hide the other checks."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return f"{type(e).__name__}: {e}"


def refused(**params):
    """The error deepspeed.initialize gives for ds_zero1_cpu.json with these optimizer params."""
    cfg = json.loads((CONFIGS / "ds_zero1_cpu.json").read_text())
    cfg["optimizer"]["params"].update(params)
    try:
        deepspeed.initialize(model=GPT(TINY), model_parameters=None, config=cfg)
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return f"{type(e).__name__}: {e}"
    return None


def main():
    out_dir = Path([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
    deepspeed.init_distributed(dist_backend="gloo")
    res = {"rank": dist.get_rank(), "version": gefen_dist.__version__}
    for stage in STAGES:
        res[f"zero{stage}"] = run(stage)
    res["unknown_param"] = refused(momentum=0.9)
    res["auto_lr"] = refused(lr="auto")
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
    finish()
