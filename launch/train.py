"""One distributed training script for every launcher: a small GPT on the Python stdlib source.

A YAML run config (``configs/run/*.yaml``) chooses the model size, data, steps, optimizer
(Gefen or AdamW), bits and sharding (ddp, fsdp1, fsdp2, hsdp, deepspeed with a ZeRO stage,
accelerate); missing keys take the defaults in ``DEFAULTS`` and unknown or ill-typed keys stop
the run before any process group starts, naming the key. The same file runs under::

    torchrun --nproc_per_node 2 launch/train.py --config configs/run/fsdp2.yaml
    torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \
        launch/train.py --config configs/run/hsdp.yaml     # on each of 2 nodes
    deepspeed --num_gpus 2 launch/train.py --config configs/run/deepspeed_zero2.yaml
    accelerate launch --multi_gpu --num_processes 2 launch/train.py \
        --config configs/run/accelerate.yaml    # CPU processes where there is no GPU
    ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_CONFIG_FILE=configs/ds_zero2_auto_cpu.json \
        torchrun --nproc_per_node 2 launch/train.py --config configs/run/accelerate.yaml

``hsdp`` is FSDP2 on a 2-D (replicate, shard) device mesh: parameters sharded within a group
of ``sharding.mesh[1]`` ranks and replicated over ``sharding.mesh[0]`` such groups; the default
``[0, 0]`` takes the launcher's layout, one shard group per node (LOCAL_WORLD_SIZE ranks) and
one replica per node, which keeps the per-step all-gathers and reduce-scatters inside a node.

Each rank trains on its GPU (LOCAL_RANK, NCCL) where torch sees one, else on the CPU (gloo);
``device: cpu`` in the config keeps GPUs out. Only the CPU runs here: the GPU path is written to
the launchers' conventions and has not run. Rank 0 draws a progress bar and, with ``--out``,
writes a JSON with the loss curve and every rank's optimizer-state bytes, parameters held, peak
RSS and median step time, and says what actually ran (Accelerate on a CPU, say, runs an FSDP
config as plain data parallel).

Under Accelerate's DeepSpeed, a DeepSpeed config with an ``"optimizer"`` section makes DeepSpeed
build the optimizer (``"type": "Gefen"``) with the run config's lr and weight decay; its other
settings (betas, bits) are the DeepSpeed config's, and the run warns where they differ.

With ``checkpoint.dir`` set, the run saves at ``checkpoint.save_at`` (0: the last step), and
every ``checkpoint.every`` steps where that is set, through each framework's own path: DDP one
torch.save by rank 0, FSDP1/FSDP2 torch.distributed.checkpoint, DeepSpeed
``engine.save_checkpoint``, Accelerate ``save_state``; every rank adds its step, data generator
and loss curve. ``--resume DIR`` continues that run from the newest complete checkpoint in DIR
(or from DIR itself, where it is one): same config (``checkpoint.*`` aside) and launcher. At
the same world size it continues with the same losses as a run never stopped. Every mode also
resumes at another world size (``ELASTIC``), and HSDP on another mesh (``sharding.mesh`` may
change; the marker records the mesh that saved), through the framework's own load where
that re-cuts Gefen's state: DeepSpeed's ``engine.load_checkpoint`` (re-cut by
``gefen_dist.integrations.deepspeed``) and Accelerate's ``load_state`` (DDP, or DeepSpeed;
Accelerate's FSDP, which runs only on GPUs and is untested here, is refused). FSDP2, HSDP and
FSDP1 load their DCP checkpoint through DCP: FSDP2 and HSDP reshard the model and Gefen's state
(kept in global coordinates, ``gefen_dist.integrations.dcp``) with DCP's own load; FSDP1 reads
it whole (``gefen_dist.checkpoint.read_dcp``) and loads the whole model and optimizer dicts
through ``FSDP.optim_state_dict_to_load``. ``docs/checkpoints.md`` says how
close each is. Each rank keeps the step, the lr schedule and the curve, and draws its batches
from a generator seeded by the seed, the step and its new rank, since the old ranks' streams
do not map onto new ones.

A save can be cut short by a killed rank at any point and must never pass for a complete one:
each goes into ``DIR/.step_S.tmp/`` and becomes ``DIR/step_S/`` (zero-padded to six digits) only
once rank 0 has written a ``COMPLETE`` marker over files all on disk, so a torn save is ignored
on resume and removed when the next run starts (``trainer/checkpoint_dir.py``). A checkpoint
directory of the older flat layout (``trainer_rank0.pt`` in DIR itself) still loads.

``--digest`` adds to the ``--out`` JSON a sha256 per rank over that rank's pieces of the
parameters and over the optimizer's own parameters (DeepSpeed's fp32 partitions), state tensors
and settings, so that two runs can be checked for the same bits and not only the same losses.

Test hook: ``GEFEN_CHAOS_KILL="R:S:P"`` makes rank R send itself SIGKILL at point P of step S
(``forward``, ``step``, ``save`` or ``commit``; ``trainer/faults.py`` says where each falls), so
that ``launch/chaos.py`` can kill a rank inside a phase.

The script's parts live in the package ``trainer/`` beside it (config, per-launcher setup,
checkpoint directory, save and resume, faults, loop, results; its ``__init__`` lists them); this
file is the command line over them, and re-exports the names that ``launch/chaos.py``,
``launch/main_job.py`` and the tests read from it.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

# the parts' package, as a launcher's ``python launch/train.py`` finds it; also for a load of
# this file by path (importlib), which puts no directory on sys.path
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from trainer.checkpoint import ELASTIC, check_resume  # noqa: E402
from trainer.checkpoint_dir import (  # noqa: E402
    DONE,
    STEP_DIR,
    TRAINER_FILE,
    complete_checkpoints,
    find_checkpoint,
    is_complete,
    remove_torn,
    torn_checkpoints,
)
from trainer.checkpoint_dir import commit as _commit  # noqa: E402
from trainer.config import (  # noqa: E402
    DEFAULTS,
    ConfigError,
    check,
    hsdp_shape,
    load_config,
    lr_factor,
    set_key,
)
from trainer.faults import CHAOS_ENV, CHAOS_PHASES, Chaos, parse_chaos  # noqa: E402
from trainer.launchers import LauncherError, check_launcher, rank_device  # noqa: E402
from trainer.run import train  # noqa: E402

__all__ = [
    "CHAOS_ENV",
    "CHAOS_PHASES",
    "DEFAULTS",
    "DONE",
    "ELASTIC",
    "STEP_DIR",
    "TRAINER_FILE",
    "Chaos",
    "ConfigError",
    "LauncherError",
    "_commit",
    "check",
    "complete_checkpoints",
    "find_checkpoint",
    "hsdp_shape",
    "is_complete",
    "load_config",
    "lr_factor",
    "main",
    "parse_chaos",
    "rank_device",
    "remove_torn",
    "set_key",
    "torn_checkpoints",
    "train",
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="YAML run config (default: the built-in DEFAULTS)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key, e.g. --set optimizer.name=adamw (repeatable)",
    )
    ap.add_argument("--out", help="rank 0 writes the results JSON here")
    ap.add_argument(
        "--resume",
        metavar="DIR",
        help="continue from the newest complete checkpoint in DIR, or DIR itself where it is one "
        "(checkpoint.resume)",
    )
    ap.add_argument(
        "--digest",
        action="store_true",
        help="add every rank's sha256 of its parameters and optimizer state to the --out JSON",
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
        for s in args.set:
            set_key(cfg, s)
        if args.resume:
            cfg["checkpoint"]["resume"] = args.resume
        edited = " with --set/--resume" if args.set or args.resume else ""
        check(cfg, (args.config or "DEFAULTS") + edited)
        check_launcher(cfg, sys.argv[1:] if argv is None else argv)
        if cfg["checkpoint"]["resume"]:
            check_resume(cfg)
        chaos = parse_chaos(os.environ.get(CHAOS_ENV, ""))
    except (ConfigError, LauncherError) as e:
        ap.exit(2, f"error: {e}\n")
    train(cfg, args.out, progress=not args.no_progress, with_digest=args.digest, chaos=chaos)
    # The process group, the model and the optimizer sit in reference cycles, so without this
    # the last reference to gloo's process group went at interpreter exit: one of its worker
    # threads, still releasing a finished all_gather's tensors, asked for the GIL during
    # finalisation and the rank aborted ("terminate called without an active exception", rc -6;
    # a core dump showed ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> decref_pyobject ->
    # take_gil -> pthread_exit). Collected here, the group's destructor runs while Python runs:
    # it releases the GIL and joins its threads.
    gc.collect()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
