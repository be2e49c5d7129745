"""Gefen under DeepSpeed ZeRO: stages 1, 2 and 3, and DeepSpeed's bf16 stage-1 optimizer.

Why this package exists: ZeRO hands the inner optimizer one flat fp32 partition per param group
(stages 1 and 2, ``BF16_Optimizer``) or per sub-group (stage 3), each made of pieces of many
tensors and of alignment padding. Gefen chooses a block size per original tensor and learns one
codebook from the first gradient of the whole model, so it must be told where each tensor's pieces
lie in every partition and over which process group the other pieces are (``Gefen.set_segments``),
and it must see the first gradient of every partition before it updates any.

Installing: ``gefen_dist.register()`` (or ``register("deepspeed")``) patches DeepSpeed
(``patches``, which lists every change), and so do ``import gefen_dist`` with deepspeed already
imported and the construction of a Gefen with deepspeed imported. Importing this package alone
changes nothing. Once installed, Gefen is a ZeRO-supported optimizer (no
``zero_allow_untested_optimizer``), a JSON config may name it (``"optimizer": {"type":
"Gefen"}``, ``config_type``), and every engine built on a Gefen is bound to its partitions as
soon as its ZeRO wrapper exists, before any step or checkpoint load. ``configure(engine)`` does
the binding by hand (for a wrapper built some other way) and is idempotent.

Under pipeline parallelism (``PipelineEngine``, which allows ZeRO stages 0 and 1) each stage's
Gefen steps that stage's partitions over the stage's data-parallel group, so its block sizes are
those of a single process, and its codebook is learned from that stage's layers alone; a weight
tied across stages (``TiedLayerSpec``) is refused, as its copies would drift apart.

ZeRO-Offload (``offload_optimizer: {"device": "cpu"}``, stages 2 and 3) hands Gefen the fp32
partitions on the host, which Gefen steps with its C++ kernel (``backends.native_cpu``, chosen
for CPU tensors); ``patches`` says how DeepSpeed's check against client optimizers is lifted.

Checkpoints: ZeRO's rigid checkpoints (the default) carry each rank's ``Gefen.state_dict()``
unchanged, with the rank's segments (by tensor name) in its ``META_KEY`` entry (``meta``), and
load it through Gefen's own hooks, so a resume at the same data-parallel degree is exact; between
ZeRO-1, ZeRO-2 and BF16_Optimizer Gefen's own check compares the segments. At another
data-parallel degree, or between ZeRO-3 and ZeRO-1/2, ``engine.load_checkpoint`` re-cuts the
saved state (``recut``). ``read_checkpoint(dir)`` reads such a checkpoint whole without an engine
(``SavedZero``), for ``python -m gefen_dist.checkpoint consolidate`` (``checkpoint.zero``).
``load_optimizer_state(engine, sd)`` goes the other way: a single-process Gefen state cut into
this engine's partitions. ``elastic_checkpoint`` is refused: it cuts every state tensor by the
partition padding and merges state element by element, which would corrupt block state; so is
universal-checkpoint loading, which restores only element-wise state keys and would silently
drop Gefen's (``support``).

Modules: ``layouts`` (ZeRO partitions to segments), ``binding`` (Gefen tied to a wrapper: the
held first step, the checkpoint entry), ``meta`` (that entry's stored format), ``support``
(what is refused), ``report`` (memory and block sizes), ``config_type`` (the JSON type),
``patches`` (every change to DeepSpeed, version-guarded), ``saved`` (a checkpoint read whole),
``recut`` (resume at another degree or stage), ``load_state`` (a single-process state in).
"""

from __future__ import annotations

from .binding import configure
from .config_type import OPTIMIZER_TYPE, from_config
from .load_state import load_optimizer_state
from .meta import META_KEY
from .patches import UnsupportedDeepSpeed, install, installed
from .report import block_sizes, memory_report
from .saved import SavedZero, read_checkpoint

__all__ = [
    "configure",
    "install",
    "installed",
    "memory_report",
    "block_sizes",
    "from_config",
    "read_checkpoint",
    "load_optimizer_state",
    "SavedZero",
    "UnsupportedDeepSpeed",
    "META_KEY",
    "OPTIMIZER_TYPE",
]
