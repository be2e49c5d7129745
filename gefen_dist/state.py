"""The segment state manager: one parameter's Gefen state, laid out over its segments.

Per parameter (the buffer the optimizer is handed) the state is a handful of flat tensors, each
the concatenation of its segments' pieces in segment order:

- ``layout``  int64 (segments, 4): buffer offset, numel, start in the original tensor, block size
  (B > 1 contiguous blocks, 1 none, -P columns of a row of P elements)
- ``codebook`` fp32 (2**bits,): the levels of m; its length says the bit width
- ``codes``   uint8: m codes of segments with B > 1, each segment from a byte boundary, two per
  byte at 4 bits
- ``absmax``, ``v`` fp32, one per block of segments with B > 1 (blocks cut at segment ends)
- ``exp_avg``, ``exp_avg_sq`` fp32, one per element of segments with B = 1 (exact AdamW state)
- ``step``    fp32 scalar, as AdamW

None of these has the parameter's shape or size (but for a parameter that is all B = 1), and all
are plain tensors, so a state dict loads with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import torch

from .codes import code_bytes
from .reference import SegmentState
from .segments import Segment, num_blocks

STATE_KEYS = ("step", "layout", "codebook", "codes", "absmax", "v", "exp_avg", "exp_avg_sq")


def bits_of(codebook: torch.Tensor) -> int:
    return {16: 4, 256: 8}.get(codebook.numel(), 0)


def allocate(
    segments: list[Segment], block_sizes: list[int], codebook: torch.Tensor, device: torch.device
) -> dict[str, torch.Tensor]:
    bits = bits_of(codebook)
    n_codes = n_blocks = n_dense = 0
    for seg, bs in zip(segments, block_sizes, strict=True):
        if bs == 1:
            n_dense += seg.numel
        else:
            n_codes += code_bytes(seg.numel, bits)
            n_blocks += num_blocks(seg.start, seg.numel, bs)
    f32 = dict(dtype=torch.float32, device=device)
    layout = torch.tensor(
        [[s.offset, s.numel, s.start, bs] for s, bs in zip(segments, block_sizes, strict=True)],
        dtype=torch.int64,
    ).view(-1, 4)
    return {
        "step": torch.tensor(0.0, dtype=torch.float32),
        "layout": layout,
        "codebook": codebook.to(**f32).clone(),
        "codes": torch.zeros(n_codes, dtype=torch.uint8, device=device),
        "absmax": torch.zeros(n_blocks, **f32),
        "v": torch.zeros(n_blocks, **f32),
        "exp_avg": torch.zeros(n_dense, **f32),
        "exp_avg_sq": torch.zeros(n_dense, **f32),
    }


def segment_views(state: dict[str, torch.Tensor]) -> list[tuple[int, SegmentState]]:
    """(buffer offset, views) for each segment, in layout order."""
    bits = bits_of(state["codebook"])
    out = []
    c = b = d = 0
    for offset, numel, start, bs in state["layout"].tolist():
        if bs == 1:
            st = SegmentState(
                start,
                numel,
                1,
                exp_avg=state["exp_avg"][d : d + numel],
                exp_avg_sq=state["exp_avg_sq"][d : d + numel],
            )
            d += numel
        else:
            nc, nb = code_bytes(numel, bits), num_blocks(start, numel, bs)
            st = SegmentState(
                start,
                numel,
                bs,
                codes=state["codes"][c : c + nc],
                absmax=state["absmax"][b : b + nb],
                v=state["v"][b : b + nb],
            )
            c, b = c + nc, b + nb
        out.append((offset, st))
    return out


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of optimizer state proper: what grows with the model (not layout or codebook)."""
    keys = ("codes", "absmax", "v", "exp_avg", "exp_avg_sq")
    return sum(state[k].numel() * state[k].element_size() for k in keys if k in state)


def check_loaded(state: dict, segments: list[Segment], bits: int, name: str) -> None:
    """Raise ValueError naming the parameter when a saved state does not fit it."""
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"Gefen state for {name} lacks {missing}: not a Gefen state dict?")
    layout = state["layout"]
    if layout.dtype != torch.int64 or layout.dim() != 2 or layout.shape[1] != 4:
        raise ValueError(f"Gefen state for {name}: layout must be int64 (segments, 4)")
    saved = [tuple(r[:3]) for r in layout.tolist()]
    here = [(s.offset, s.numel, s.start) for s in segments]
    if saved != here:
        raise ValueError(
            f"Gefen state for {name} was saved for segments (offset, numel, start) {saved}, "
            f"but the parameter here has {here}: a different model or sharding"
        )
    saved_bits = bits_of(state["codebook"])
    if saved_bits != bits:
        raise ValueError(
            f"Gefen state for {name} holds a {state['codebook'].numel()}-level codebook "
            f"but its param group asks for bits={bits}"
        )
    blocks = [int(r[3]) for r in layout.tolist()]
    for seg, bs in zip(segments, blocks, strict=True):
        row = seg.tensor_numel // seg.shape[0] if len(seg.shape) > 1 and seg.shape[0] else 0
        if bs == 0 or (bs < 0 and -bs != row):
            raise ValueError(
                f"Gefen state for {name}: block size {bs} for a tensor of shape {seg.shape} "
                f"(must be >= 1, or -{row} for its columns)"
            )
    ref = allocate(segments, blocks, state["codebook"], torch.device("meta"))
    for k in ("codes", "absmax", "v", "exp_avg", "exp_avg_sq"):
        t = state[k]
        if t.dtype != ref[k].dtype or t.shape != ref[k].shape:
            raise ValueError(
                f"Gefen state for {name}: {k!r} is {t.dtype} {tuple(t.shape)}, "
                f"expected {ref[k].dtype} {tuple(ref[k].shape)}"
            )
