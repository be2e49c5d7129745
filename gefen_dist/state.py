"""The segment state manager: one parameter's Gefen state, laid out over its segments.

Per parameter (the buffer the optimizer is handed) the state is a handful of flat tensors, each
the concatenation of its segments' pieces in segment order:

- ``layout``  int64 (segments, 5): buffer offset, numel, start in the original tensor, block size
  (B > 1 contiguous blocks, 1 none, -P columns of a row of P elements), entries of v_cross
- ``codebook`` fp32 (2**bits,): the levels of m; its length says the bit width. One tensor
  shared by every state of that width on a device (``Gefen._shared_codebook``)
- ``codes``   uint8: m codes of segments with B > 1, each segment from a byte boundary, two per
  byte at 4 bits
- ``absmax``, ``v`` fp32, one per block of segments with B > 1 (blocks cut at segment ends)
- ``v_cross`` fp32, the second moment's factor across the blocks of the segment's tensor, all
  ``reference.cross_length`` entries of it (a copy per piece where the tensor is spread over
  ranks; ``reference``, the factor)
- ``exp_avg``, ``exp_avg_sq`` bf16, one per element of segments with B = 1 (AdamW's m and v,
  rounded stochastically: ``reference.dense_update``)
- ``step``    fp32 scalar, as AdamW

None of these has the parameter's shape or size (but for a parameter that is all B = 1), and all
are plain tensors, so a state dict loads with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import torch

from .codes import code_bytes
from .reference import SegmentState, cross_length
from .segments import Segment, num_blocks

STATE_KEYS = (
    "step",
    "layout",
    "codebook",
    "codes",
    "absmax",
    "v",
    "v_cross",
    "exp_avg",
    "exp_avg_sq",
)
GROWING_KEYS = ("codes", "absmax", "v", "v_cross", "exp_avg", "exp_avg_sq")
LAYOUT_COLS = 5
DENSE_DTYPE = torch.bfloat16


def _cross_entries(seg: Segment, block_size: int) -> int:
    return cross_length(block_size, seg.tensor_numel) if seg.numel else 0


def bits_of(codebook: torch.Tensor) -> int:
    return {16: 4, 256: 8}.get(codebook.numel(), 0)


def allocate(
    segments: list[Segment], block_sizes: list[int], codebook: torch.Tensor, device: torch.device
) -> dict[str, torch.Tensor]:
    bits = bits_of(codebook)
    n_codes = n_blocks = n_cross = n_dense = 0
    for seg, bs in zip(segments, block_sizes, strict=True):
        if bs == 1:
            n_dense += seg.numel
        else:
            n_codes += code_bytes(seg.numel, bits)
            n_blocks += num_blocks(seg.start, seg.numel, bs)
            n_cross += _cross_entries(seg, bs)
    f32 = dict(dtype=torch.float32, device=device)
    layout = torch.tensor(
        [
            [s.offset, s.numel, s.start, bs, _cross_entries(s, bs)]
            for s, bs in zip(segments, block_sizes, strict=True)
        ],
        dtype=torch.int64,
        device="cpu",
    ).view(-1, LAYOUT_COLS)
    return {
        "step": torch.tensor(0.0, dtype=torch.float32, device="cpu"),
        "layout": layout,
        "codebook": codebook.to(**f32),
        "codes": torch.zeros(n_codes, dtype=torch.uint8, device=device),
        "absmax": torch.zeros(n_blocks, **f32),
        "v": torch.zeros(n_blocks, **f32),
        "v_cross": torch.zeros(n_cross, **f32),
        "exp_avg": torch.zeros(n_dense, dtype=DENSE_DTYPE, device=device),
        "exp_avg_sq": torch.zeros(n_dense, dtype=DENSE_DTYPE, device=device),
    }


def segment_views(state: dict[str, torch.Tensor]) -> list[tuple[int, SegmentState]]:
    """(buffer offset, views) for each segment, in layout order."""
    bits = bits_of(state["codebook"])
    out = []
    c = b = x = d = 0
    for offset, numel, start, bs, nx in state["layout"].tolist():
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
                v_cross=state["v_cross"][x : x + nx] if nx else None,
            )
            c, b, x = c + nc, b + nb, x + nx
        out.append((offset, st))
    return out


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of optimizer state proper: what grows with the model (not layout or codebook)."""
    return sum(state[k].numel() * state[k].element_size() for k in GROWING_KEYS if k in state)


def upgrade(state: dict, segments: list[Segment]) -> dict:
    """A state saved by an earlier version, in today's format. Before ``v_cross`` existed (a
    4-column layout): given its column of v_cross entries and zeros for them; the factor is a
    ratio, so it is exact again after one step (``reference``). Before B = 1 state was bf16:
    fp32 ``exp_avg``/``exp_avg_sq`` rounded to the nearest bf16 once. Anything that does not
    fit is left for ``check_loaded`` to name."""
    state = {
        **state,
        **{
            k: state[k].to(DENSE_DTYPE)
            for k in ("exp_avg", "exp_avg_sq")
            if isinstance(state.get(k), torch.Tensor) and state[k].dtype == torch.float32
        },
    }
    layout = state.get("layout")
    if "v_cross" in state or not isinstance(layout, torch.Tensor) or "v" not in state:
        return state
    if layout.dim() != 2 or layout.shape[1] != 4 or layout.shape[0] != len(segments):
        return state
    entries = [_cross_entries(s, int(r[3])) for s, r in zip(segments, layout.tolist(), strict=True)]
    return {
        **state,
        "layout": torch.cat(
            [layout, torch.tensor(entries, dtype=layout.dtype, device=layout.device)[:, None]],
            dim=1,
        ),
        "v_cross": torch.zeros(sum(entries), dtype=torch.float32, device=state["v"].device),
    }


def check_loaded(state: dict, segments: list[Segment], bits: int, name: str) -> None:
    """Raise ValueError naming the parameter when a saved state does not fit it."""
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"Gefen state for {name} lacks {missing}: not a Gefen state dict?")
    layout = state["layout"]
    if layout.dtype != torch.int64 or layout.dim() != 2 or layout.shape[1] != LAYOUT_COLS:
        raise ValueError(f"Gefen state for {name}: layout must be int64 (segments, {LAYOUT_COLS})")
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
    levels = state["codebook"].detach().float().cpu()
    if not bool(torch.isfinite(levels).all()) or not bool((levels[1:] > levels[:-1]).all()):
        raise ValueError(
            f"Gefen state for {name}: its codebook must hold finite, strictly increasing "
            "levels (every kernel rounds by searching them in order)"
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
    if layout[:, 4].tolist() != ref["layout"][:, 4].tolist():
        raise ValueError(
            f"Gefen state for {name}: v_cross entries per segment {layout[:, 4].tolist()}, "
            f"expected {ref['layout'][:, 4].tolist()} for these tensors and block sizes"
        )
    for k in GROWING_KEYS:
        t = state[k]
        if t.dtype != ref[k].dtype or t.shape != ref[k].shape:
            raise ValueError(
                f"Gefen state for {name}: {k!r} is {t.dtype} {tuple(t.shape)}, "
                f"expected {ref[k].dtype} {tuple(ref[k].shape)}"
            )
