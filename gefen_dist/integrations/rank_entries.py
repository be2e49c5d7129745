"""The per-rank format: each rank's Gefen state of a sharded parameter as one ``bytes`` entry.

FSDP1's checkpoints keep it (its flat and ``use_orig_params`` pieces), and so do DTensor
checkpoints written before format 2 (``docs/history.md``); ``integrations.fsdp`` writes and reads
the entries through its state-dict hooks, ``gefen_dist.checkpoint`` consolidates them. An entry
is a ``torch.save`` of the rank's tensors, its segments and who wrote it (rank, world size, run
id, step), so that a loader can check it came from the checkpoint at hand and cut its own pieces
from every saving rank's (``method.portable``).
"""

from __future__ import annotations

import io
from typing import Any

import torch

from ..method import portable
from ..method.segments import Segment, by_matrix, decode, encode
from ..method.state import STATE_KEYS

__all__ = [
    "FORMAT",
    "RANK_KEY",
    "RUN_KEY",
    "decode_own",
    "encode_entry",
    "merge_entries",
    "read_entry",
    "recut",
    "saved_by",
]

RANK_KEY = "gefen.rank{}"
RUN_KEY = "gefen.run"
FORMAT = "gefen-rank-state/1"


def read_entry(blob: Any, key: str, name: str) -> dict:
    """One rank's entry as its payload, refusing what no Gefen wrote, by name (also what
    ``gefen_dist.checkpoint`` reads a checkpoint's entries with)."""
    if not isinstance(blob, bytes):
        raise ValueError(f"Gefen state for {name}: expected bytes, got {type(blob).__name__}")
    try:
        payload = torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as e:  # a truncated or damaged entry: name it, not torch's reader
        raise ValueError(
            f"Gefen state for {name}: entry {key!r} is not a readable state "
            f"({type(e).__name__}: {e})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"Gefen state for {name} is not a {FORMAT} entry")
    return payload


def merge_entries(
    payloads: list[dict], codebook: torch.Tensor | None, name: str, whole: bool = True
) -> dict[str, portable.TensorState]:
    """Every tensor whose pieces the payloads hold, put together (``portable.merge``); each
    must be whole unless ``whole`` is False (one rank's own pieces, re-cut in place). Empty
    where no rank had stepped the parameter. Entries of ranks holding copies of other ranks'
    pieces (a tensor Replicate on tp, ``sharding.is_copy``) are left out: their pieces are
    there once already."""
    parts = []
    for pl in payloads:
        if pl["step"] is None or pl.get("copy"):
            continue
        st = {**pl["tensors"], "step": torch.tensor(pl["step"])}
        if "codebook" not in st:  # a DTensor parameter's codebook, kept beside the entries
            if codebook is None:
                raise ValueError(f"Gefen state for {name}: the entry's codebook is missing")
            st["codebook"] = codebook
        segs = decode(pl["segments"])
        parts += portable.export(st, segs)
    tensors = portable.merge(parts)
    for ts in tensors.values() if whole else ():
        gaps = ts.missing()
        if gaps:
            raise ValueError(f"Gefen state for {name}: no rank holds elements {gaps} of {ts.name}")
    return tensors


def saved_by(blob: Any, key: str, name: str) -> tuple[int, int]:
    payload = read_entry(blob, key, name)
    return payload["rank"], payload["world_size"]


def recut(
    entry: dict[str, Any], ranks: list[str], segs: list[Segment], rank: int, world: int, name: str
) -> dict[str, torch.Tensor] | None:
    """This rank's state for its segments, cut from every saving rank's piece: a checkpoint
    of another world size (``method.portable``: what is exact, what is merged or split). Every
    rank of the saving world must be there: FSDP1's full state dicts carry them all (this
    hook gathers a flat parameter's), a sharded one a single rank's."""
    payloads = [read_entry(entry[k], k, name) for k in ranks]
    saved_world = {pl["world_size"] for pl in payloads}
    runs = {pl["run"] for pl in payloads} | {entry.get(RUN_KEY)}
    if len(saved_world) != 1 or len(runs) != 1:
        raise ValueError(
            f"Gefen state for {name}: its entries come from different runs or world sizes "
            f"({sorted(saved_world)}): checkpoints of two runs mixed?"
        )
    (n,) = saved_world
    have = sorted(pl["rank"] for pl in payloads)
    if have != list(range(n)):
        missing = sorted(set(range(n)) - set(have))
        raise ValueError(
            f"Gefen state for {name} was saved by {n} ranks, and the checkpoint lacks the "
            f"entries of rank(s) {missing} (it holds {', '.join(ranks)}), which rank {rank} of "
            f"{world} needs to cut its piece: load a full state dict (FSDP1 FULL_STATE_DICT, "
            "which carries every rank's entry), or every rank's sharded files "
            "(gefen_dist.integrations.fsdp)"
        )
    steps = {pl["step"] for pl in payloads if pl["step"] is not None}
    step = entry.get("step")
    if len(steps) > 1 or (steps and step is not None and steps != {float(step)}):
        raise ValueError(
            f"Gefen state for {name}: the entries' step {sorted(steps)} is not the "
            f"checkpoint's ({None if step is None else float(step)})"
        )
    tensors = merge_entries(payloads, entry.get("codebook"), name)
    named = [s for s in segs if s.name and s.numel]
    if not tensors or not named:
        return None
    for s in named:
        have_ts = tensors.get(s.name)
        if have_ts is None or tuple(have_ts.shape) != tuple(s.shape):
            saved = {n: tuple(t.shape) for n, t in tensors.items()}
            raise ValueError(
                f"Gefen state for {name}: this rank holds a piece of {s.name} {tuple(s.shape)}, "
                f"the checkpoint's entries the tensors {saved}: a different model or FSDP "
                "wrapping"
            )
    return portable.install(tensors, segs, torch.device("cpu"))


def encode_entry(
    st: dict[str, torch.Tensor] | None,
    segs: list[Segment],
    rank: int,
    world: int,
    run: str,
    outside: tuple[str, ...],
    copy: bool = False,
) -> bytes:
    payload = {
        "format": FORMAT,
        # a copy of another rank's pieces (sharding.is_copy): loaded by its own rank at the same
        # layout, left out where pieces are put together
        "copy": copy,
        "rank": rank,
        "world_size": world,
        "run": run,
        "step": None if st is None else float(st["step"]),
        "segments": encode(segs),
        "tensors": {
            k: st[k].detach().cpu()
            for k in STATE_KEYS
            if st is not None and k != "step" and k not in outside
        },
    }
    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


def decode_own(
    entry: dict[str, Any], key: str, segs: list[Segment], rank: int, world: int, name: str
) -> dict[str, torch.Tensor] | None:
    """This rank's Gefen state from its entry, or None where it saved none."""
    payload, step = read_entry(entry[key], key, name), entry.get("step")
    if payload["world_size"] != world or payload["rank"] != rank:
        raise ValueError(
            f"Gefen state for {name} was saved by rank {payload['rank']} of "
            f"{payload['world_size']}, and is being loaded by rank {rank} of {world}: Gefen's "
            "per-rank state (packed codes, and one scale and v per block piece, cut at the "
            "saved shard boundaries) is not resharded; resume with the same world size and "
            "FSDP wrapping"
        )
    saved_step = payload["step"]
    # no step at all: a template built before any step (Accelerate's FSDP1 sharded load asks
    # DCP for the keys of a fresh optimizer's dict), for which the run id alone speaks
    if payload["run"] != entry.get(RUN_KEY) or (
        saved_step is not None and step is not None and saved_step != float(step)
    ):
        raise ValueError(
            f"Gefen state for {name}: rank {rank}'s entry is not the one saved with this "
            f"checkpoint (run {payload['run']} step {saved_step}, the checkpoint's: run "
            f"{entry.get(RUN_KEY)} step {None if step is None else float(step)}); the "
            "loader kept this rank's own value (gefen_dist.integrations.fsdp)"
        )
    saved = decode(payload["segments"])
    if saved != list(segs) and by_matrix(saved) == list(segs) and saved_step is not None:
        # saved before batches of matrices were cut at each matrix (docs/history.md): the
        # same elements, re-cut from this rank's own piece
        tensors = merge_entries([payload], entry.get("codebook"), name, whole=False)
        return portable.install(tensors, segs, torch.device("cpu"))
    if saved != list(segs):
        rows = [tuple(r) for r in encode(saved)]
        here = [tuple(r) for r in encode(segs)]
        raise ValueError(
            f"Gefen state for {name} was saved for the layout (offset, numel, start, shape, "
            f"tensor) {rows}, but this rank holds {here}: a different model or FSDP wrapping"
        )
    if saved_step is None:
        return None
    outside = {k: entry[k] for k in STATE_KEYS if k in entry and k != "step"}
    return {
        "step": torch.tensor(saved_step, dtype=torch.float32, device="cpu"),
        **payload["tensors"],
        **outside,
    }
