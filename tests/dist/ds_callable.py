"""Gefen built by a callable, ``deepspeed.initialize(optimizer=lambda ps: Gefen(ps))``, with
gefen_dist imported before deepspeed and no ``register()``: the integration is then first
imported by Gefen's constructor, inside DeepSpeed's ``_configure_optimizer``, and must still bind
Gefen to its ZeRO-1 partitions. The same engine is then built again with the integration already
installed; both must give the same blocks, state and losses. ``ds_callable.py OUT`` (under
torchrun, from tests/test_registration.py) writes OUT/rank{r}.json.
"""

import json
import sys
from pathlib import Path

import gefen_dist  # noqa: I001 - before deepspeed, on purpose
import deepspeed
import torch
import torch.distributed as dist

from gefen_dist import Gefen
from gefen_dist.demo.model import GPT, GPTConfig
from teardown import finish

torch.set_num_threads(1)
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "ds_zero1_cpu.json"
TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=64)


def run() -> dict:
    cfg = json.loads(CONFIG.read_text())
    del cfg["optimizer"]
    torch.manual_seed(0)
    model = GPT(TINY)
    eng, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        optimizer=lambda ps: Gefen(ps, lr=1e-3, weight_decay=0.1),
        config=cfg,
    )
    losses = []
    for s in range(2):
        g = torch.Generator().manual_seed(100 * s + dist.get_rank())
        x = torch.randint(0, 256, (4, 16), generator=g)
        loss = eng(x, torch.roll(x, -1, dims=1))[1]
        eng.backward(loss)
        eng.step()
        losses.append(float(loss))
    import gefen_dist.integrations.deepspeed as gd

    try:
        mem = gd.memory_report(eng)
        out = {"state_bytes": mem["state_bytes"], "blocks": gd.block_sizes(eng)}
    except ValueError as e:
        out = {"error": str(e)}
    return {**out, "losses": losses}


def main() -> None:
    out_dir = Path([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
    deepspeed.init_distributed(dist_backend="gloo")
    installed_before = "gefen_dist.integrations.deepspeed" in sys.modules
    res = {"rank": dist.get_rank(), "installed_before": installed_before}
    res["first"] = run()  # the integration arrives inside this initialize
    res["again"] = run()
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
    finish()
