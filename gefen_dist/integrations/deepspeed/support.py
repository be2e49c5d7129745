"""DeepSpeed features Gefen refuses by name, before it binds to an engine's partitions.

Each would go wrong without a word: drop or corrupt Gefen's block state (kept per block of each
original tensor, not element by element as AdamW's is), hand part of the model to another
optimizer or process group, or let the copies of one tied weight drift apart.
"""

from __future__ import annotations

from typing import Any

from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

__all__ = ["refuse_tied_stages", "refuse_unsupported"]


def refuse_unsupported(engine: DeepSpeedEngine | None, wrapper: Any) -> None:
    def no(problem: str) -> None:
        raise ValueError(f"Gefen under DeepSpeed: {problem}")

    if engine is not None and engine.load_universal_checkpoint():
        no(
            "load_universal_checkpoint is not supported: a universal checkpoint restores only "
            "optimizer state kept element by element (AdamW's exp_avg), so Gefen's block state "
            "would be silently dropped; resume from the rigid ZeRO checkpoint instead"
        )
    if getattr(wrapper, "elastic_checkpoint", False):
        no(
            "zero_optimization.elastic_checkpoint is not supported: it strips partition padding "
            "from every optimizer-state tensor and merges them element by element, which would "
            "corrupt Gefen's per-block state; leave it false (the default)"
        )
    if engine is not None:
        refuse_tied_stages(engine)
    if getattr(wrapper, "has_moe_layers", False):
        no("MoE layers are not supported (experts are partitioned over other process groups)")
    if getattr(wrapper, "zenflow", False):
        no("ZenFlow is not supported (it steps its own CPU optimizer)")
    if isinstance(wrapper, DeepSpeedZeroOptimizer_Stage3):
        if wrapper.swap_optimizer or wrapper.params_in_nvme_and_cpu:
            no("NVMe offload is not supported (the swapper assumes element-wise optimizer state)")
        if wrapper.offload_optimizer and wrapper.partial_offload != 1.0:
            no(
                "partial optimizer offload (offload_optimizer.ratio < 1) is not supported: part "
                "of the sub-groups would be stepped by a separate backup optimizer"
            )


def refuse_tied_stages(engine: DeepSpeedEngine) -> None:
    """A pipeline weight tied over stages (``TiedLayerSpec``) has one copy per stage, each stepped
    by that stage's Gefen from the same all-reduced gradient. Each stage learns its codebook from
    its own layers' first gradient, so the copies get different updates and drift apart (3e-3
    in 6 steps at lr 3e-3 on the tiny GPT; AdamW keeps them equal)."""
    tied = getattr(engine.module, "tied_comms", None) or {}
    spread = {k: d["ranks"] for k, d in tied.items() if len(d["ranks"]) > 1}
    if spread:
        key, ranks = next(iter(spread.items()))
        raise ValueError(
            f"Gefen under DeepSpeed: pipeline weights tied across stages are not supported "
            f"(TiedLayerSpec {key!r} has copies on global ranks {ranks}): each stage's Gefen "
            "learns its own codebook, so the copies would get different updates and drift "
            "apart; untie the weight, or keep every layer that shares it on one stage"
        )
