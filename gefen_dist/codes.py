"""First-moment codes: nearest-level quantisation and the packed 4-bit layout.

Codes of one segment start on a byte boundary. At 4 bits, element 2i of a segment is the low
nibble of byte i and element 2i+1 the high nibble, so a segment of n elements takes ceil(n/2)
bytes and a state saved at 4 bits stays at 4 bits. Ties between two levels go to the lower one;
native kernels must do the same to match the reference bit for bit.
"""

from __future__ import annotations

import functools
import weakref

import torch


def code_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def midpoints(levels: torch.Tensor) -> torch.Tensor:
    return (levels[1:] + levels[:-1]) * 0.5


def quantize(x: torch.Tensor, mids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level for values already divided by their block absmax."""
    return torch.bucketize(x, mids).to(torch.uint8)


def pack4(codes: torch.Tensor) -> torch.Tensor:
    n = codes.numel()
    if n % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.stack([packed & 0xF, packed >> 4], dim=1).view(-1)
    return out[:numel]


def read_codes(codes: torch.Tensor, a: int, b: int, bits: int) -> torch.Tensor:
    """Codes of elements [a, b) of one segment whose code bytes are ``codes``."""
    if bits == 8:
        return codes[a:b]
    lo = a // 2
    return unpack4(codes[lo : (b + 1) // 2], 2 * ((b + 1) // 2 - lo))[a - 2 * lo : b - 2 * lo]


def write_codes(codes: torch.Tensor, a: int, b: int, new: torch.Tensor, bits: int) -> None:
    """Store codes of elements [a, b); at 4 bits the neighbours sharing an edge byte are kept."""
    if bits == 8:
        codes[a:b] = new
        return
    lo, hi = a // 2, (b + 1) // 2
    if a % 2 == 0 and b % 2 == 0:
        codes[lo:hi] = pack4(new)
        return
    merged = unpack4(codes[lo:hi], 2 * (hi - lo))
    merged[a - 2 * lo : b - 2 * lo] = new
    codes[lo:hi] = pack4(merged)


_TABLES: dict[tuple[int, int], tuple[weakref.ref, torch.Tensor]] = {}


def _forget(key: tuple[int, int], _ref: weakref.ref) -> None:
    _TABLES.pop(key, None)


def nearest_table(mids: torch.Tensor, cells: int) -> torch.Tensor:
    """For cell c of a uniform grid of ``cells`` over [-1, 1], how many midpoints lie below its
    left edge (int32): where a native kernel starts looking for the nearest level, so it needs a
    step or two instead of a binary search. Cached per midpoints tensor while it lives."""
    key = (id(mids), cells)
    hit = _TABLES.get(key)
    if hit is not None and hit[0]() is mids:
        return hit[1]
    edges = torch.linspace(-1.0, 1.0, cells + 1, dtype=torch.float64)[:-1]
    table = torch.searchsorted(mids.double().contiguous(), edges).to(torch.int32)
    return _cache(key, mids, table)


def code_table(mids: torch.Tensor, cells: int) -> torch.Tensor:
    """For cell c of a uniform grid of ``cells`` over [-1, 1] (int32): the nearest level's index
    for every x in the cell when no midpoint lies within one cell width of it, else -1 - (the
    midpoints below the cell's left edge minus one width). So a native kernel finds most codes
    with one load, vectorised, and walks from the start it is given for the rest; the margin
    covers an x that rounding puts into a neighbouring cell. Cached per midpoints tensor."""
    key = (id(mids), -cells)
    hit = _TABLES.get(key)
    if hit is not None and hit[0]() is mids:
        return hit[1]
    m = mids.double().contiguous()
    width = 2.0 / cells
    left = torch.linspace(-1.0, 1.0, cells + 1, dtype=torch.float64)[:-1]
    below = torch.searchsorted(m, left - width)  # midpoints < the widened left edge
    upto = torch.searchsorted(m, left + 2 * width, right=True)  # <= the widened right edge
    table = torch.where(upto == below, below, -1 - below).to(torch.int32)
    return _cache(key, mids, table)


def _cache(key: tuple[int, int], mids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    _TABLES[key] = (weakref.ref(mids, functools.partial(_forget, key)), table)
    return table
