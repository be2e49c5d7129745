"""Which update serves a parameter: the choice alone, as a function of plain facts.

Why a module of its own: the rule must be testable where the hardware it speaks of is absent. A
CUDA device cannot be had in CI, but what Gefen does with one (Triton where it imports, else the
reference with one warning that says why) is a function of the device's type and of what
imports, so the tests call it with ``device="cuda"`` and check the answer.

Backends, as ``Gefen.backend`` names them:

- ``auto``: the fastest that serves the tensors: the C++ kernel on CPU tensors, the Triton
  kernels on CUDA tensors; the reference where neither serves (no compiler, no triton).
- ``native``: the same, but an unavailable kernel is an error instead of a fallback.
- ``triton``: the Triton kernels on every tensor they support; under ``TRITON_INTERPRET=1``
  that includes CPU tensors, which is how CI runs the GPU kernels.
- ``reference``: the reference, everywhere.

The choice is made per parameter, from its local tensor (a DTensor's shard): where FSDP2's
``CPUOffloadPolicy`` keeps shards on the host, they take the C++ kernel while CUDA parameters of
the same optimizer take Triton (``Gefen.backend_of`` names each one's).
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "native", "triton", "reference")

REPORT_NAMES = {
    "cpu": "native-cpu",
    "triton": "triton",
    "reference": "reference",
}
"""``memory_report()["backend"]`` per implementation."""


@dataclass(frozen=True)
class Facts:
    """What the choice depends on for one (parameter, gradient) pair. ``*_supports``: the
    backend takes these tensors (device, dtypes); ``*_available``: it loads (and builds) here;
    ``*_why``: why not, where it does not."""

    device: str
    cpp_supports: bool = False
    cpp_available: bool = False
    cpp_why: str | None = None
    triton_supports: bool = False
    triton_available: bool = False
    triton_why: str | None = None


@dataclass(frozen=True)
class Choice:
    """The implementation to run, and a fallback's reason to warn about once (or, for a
    backend that was asked for by name, to raise): (kernel, why) or None."""

    impl: str
    unavailable: tuple[str, str | None] | None = None


def choose(backend: str, f: Facts) -> Choice:
    """The update for ``backend`` and ``f``; raises where a named backend cannot serve."""
    if backend not in BACKENDS:
        raise ValueError(f"Invalid backend: {backend!r} ({', '.join(BACKENDS)})")
    if backend == "reference":
        return Choice("reference")
    if backend == "triton":
        if not f.triton_supports:
            raise RuntimeError(
                f"backend='triton' does not take {f.device} tensors of these dtypes (CUDA "
                "tensors of fp32, bf16 or fp16; CPU tensors too under TRITON_INTERPRET=1)"
            )
        if not f.triton_available:
            raise RuntimeError(
                f"backend='triton': the Triton kernels are unavailable: {f.triton_why}"
            )
        return Choice("triton")
    missing = None
    if f.device == "cuda" and f.triton_supports:
        if f.triton_available:
            return Choice("triton")
        missing = ("Triton", f.triton_why)
    if f.device == "cpu" and f.cpp_supports:
        if f.cpp_available:
            return Choice("cpu")
        missing = ("C++ CPU", f.cpp_why)
    if backend == "native":
        if missing is not None:
            raise RuntimeError(
                f"backend='native': the {missing[0]} kernels are unavailable: {missing[1]}"
            )
        raise RuntimeError(f"backend='native' has no kernel for {f.device} tensors of these dtypes")
    return Choice("reference", missing)
