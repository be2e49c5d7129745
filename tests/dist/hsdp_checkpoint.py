"""Checkpoints of Gefen under HSDP on 4 ranks (2 x 2), through the frameworks' own functions.

argv: MODE OUT CKDIR BITS. Cases (model, setup, path; setups in hsdp_common): FSDP2 HSDP with
DCP (get_state_dict / set_state_dict with dcp.save / dcp.load), FSDP1 HYBRID_SHARD with
FSDP.optim_state_dict under SHARDED_STATE_DICT (one torch.save file per rank) and with DCP.

- ``save``: train 3 steps, save, dump each rank's raw Gefen state, train 3 more and keep the
  final full parameters: the uninterrupted run.
- ``resume`` (a fresh process): build everything anew, load, compare the raw state with the
  dump, train the same 3 steps and compare the final parameters and losses with the
  uninterrupted run. Under DCP a key that both replica groups wrote is kept once, so a rank may
  load its replica's entry: that must resume exactly too. Also: the HSDP checkpoint loaded into
  1-D FSDP2 over all 4 ranks (other shard boundaries) must fail naming the problem.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_checkpoint import equal_states, load, raw_state, save
from fsdp_common import full_params, gefen, init, train, write
from hsdp_common import FSDP1, wrap
from torch.distributed.checkpoint.api import CheckpointException

import gefen_dist.integrations.fsdp
from teardown import finish

FIRST, SECOND = 3, 3
CASES = [
    ("gpt", "hsdp2", "dcp"),
    ("odd", "hsdp2", "dcp"),
    ("gpt", "hybrid", "sharded"),
    ("gpt", "hybrid_orig", "dcp"),
]


def setup_run(kind: str, setup: str, bits: int):
    model = wrap(kind, setup)
    opt = gefen(model.parameters(), bits)
    if setup in FSDP1:
        gefen_dist.integrations.fsdp.configure(model, opt)
    return model, opt


def other_layout(kind: str, d: Path, bits: int) -> str | None:
    """The HSDP checkpoint into FSDP2 over all 4 ranks, other shard boundaries: DCP reads the
    state in global coordinates (``integrations.dcp``); the error, where one is raised."""
    model, opt = setup_run(kind, "fsdp2_world", bits)
    try:
        load(model, opt, "dcp", d)
    except (ValueError, CheckpointException) as e:  # DCP's: every rank's failures, all ranks
        return str(e)
    return None


def main() -> None:
    mode, out, ckdir, bits = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    init()
    rank = dist.get_rank()
    result: dict = {}
    for kind, setup, path in CASES:
        name = f"{kind}/{setup}/{path}"
        d = ckdir / name.replace("/", "-")
        d.mkdir(parents=True, exist_ok=True)
        model, opt = setup_run(kind, setup, bits)
        full = "fsdp2" if setup not in FSDP1 else setup
        if mode == "save":
            first = train(kind, model, opt, 0, FIRST)
            save(model, opt, path, d)
            torch.save(raw_state(opt), d / f"raw{rank}.pt")
            second = train(kind, model, opt, FIRST, SECOND)
            torch.save(full_params(model, full), d / f"final{rank}.pt")
            result[name] = dict(
                losses=first + second,
                codebook=opt.codebooks[bits].tolist(),
                run=opt.attached("fsdp").run,
            )
        else:
            load(model, opt, path, d)
            state_exact = equal_states(raw_state(opt), torch.load(d / f"raw{rank}.pt"))
            second = train(kind, model, opt, FIRST, SECOND)
            final = full_params(model, full)
            saved = torch.load(d / f"final{rank}.pt")
            diff = max((final[n] - saved[n]).abs().max().item() for n in saved)
            exact = all(torch.equal(final[n], saved[n]) for n in saved)
            result[name] = dict(
                losses=second, state_exact=state_exact, params_exact=exact, param_diff=diff
            )
    if mode == "resume":
        result["other_layout"] = other_layout("gpt", ckdir / "gpt-hsdp2-dcp", bits)
    write(out, result)


if __name__ == "__main__":
    main()
    finish()
