"""What a run reports: every rank's optimizer-state bytes, parameters held, peak RSS and median
step time, gathered to rank 0, which writes the results JSON (``--out``) and prints the summary;
with ``--digest``, every rank's sha256 over its pieces of the parameters and over the
optimizer's own parameters (DeepSpeed's fp32 partitions), state tensors and settings, so that two
runs can be checked for the same bits and not only the same losses (``launch/chaos.py`` does).

The JSON's keys and their order are the format that ``launch/main_job.py``, ``launch/chaos.py``,
``launch/gpu_check.py`` and the tests read; they are built in one place, ``results``.
"""

from __future__ import annotations

import hashlib
import json
import resource
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from gefen_dist.distributed.collectives import comm_device

from .launchers import Wrapped
from .optimizer import local, state_bytes, stepped


@dataclass
class RankStats:
    """One rank's figures, sent to rank 0 as one float64 tensor (an all_gather of tensors is
    cheaper and simpler than of objects, and exact for these integers)."""

    state_bytes: int
    state_params: int
    peak_rss_bytes: int
    step_time_median_s: float

    @classmethod
    def mine(cls, run: Wrapped, step_times_s: list[float]) -> RankStats:
        held = state_bytes(run.opt)
        return cls(
            state_bytes=held.bytes,
            state_params=held.params,
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            # none: resumed at the last step
            step_time_median_s=statistics.median(step_times_s) if step_times_s else 0.0,
        )

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        values = [self.state_bytes, self.state_params, self.peak_rss_bytes,
                  self.step_time_median_s]  # fmt: skip
        return torch.tensor(values, dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> RankStats:
        held, params, rss, median = t.tolist()
        return cls(int(held), int(params), int(rss), float(median))

    def record(self, rank: int) -> dict:
        """The rank's entry in the results JSON's ``ranks``."""
        return dict(
            rank=rank,
            state_bytes=self.state_bytes,
            state_params=self.state_params,
            adamw_bytes=8 * self.state_params,
            peak_rss_bytes=self.peak_rss_bytes,
            step_time_median_s=self.step_time_median_s,
        )


def gather_stats(mine: RankStats) -> list[RankStats]:
    """Every rank's figures, by rank, on every rank."""
    t = mine.to_tensor(comm_device())
    gathered = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return [RankStats.from_tensor(g) for g in gathered]


def _hash_tensor(h: hashlib._Hash, name: str, t: torch.Tensor) -> None:
    t = local(t).detach().cpu().contiguous().reshape(-1)
    h.update(f"{name}:{t.dtype}:{t.numel()};".encode())
    h.update(t.view(torch.uint8).numpy().tobytes())


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """This rank's sha256 over its pieces of the model's parameters (by name), and over the
    optimizer's parameters (the fp32 partitions under DeepSpeed), state tensors and plain
    settings, in group order: equal digests mean the same bits, not only the same losses."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        # FSDP2 leaves the root's parameters gathered after a forward without backward (the last
        # evaluation) in one run and sharded in another: hash the shards in every run
        model.reshard()
    params = hashlib.sha256()
    named = sorted(model.named_parameters(), key=lambda kv: kv[0])
    for name, p in named:
        _hash_tensor(params, name, p)
    optim = hashlib.sha256()
    inner, n = stepped(opt), 0
    for gi, g in enumerate(inner.param_groups):
        plain = {
            k: v
            for k, v in g.items()
            if k != "params" and isinstance(v, int | float | str | bool | list | tuple | None)
        }
        optim.update(json.dumps(plain, sort_keys=True, default=str).encode())
        for pi, p in enumerate(g["params"]):
            _hash_tensor(optim, f"g{gi}.p{pi}", p)
            for key in sorted(inner.state.get(p, {})):
                value = inner.state[p][key]
                if torch.is_tensor(value):
                    _hash_tensor(optim, f"g{gi}.p{pi}.{key}", value)
                    n += 1
                else:
                    optim.update(f"g{gi}.p{pi}.{key}={value!r};".encode())
    return dict(params=params.hexdigest(), optimizer=optim.hexdigest(), state_tensors=n,
                param_tensors=len(named))  # fmt: skip


def gather_digests(run: Wrapped) -> list[dict]:
    """Every rank's ``digest``, by rank, with its rank."""
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, dict(rank=dist.get_rank(), **digest(run.model, run.opt)))
    return digests


@dataclass
class Outcome:
    """What rank 0 reports of a finished run, beside the config and the figures of each rank."""

    ran: dict
    world_size: int
    resumed_from_step: int
    n_params: int
    curve: list[dict]
    final_lr: float
    wall_time_s: float


def results(
    cfg: dict, outcome: Outcome, ranks: list[RankStats], digests: list[dict] | None
) -> dict:
    """The results JSON."""
    result = dict(
        config=cfg,
        ran=outcome.ran,
        world_size=outcome.world_size,
        resumed_from_step=outcome.resumed_from_step,
        n_params=outcome.n_params,
        curve=outcome.curve,
        final_train_loss=outcome.curve[-1]["train_loss"],
        final_val_loss=outcome.curve[-1]["val_loss"],
        final_lr=outcome.final_lr,
        wall_time_s=outcome.wall_time_s,
        ranks=[r.record(rank) for rank, r in enumerate(ranks)],
        torch_version=torch.__version__,
    )
    if digests is not None:
        result["digest"] = digests
    return result


def write(result: dict, out: str | Path | None) -> None:
    if out:
        Path(out).write_text(json.dumps(result, indent=1))


def ran_label(ran: dict) -> str:
    """``DEEPSPEED ZeRO-2 on cpu (gloo)``: what ran, as the summary line says it."""
    what = ran["distributed_type"]
    if "zero_stage" in ran:
        what += f" ZeRO-{ran['zero_stage']}"
    if "fsdp_version" in ran:
        what += f"{ran['fsdp_version']}"
    return f"{what} on {ran['device']} ({ran['backend']})"


def print_summary(result: dict) -> None:
    cfg, ran, first = result["config"], result["ran"], result["resumed_from_step"]
    name, mode = cfg["optimizer"]["name"], cfg["sharding"]["mode"]
    print(
        f"{name} under {mode}, ran {ran_label(ran)}, {result['world_size']} ranks"
        + (f", resumed at step {first}" if first else "")
        + f": final val loss {result['final_val_loss']:.4f}"
    )
    for r in result["ranks"]:
        ratio = r["state_bytes"] / r["adamw_bytes"] if r["adamw_bytes"] else 0.0
        print(
            f"  rank {r['rank']}: optimizer state {r['state_bytes']:>10} B "
            f"(AdamW would keep {r['adamw_bytes']:>10} B: {ratio:.3f}x)"
        )
