"""Damaged FSDP2 checkpoints (DCP) loaded on 2 ranks: each is refused, or loads and steps finite.

argv: OUT CKDIR BITS. Trains the tiny GPT under FSDP2 for 2 steps, saves it with
``get_state_dict`` and ``dcp.save``, then for each damage rank 0 writes a damaged copy and every
rank builds a fresh model and optimizer and loads it as a user resumes (``dcp.load``, then
``set_state_dict``). Damage to the files themselves (a truncated ``.distcp`` or ``.metadata``)
is for DCP's reader, which raises before any state reaches Gefen; damage to the values (a NaN
in a rank's packed Gefen state, a negative v, a bad step or codebook) goes through DCP's own
format (``format_utils``: the checkpoint as one torch.save file and back), so the files stay
readable and the damage reaches Gefen's load hooks. Each rank writes, per damage, where the load
stopped and why, and, where every rank loaded, whether 2 more steps left the parameters finite;
and what ``gefen_dist.check_gradients`` says on each rank when one rank's gradient holds NaN.
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_common import batch, full_params, gefen, init, rows, train, wrap, write
from teardown import finish
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import gefen_dist

PARAM = "transformer.h.0.mlp.c_proj.weight"  # blocks of 256, factored: v_cross on both ranks
DENSE = "transformer.ln_f.weight"  # B = 1: exp_avg, exp_avg_sq


def _tensors(entry: dict, rank: int, fn) -> None:
    """Apply ``fn`` to what ``rank`` saved of one parameter's Gefen state (global fields,
    ``gefen_dist.integrations.dcp``): its range's v and absmax, its rows of the per-element
    fields, and the shared v_cross, as one dict of the live names."""
    key = _range_key(entry, rank)
    view, rows = {}, None
    if key:
        view.update(v=entry[f"v.{key}"], absmax=entry[f"absmax.{key}"])
    for name in ("codes", "exp_avg", "exp_avg_sq"):
        if name in entry:
            rows = torch.chunk(torch.arange(entry[name].shape[0]), 2)[rank]
            view[name] = entry[name][rows].clone().reshape(-1)
    if "v_cross" in entry:
        view["v_cross"] = entry["v_cross"]
    fn(view)
    if key:
        entry[f"v.{key}"], entry[f"absmax.{key}"] = view["v"], view["absmax"]
    for name in ("codes", "exp_avg", "exp_avg_sq"):
        if name in view:
            entry[name] = entry[name].clone()
            entry[name][rows] = view[name].reshape(entry[name][rows].shape)
    if "v_cross" in view:
        entry["v_cross"] = view["v_cross"]


def _range_key(entry: dict, rank: int) -> str | None:
    """The element range ``{start}.{numel}`` that ``rank`` saved its block values under (None
    where the parameter keeps none: B = 1)."""
    ranges = sorted((k[len("pieces.") :] for k in entry if k.startswith("pieces.")),
                    key=lambda r: int(r.split(".")[0]))  # fmt: skip
    return ranges[rank] if ranges else None


def _set(t: torch.Tensor, i: int, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[i] = value
    return t


def _values(fn):
    """A damage to the checkpoint's values, through DCP's own format."""

    def damage(src: Path, dst: Path) -> None:
        flat = dst.parent / f"{dst.name}.pt"
        dcp_to_torch_save(str(src), str(flat))
        sd = torch.load(flat, weights_only=False)
        fn(sd["optim"]["state"])
        torch.save(sd, flat)
        torch_save_to_dcp(str(flat), str(dst))

    return damage


def _file(name: str, keep):
    """A damage to one file of the checkpoint: ``keep(size)`` bytes of it are left."""

    def damage(src: Path, dst: Path) -> None:
        shutil.copytree(src, dst)
        path = dst / name
        data = path.read_bytes()
        path.write_bytes(data[: keep(len(data))])

    return damage


def _v_nan(t):
    t["v"] = _set(t["v"], 3, math.nan)


def _v_negative(t):
    t["v"] = _set(t["v"], 0, -1.0)


def _v_cross_inf(t):
    t["v_cross"] = _set(t["v_cross"], 5, math.inf)


def _exp_avg_huge(t):
    t["exp_avg"] = t["exp_avg"] * 1e30


def _codes_random(t):
    t["codes"] = torch.randint(0, 256, t["codes"].shape, dtype=torch.uint8)


def _flips(t):
    g = torch.Generator().manual_seed(7)
    for k in ("v", "absmax", "v_cross", "codes"):
        raw = t[k].clone().view(torch.uint8)
        at = torch.randint(0, raw.numel(), (3,), generator=g)
        raw[at] ^= torch.tensor([1, 16, 64], dtype=torch.uint8)
        t[k] = raw.view(t[k].dtype)


def _entry(fqn: str, fn):
    return _values(lambda state: fn(state[fqn]))


def _every_codebook(state):
    for e in state.values():
        if "codebook" in e:
            e["codebook"] = _set(e["codebook"], 2, math.nan)


def _truncated_grid(e):
    key = _range_key(e, 1)
    e[f"v.{key}"] = e[f"v.{key}"][: e[f"v.{key}"].numel() // 2].clone()


def _dropped(e):
    key = _range_key(e, 1)
    for field in ("pieces", "v", "absmax"):
        del e[f"{field}.{key}"]


# name: (damage, what must happen): "dcp": DCP's reader refuses it on every rank, before Gefen
# sees any of it; (parameter, key): refused naming them on some rank (None: any parameter, or no
# key); "load": every rank loads it and steps finite; "either": one or the other
DAMAGES = {
    "rank 1's .distcp truncated to half": (_file("__1_0.distcp", lambda n: n // 2), "dcp"),
    "rank 0's .distcp short by 100 bytes": (_file("__0_0.distcp", lambda n: n - 100), "dcp"),
    ".metadata truncated": (_file(".metadata", lambda n: n // 3), "dcp"),
    "NaN in rank 0's v": (_entry(PARAM, lambda e: _tensors(e, 0, _v_nan)), (PARAM, "v")),
    "negative v on rank 1": (_entry(PARAM, lambda e: _tensors(e, 1, _v_negative)), (PARAM, "v")),
    "inf in rank 0's v_cross": (
        _entry(PARAM, lambda e: _tensors(e, 0, _v_cross_inf)),
        (PARAM, "v_cross"),
    ),
    "exp_avg x 1e30 on rank 1": (
        _entry(DENSE, lambda e: _tensors(e, 1, _exp_avg_huge)),
        (DENSE, "exp_avg"),
    ),
    "NaN in every codebook": (_values(_every_codebook), (None, "codebook")),
    "bit flips in rank 1's v, absmax, v_cross, codes": (
        _entry(PARAM, lambda e: _tensors(e, 1, _flips)),
        "either",
    ),
    "step NaN": (_entry(PARAM, lambda e: e.update(step=torch.tensor(math.nan))), (PARAM, None)),
    "rank 1's block values dropped": (_entry(PARAM, _dropped), (PARAM, None)),
    "rank 1's v truncated": (_entry(PARAM, _truncated_grid), (PARAM, None)),
    "random codes on rank 0": (_entry(PARAM, lambda e: _tensors(e, 0, _codes_random)), "load"),
    "undamaged": (_values(lambda state: None), "load"),
}


def attempt(d: Path, bits: int) -> dict:
    """Load ``d`` into a fresh run on every rank: where it stopped, and why. Every rank takes
    the same collectives whatever happened on it (a refusal may come on one rank only: its
    packed state is its own), so the outcomes are gathered before anyone steps."""
    model = wrap("gpt", "fsdp2")
    opt = gefen(list(model.named_parameters()), bits)
    msd, osd = get_state_dict(model, opt)
    out = _load(model, opt, msd, osd, d)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, out["stage"])
    if all(s == "loaded" for s in every):
        try:
            train("gpt", model, opt, 2, 2)
            params = full_params(model, "fsdp2").values()
            out["finite"] = all(bool(torch.isfinite(p).all()) for p in params)
        except Exception as e:  # noqa: BLE001 - recorded, the test judges it
            out.update(stage="crash in step", error=type(e).__name__, message=str(e)[-600:])
    return out


def _load(model, opt, msd, osd, d: Path) -> dict:
    try:
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(d))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - the test judges it
        return dict(stage="dcp.load", error=type(e).__name__, message=str(e)[-600:])
    before = {p: dict(st) for p, st in opt.state.items()}
    try:
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    except (ValueError, TypeError) as e:
        kept = before.keys() == opt.state.keys() and all(
            opt.state[p].get(k) is v for p, st in before.items() for k, v in st.items()
        )
        return dict(stage="refused", error=type(e).__name__, message=str(e), kept=kept)
    except Exception as e:  # noqa: BLE001
        return dict(stage="crash", error=type(e).__name__, message=str(e)[-600:])
    return dict(stage="loaded")


def gradient_check(bits: int) -> dict:
    """``gefen_dist.check_gradients`` with a NaN in rank 1's shard only: every rank refuses."""
    model = wrap("gpt", "fsdp2")
    opt = gefen(list(model.named_parameters()), bits)
    train("gpt", model, opt, 0, 1)
    opt.zero_grad()
    x, y = batch("gpt", 1)
    model(rows(x), rows(y))[1].backward()
    if dist.get_rank() == 1:
        dict(model.named_parameters())[PARAM].grad._local_tensor.view(-1)[5] = math.nan
    try:
        gefen_dist.check_gradients(opt)
    except ValueError as e:
        return dict(refused=str(e))
    return dict(refused=None)


def main() -> None:
    out, ckdir, bits = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    init()
    rank = dist.get_rank()
    model = wrap("gpt", "fsdp2")
    opt = gefen(list(model.named_parameters()), bits)  # names, for the refusals to give
    train("gpt", model, opt, 0, 2)
    msd, osd = get_state_dict(model, opt)
    base = ckdir / "base"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(base))
    del model, opt, msd, osd
    result = {}
    for i, (name, (damage, expect)) in enumerate(DAMAGES.items()):
        d = ckdir / f"damaged{i}"
        if rank == 0:
            torch.manual_seed(i)
            damage(base, d)
        dist.barrier()
        result[name] = dict(attempt(d, bits), expect=expect)
        dist.barrier()
    result["check_gradients"] = gradient_check(bits)
    write(out, result)


if __name__ == "__main__":
    main()
    finish()
