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
FSDP1 read their DCP checkpoint whole (``gefen_dist.checkpoint.read_dcp``): FSDP2 and HSDP
reshard the model through DCP and re-cut Gefen's consolidated state, FSDP1 loads the whole model and
optimizer dicts through ``FSDP.optim_state_dict_to_load``. ``docs/checkpoints.md`` says how
close each is. Each rank keeps the step, the lr schedule and the curve, and draws its batches
from a generator seeded by the seed, the step and its new rank, since the old ranks' streams
do not map onto new ones.

A save can be cut short by a killed rank at any point, and must then never pass for a complete
one, whatever the framework wrote (DCP's ``.metadata``, DeepSpeed's ``latest``). So every save of
step S goes into ``DIR/.step_S.tmp/``; after a barrier that every rank reaches only once its files
are written, rank 0 fsyncs them, writes and fsyncs the marker ``COMPLETE`` (the step, the world
size, each file's size) and renames the directory to ``DIR/step_S/`` (zero-padded to six
digits). A directory counts as a checkpoint only under that name with a marker whose files are
all there, so a torn save is ignored on resume, and removed when the next run starts. A
checkpoint directory of the older flat layout (``trainer_rank0.pt`` in DIR itself) still loads.

``--digest`` adds to the ``--out`` JSON a sha256 per rank over that rank's pieces of the
parameters and over the optimizer's own parameters (DeepSpeed's fp32 partitions), state tensors
and settings, so that two runs can be checked for the same bits and not only the same losses.

Test hook: ``GEFEN_CHAOS_KILL="R:S:P"`` makes rank R send itself SIGKILL at point P of step S,
so that ``launch/chaos.py`` can kill a rank inside a phase rather than at a random instant that
mostly falls in startup. P is ``forward`` (the training forward, after the first block ran),
``step`` (the optimizer's step pre-hook: under DeepSpeed inside ``engine.step()``, after ZeRO
reduced the gradients), ``save`` (half of the rank's trainer file written, after the framework
wrote its part) or ``commit`` (rank 0: the marker written, the rename not done; any other rank:
past the barrier, racing rank 0's rename). A save or commit point fires only where step S saves.
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import io
import json
import os
import re
import resource
import shlex
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from gefen_dist import Gefen
from gefen_dist.demo import loop
from gefen_dist.demo.corpus import get_batch, load_corpus
from gefen_dist.demo.model import GPT, Block, GPTConfig
from gefen_dist.distributed.collectives import comm_device
from gefen_dist.schedule import warmup_cosine

DEFAULTS: dict = {
    "model": {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 64},
    "data": {"max_bytes": 2 * 2**20, "batch_size": 8, "val_batches": 8},
    "steps": 40,
    "eval_every": 10,
    "seed": 0,
    "optimizer": {
        "name": "gefen",
        "bits": 4,
        "lr": 1e-3,
        "betas": [0.9, 0.95],
        "weight_decay": 0.1,
        "warmup": 4,
        "min_lr_frac": 0.1,
        "grad_clip": 1.0,
    },
    "sharding": {"mode": "ddp", "zero_stage": 2, "mesh": [0, 0]},
    "device": "auto",
    "checkpoint": {"dir": "", "save_at": 0, "every": 0, "resume": ""},
}
CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "optimizer.name": ("gefen", "adamw"),
    "optimizer.bits": (4, 8),
    "sharding.mode": ("ddp", "fsdp1", "fsdp2", "hsdp", "deepspeed", "accelerate"),
    "sharding.zero_stage": (1, 2, 3),
}
POSITIVE = {"steps", "eval_every", "data.batch_size", "data.val_batches", "data.max_bytes",
            "model.n_layer", "model.n_head", "model.n_embd", "model.block_size"}  # fmt: skip
LAUNCHERS = {
    "ddp": "torchrun --nproc_per_node 2",
    "fsdp1": "torchrun --nproc_per_node 2",
    "fsdp2": "torchrun --nproc_per_node 2",
    "hsdp": "torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint HOST:29500",
    "deepspeed": "deepspeed --num_gpus 2",
    "accelerate": "accelerate launch --multi_gpu --num_processes 2",
}
TRAINER_FILE = "trainer_rank{}.pt"
STEP_DIR = "step_{:06d}"
STEP_RE = re.compile(r"step_(\d{6,})")
TORN_RE = re.compile(r"\.step_\d{6,}\.(tmp|old)")
DONE = "COMPLETE"
CHAOS_ENV = "GEFEN_CHAOS_KILL"
CHAOS_PHASES = ("forward", "step", "save", "commit")
MiB = 2**20


class ConfigError(ValueError):
    """A run config that names an unknown key, has a value of the wrong type or out of range."""


class LauncherError(RuntimeError):
    """The script was started without the launcher its sharding mode needs."""


def _merge(defaults: dict, given: dict, where: str, prefix: str = "") -> dict:
    if not isinstance(given, dict):
        raise ConfigError(f"{where}: {prefix.rstrip('.') or 'the config'} must be a mapping")
    out = copy.deepcopy(defaults)
    for key, value in given.items():
        name = f"{prefix}{key}"
        if key not in defaults:
            known = ", ".join(f"{prefix}{k}" for k in defaults)
            raise ConfigError(f"{where}: unknown key {name!r} (known here: {known})")
        default = defaults[key]
        if isinstance(default, dict):
            out[key] = _merge(default, value, where, name + ".")
            continue
        ok = (
            isinstance(value, list) and len(value) == len(default)
            if isinstance(default, list)
            else isinstance(value, float | int) and not isinstance(value, bool)
            if isinstance(default, float)
            else isinstance(value, type(default)) and not isinstance(value, bool)
        )
        if not ok:
            raise ConfigError(f"{where}: key {name!r} must be like {default!r}, got {value!r}")
        if name in CHOICES and value not in CHOICES[name]:
            raise ConfigError(
                f"{where}: key {name!r} must be one of {CHOICES[name]}, got {value!r}"
            )
        if name in POSITIVE and value <= 0:
            raise ConfigError(f"{where}: key {name!r} must be positive, got {value!r}")
        out[key] = float(value) if isinstance(default, float) else value
    return out


def load_config(source: str | Path | dict | None) -> dict:
    """The full run config: a YAML path (or a dict already parsed) over ``DEFAULTS``."""
    if source is None:
        return copy.deepcopy(DEFAULTS)
    if isinstance(source, dict):
        cfg = _merge(DEFAULTS, source, "config")
        check(cfg, "config")
        return cfg
    text = Path(source).read_text()
    cfg = _merge(DEFAULTS, yaml.safe_load(text) or {}, str(source))
    check(cfg, str(source))
    return cfg


def check(cfg: dict, where: str) -> None:
    """The checks that span keys or need the optimizer's own rules, so that a bad value stops
    the run here rather than on every rank after the process group started."""
    o = cfg["optimizer"]
    for key in ("lr", "betas", "weight_decay"):
        # one key at a time over valid defaults, so the error can name the key at fault
        trial = {**cfg, "optimizer": {**DEFAULTS["optimizer"], "name": o["name"], key: o[key]}}
        try:
            build_optimizer(trial, [torch.zeros(1, requires_grad=True)])
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"{where}: key 'optimizer.{key}' = {o[key]!r} is refused by {o['name']}: {e}"
            ) from None
    check_mesh(cfg, where)
    c = cfg["checkpoint"]
    if not 0 <= c["save_at"] <= cfg["steps"]:
        raise ConfigError(
            f"{where}: key 'checkpoint.save_at' must be in [0, steps={cfg['steps']}] "
            f"(0: the last step), got {c['save_at']}"
        )
    if c["every"] < 0:
        raise ConfigError(
            f"{where}: key 'checkpoint.every' must be >= 0 (0: off), got {c['every']}"
        )
    for key in ("save_at", "every"):
        if c[key] and not c["dir"]:
            raise ConfigError(f"{where}: key 'checkpoint.{key}' needs 'checkpoint.dir' set")
    if c["resume"] and find_checkpoint(c["resume"]) is None:
        raise ConfigError(
            f"{where}: key 'checkpoint.resume': {c['resume']!r} holds no complete checkpoint of "
            f"this script (no step_NNNNNN/ with a {DONE} marker, nor a "
            f"{TRAINER_FILE.format(0)})"
        )


def check_mesh(cfg: dict, where: str) -> None:
    """``sharding.mesh``: [replicate, shard], both positive, or [0, 0] (one shard group per
    node); only for hsdp; and, where the launcher has set WORLD_SIZE, a shape of that many ranks,
    so that a wrong shape stops here and not in every rank's mesh setup."""
    s = cfg["sharding"]
    mesh = s["mesh"]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in mesh):
        raise ConfigError(
            f"{where}: key 'sharding.mesh' must be two integers >= 0 [replicate, shard], "
            f"got {mesh!r}"
        )
    if mesh != [0, 0] and 0 in mesh:
        raise ConfigError(
            f"{where}: key 'sharding.mesh' must be [replicate, shard] with both positive, or "
            f"[0, 0] (one shard group per node), got {mesh!r}"
        )
    if mesh != [0, 0] and s["mode"] != "hsdp":
        raise ConfigError(
            f"{where}: key 'sharding.mesh' applies to sharding.mode 'hsdp' only "
            f"(mode is {s['mode']!r}); leave it [0, 0]"
        )
    world = os.environ.get("WORLD_SIZE")
    if s["mode"] == "hsdp" and world is not None:
        shape = hsdp_shape(cfg, int(world), local_world_size())
        if shape[0] * shape[1] != int(world):
            raise ConfigError(
                f"{where}: key 'sharding.mesh' = {mesh!r} is a mesh of {shape[0] * shape[1]} "
                f"ranks, but the launcher started {world}"
            )


def local_world_size() -> int | None:
    """Ranks per node, as the launcher says: torchrun's LOCAL_WORLD_SIZE, DeepSpeed's LOCAL_SIZE."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if name in os.environ:
            return int(os.environ[name])
    return None


def hsdp_shape(cfg: dict, world: int, local_world: int | None) -> tuple[int, int]:
    """(replicate, shard) of the hsdp mesh: the config's, or one shard group per node."""
    mesh = cfg["sharding"]["mesh"]
    if mesh != [0, 0]:
        return mesh[0], mesh[1]
    if local_world is None:
        raise ConfigError(
            "sharding.mesh [0, 0] shards within a node, but the launcher did not say how many "
            "ranks a node runs (LOCAL_WORLD_SIZE): set sharding.mesh to [replicate, shard]"
        )
    if world % local_world:
        raise ConfigError(
            f"sharding.mesh [0, 0] shards within a node, but {world} ranks do not divide into "
            f"nodes of {local_world}: set sharding.mesh to [replicate, shard]"
        )
    return world // local_world, local_world


def is_complete(d: str | Path) -> bool:
    """Whether ``d`` holds a finished save: its marker, and every file the marker lists at the
    size it lists (a file lost or cut later makes it as unusable as a torn save)."""
    try:
        marker = json.loads((Path(d) / DONE).read_text())
        return all((Path(d) / rel).stat().st_size == size for rel, size in marker["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint under ``root``, oldest first."""
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return []
    found = [(int(m.group(1)), e) for e in entries if (m := STEP_RE.fullmatch(e.name))]
    return sorted((s, e) for s, e in found if is_complete(e))


def torn_checkpoints(root: str | Path) -> list[Path]:
    """Saves that never completed (or a replaced checkpoint not yet removed) under ``root``."""
    try:
        return sorted(e for e in Path(root).iterdir() if TORN_RE.fullmatch(e.name))
    except OSError:
        return []


def find_checkpoint(d: str | Path) -> Path | None:
    """The checkpoint ``--resume d`` loads: ``d`` itself where it is a complete one, else the
    newest complete one in it; a flat-layout directory of earlier revisions counts as complete,
    since this script never writes that layout any more (a torn save is never named so)."""
    d = Path(d)
    if is_complete(d):
        return d
    found = complete_checkpoints(d)
    if found:
        return found[-1][1]
    legacy = (d / TRAINER_FILE.format(0)).is_file() and not (d / DONE).exists()
    if legacy and not TORN_RE.fullmatch(d.name) and not STEP_RE.fullmatch(d.name):
        return d
    return None


def parse_chaos(spec: str) -> tuple[int, int, str] | None:
    """``R:S:P`` from ``GEFEN_CHAOS_KILL`` (see the module docstring), checked before any process
    group starts, so that a typo fails the test at once rather than letting the run live."""
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit() and parts[2] in CHAOS_PHASES:
        return int(parts[0]), int(parts[1]), parts[2]
    raise ConfigError(
        f"{CHAOS_ENV}={spec!r}: expected RANK:STEP:PHASE, PHASE one of {', '.join(CHAOS_PHASES)}"
    )


class Chaos:
    """The kill point of ``GEFEN_CHAOS_KILL`` on this rank; inert where none is set."""

    def __init__(self, target: tuple[int, int, str] | None, rank: int):
        self.target = target if target and target[0] == rank else None
        self.rank = rank
        self.step = 0
        self.in_forward = False

    def due(self, phase: str) -> bool:
        return self.target is not None and self.target[1:] == (self.step, phase)

    def at(self, phase: str) -> None:
        if self.due(phase):
            self.kill(phase)

    def kill(self, phase: str) -> None:
        sys.stdout.flush()
        print(f"chaos: rank {self.rank} sends itself SIGKILL in the {phase} of step {self.step}",
              file=sys.stderr, flush=True)  # fmt: skip
        os.kill(os.getpid(), signal.SIGKILL)

    def install(self, model: torch.nn.Module, opt) -> None:
        """The forward and step kill points, as hooks, only on the rank that is to die."""
        if self.target is None:
            return
        first = next(m for m in model.modules() if isinstance(m, Block))

        def forward_hook(*_):
            if self.in_forward:
                self.at("forward")

        first.register_forward_hook(forward_hook)
        stepped(opt).register_step_pre_hook(lambda *_: self.at("step"))


def check_launcher(cfg: dict, argv: list[str]) -> None:
    """Without a launcher torch fails deep in rendezvous ("environment variable RANK expected");
    say instead which launcher this mode takes. MPI launches set their own rank variables, which
    DeepSpeed and Accelerate read."""
    mode = cfg["sharding"]["mode"]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    mpi = ("OMPI_COMM_WORLD_RANK", "PMI_RANK")
    if mode in ("deepspeed", "accelerate") and any(n in os.environ for n in mpi):
        return
    command = " ".join([LAUNCHERS[mode], shlex.quote(sys.argv[0]), *map(shlex.quote, argv)])
    raise LauncherError(
        f"sharding.mode {mode!r} runs one process per rank under a launcher, and none started "
        f"this one (RANK and WORLD_SIZE are not set). Run:\n    {command}"
    )


ELASTIC = ("ddp", "fsdp1", "fsdp2", "hsdp", "deepspeed", "accelerate")
"""Sharding modes whose checkpoints resume at another world size (module docstring)."""


def check_resume(cfg: dict) -> None:
    """A resumed run must repeat the saved run's settings: any other model, data or schedule
    would not continue the same run, and would fail later and less clearly. Another world size
    is refused only where the mode's checkpoints cannot be re-cut (not in ``ELASTIC``)."""
    d = find_checkpoint(cfg["checkpoint"]["resume"])
    saved = torch.load(d / TRAINER_FILE.format(0), weights_only=True)
    old, new = _flat(saved["config"]), _flat(cfg)
    differ = [
        f"{k}: {old.get(k)!r} saved, {new.get(k)!r} now"
        for k in sorted(old.keys() | new.keys())
        if not k.startswith("checkpoint.") and k != "sharding.mesh" and old.get(k) != new.get(k)
    ]
    world = os.environ.get("WORLD_SIZE")
    mode = cfg["sharding"]["mode"]
    if world is not None and int(world) != saved["world_size"] and mode not in ELASTIC:
        differ.append(
            f"world size: {saved['world_size']} saved, {world} now (sharding.mode {mode!r} "
            f"resumes only at its own world size; {', '.join(ELASTIC)} resume at any)"
        )
    if differ:
        raise ConfigError(
            f"checkpoint.resume {str(d)!r}: a resumed run needs the saved run's config and world "
            "size; " + "; ".join(differ)
        )


def _flat(cfg: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in cfg.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def set_key(cfg: dict, dotted: str) -> None:
    """Apply one ``--set optimizer.name=adamw`` override (the value parsed as YAML)."""
    if "=" not in dotted:
        raise ConfigError(f"--set {dotted!r}: expected KEY=VALUE")
    key, value = dotted.split("=", 1)
    *path, last = key.split(".")
    nested: dict = {last: yaml.safe_load(value)}
    for part in reversed(path):
        nested = {part: nested}
    merged = _merge(DEFAULTS, _deep_update(copy.deepcopy(cfg), nested), f"--set {key}")
    cfg.clear()
    cfg.update(merged)


def _deep_update(base: dict, new: dict) -> dict:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v)
        else:
            base[k] = v
    return base


def lr_factor(cfg: dict, step: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_lr_frac`` at the end."""
    o = cfg["optimizer"]
    return warmup_cosine(step, cfg["steps"], o["warmup"], o["min_lr_frac"])


def build_optimizer(cfg: dict, params) -> torch.optim.Optimizer:
    o = cfg["optimizer"]
    common = dict(lr=o["lr"], betas=tuple(o["betas"]), weight_decay=o["weight_decay"])
    if o["name"] == "adamw":
        return torch.optim.AdamW(params, **common)
    return Gefen(params, bits=o["bits"], **common)


def stepped(opt) -> torch.optim.Optimizer:
    """The optimizer that updates the weights, inside DeepSpeed's and Accelerate's wrappers."""
    while hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


def state_bytes(opt) -> tuple[int, int]:
    """(optimizer-state bytes, parameters it holds state for) on this rank."""
    opt = stepped(opt)
    if isinstance(opt, Gefen):
        rep = opt.memory_report()
        return int(rep["state_bytes"]), int(rep["params"])
    held = sum(
        _local(v).numel() * v.element_size()
        for st in opt.state.values()
        for k, v in st.items()
        if torch.is_tensor(v) and k != "step"
    )
    return held, sum(_local(p).numel() for p in opt.state)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece: a DTensor's (FSDP2) numel() is the whole tensor's."""
    return t.to_local() if hasattr(t, "to_local") else t


def rank_device(cfg: dict) -> torch.device:
    """This rank's GPU (the launcher's LOCAL_RANK) with NCCL where the config says cuda, or says
    auto and the machine has one; else the CPU with gloo."""
    want = cfg["device"]
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' asked for, but torch sees no GPU here")
    if want == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def setup(cfg: dict, model: torch.nn.Module, device: torch.device):
    """Wrap the model for the configured sharding on ``device``: (model, optimizer, engine,
    accelerator)."""
    mode = cfg["sharding"]["mode"]
    engine = accelerator = None
    backend = "nccl" if device.type == "cuda" else "gloo"
    if mode == "deepspeed":
        import deepspeed

        import gefen_dist.integrations.deepspeed  # noqa: F401  registers Gefen with ZeRO, maps its partitions

        deepspeed.init_distributed(dist_backend=backend)
        ds_config = {
            "train_micro_batch_size_per_gpu": cfg["data"]["batch_size"],
            "gradient_clipping": cfg["optimizer"]["grad_clip"],
            "zero_optimization": {"stage": cfg["sharding"]["zero_stage"]},
        }
        opt = build_optimizer(cfg, model.parameters())
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        return engine, opt, engine, None
    if mode == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, InitProcessGroupKwargs

        import gefen_dist.integrations.fsdp

        # cpu=True would make Accelerate drop DeepSpeed for plain data parallel; without a GPU
        # its DeepSpeed path finds no backend unless told gloo, and calls every rank 0 of 1.
        cpu = device.type == "cpu"
        deepspeed_asked = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
        handlers = [InitProcessGroupKwargs(backend="gloo")] if cpu else []
        accelerator = Accelerator(cpu=cpu and not deepspeed_asked, kwargs_handlers=handlers)
        _warn_accelerate_fallback(accelerator)
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            model, opt = _prepare_accelerate_deepspeed(cfg, accelerator, model)
        else:
            opt = build_optimizer(cfg, model.parameters())
            model, opt = accelerator.prepare(model, opt)
        fsdp1 = accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2
        if fsdp1 and isinstance(opt.optimizer, Gefen):
            gefen_dist.integrations.fsdp.configure(model, opt.optimizer)
        return model, opt, None, accelerator
    dist.init_process_group(backend)
    model.to(device)
    if mode == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        opt = build_optimizer(cfg, model.parameters())
    elif mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        import gefen_dist.integrations.fsdp

        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device)
        opt = build_optimizer(cfg, model.parameters())
        if isinstance(opt, Gefen):
            gefen_dist.integrations.fsdp.configure(model, opt)  # flat shards -> original tensors
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # the mesh on the rank's device: FSDP2's default takes a GPU wherever there is one
        world = dist.get_world_size()
        if mode == "hsdp":
            shape = hsdp_shape(cfg, world, local_world_size())
            mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device.type, (world,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = build_optimizer(cfg, model.parameters())
    return model, opt, engine, accelerator


def _prepare_accelerate_deepspeed(cfg: dict, accelerator, model):
    """Accelerate refuses a built optimizer when the DeepSpeed config defines one: DeepSpeed then
    builds it from the config (Gefen only once ``gefen_dist.register()`` ran), taking the run
    config's lr and weight decay through ``DummyOptim`` into the config's "auto"."""
    from accelerate.utils import DummyOptim

    import gefen_dist

    gefen_dist.register("deepspeed")
    o = cfg["optimizer"]
    plugin = accelerator.state.deepspeed_plugin
    # Left "auto", Accelerate wants a DataLoader for the batch size (this script has none) and
    # clips at its own 1.0 whatever optimizer.grad_clip says.
    plugin.fill_match("train_micro_batch_size_per_gpu", must_match=False,
                      train_micro_batch_size_per_gpu=cfg["data"]["batch_size"])  # fmt: skip
    plugin.fill_match("gradient_clipping", must_match=False,
                      gradient_clipping=max(0.0, o["grad_clip"]))  # fmt: skip
    section = plugin.deepspeed_config.get("optimizer")
    where = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "the DeepSpeed config")
    if section is None:
        opt = build_optimizer(cfg, model.parameters())
    else:
        named = str(section.get("type", "")).lower()
        if named != o["name"]:
            raise ConfigError(
                f"optimizer.name is {o['name']!r}, but {where} builds its optimizer as "
                f"{section.get('type')!r}: make them agree"
            )
        opt = DummyOptim(model.parameters(), lr=o["lr"], weight_decay=o["weight_decay"])
    model, opt = accelerator.prepare(model, opt)
    built = stepped(opt)
    if o["name"] == "gefen" and not isinstance(built, Gefen):
        raise RuntimeError(f"DeepSpeed built {type(built).__name__} from {where}, not Gefen")
    if section is not None and isinstance(built, Gefen) and accelerator.is_main_process:
        g = built.param_groups[0]
        got = {k: g[k] for k in ("lr", "weight_decay", "bits")} | {"betas": list(g["betas"])}
        differ = [f"optimizer.{k}={v!r} (run config: {o[k]!r})" for k, v in got.items()
                  if v != o[k]]  # fmt: skip
        if differ:
            print(f"warning: {where} sets {', '.join(differ)}; the run uses its values",
                  file=sys.stderr, flush=True)  # fmt: skip
    return model, opt


def _warn_accelerate_fallback(accelerator) -> None:
    """Accelerate on a CPU ignores an FSDP config (and a DeepSpeed one when told ``cpu=True``)
    and runs plain data parallel, every rank holding the whole model and optimizer state,
    without a word: say so, once."""
    from accelerate.utils import DistributedType

    flags = {"FSDP": "ACCELERATE_USE_FSDP", "DeepSpeed": "ACCELERATE_USE_DEEPSPEED"}
    asked = [name for name, var in flags.items() if os.environ.get(var, "").lower() == "true"]
    ran = accelerator.distributed_type
    if asked and ran not in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        if accelerator.is_main_process:
            print(
                f"warning: the Accelerate config asks for {' and '.join(asked)}, but Accelerate "
                f"runs {ran.value} on {accelerator.device.type}: plain data parallel, no "
                "sharding (every rank keeps the whole model and optimizer state)",
                file=sys.stderr,
                flush=True,
            )


def what_ran(cfg: dict, opt, engine, accelerator, device: torch.device) -> dict:
    """What the launcher and framework actually ran, which can differ from what was asked."""
    ran = dict(
        mode=cfg["sharding"]["mode"],
        device=str(device),
        backend=str(dist.get_backend()),
        distributed_type=cfg["sharding"]["mode"].upper(),
        optimizer=type(stepped(opt)).__name__,
    )
    if cfg["sharding"]["mode"] == "hsdp":
        ran["mesh"] = list(hsdp_shape(cfg, dist.get_world_size(), local_world_size()))
    if engine is not None:
        ran.update(distributed_type="DEEPSPEED", zero_stage=engine.zero_optimization_stage(),
                   gradient_clipping=engine.gradient_clipping())  # fmt: skip
    elif accelerator is not None:
        from accelerate.utils import DistributedType

        ran["distributed_type"] = accelerator.distributed_type.value
        if accelerator.distributed_type == DistributedType.FSDP:
            ran["fsdp_version"] = 2 if accelerator.is_fsdp2 else 1
        elif accelerator.distributed_type == DistributedType.DEEPSPEED:
            ds = accelerator.deepspeed_engine_wrapped.engine
            ran.update(zero_stage=ds.zero_optimization_stage(),
                       gradient_clipping=ds.gradient_clipping())  # fmt: skip
    return ran


def _ran_label(ran: dict) -> str:
    what = ran["distributed_type"]
    if "zero_stage" in ran:
        what += f" ZeRO-{ran['zero_stage']}"
    if "fsdp_version" in ran:
        what += f"{ran['fsdp_version']}"
    return f"{what} on {ran['device']} ({ran['backend']})"


def save_checkpoint(
    cfg: dict, root: Path, step: int, model, opt, engine, accelerator, trainer: dict,
    chaos: Chaos | None = None,
) -> Path:  # fmt: skip
    """Each framework's own checkpoint and every rank's trainer file, in a directory that takes
    its final name (``step_NNNNNN``) only once all of it is on disk: a rank killed at any point
    leaves a ``.step_NNNNNN.tmp`` that no resume takes (module docstring)."""
    chaos = chaos or Chaos(None, 0)
    mode = cfg["sharding"]["mode"]
    rank = dist.get_rank()
    final = root / STEP_DIR.format(step)
    d = root / f".{final.name}.tmp"
    if rank == 0:  # a torn save of this step by an earlier, killed run
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    dist.barrier()
    if engine is not None:
        # DeepSpeed's own "latest" file lands in d too: renamed with the rest or never seen,
        # and the load names its tag rather than reading it
        engine.save_checkpoint(str(d), tag="deepspeed")
    elif accelerator is not None:
        accelerator.save_state(str(d / "accelerate"))
    elif mode == "ddp":
        if rank == 0:
            state = {"model": model.module.state_dict(), "optim": opt.state_dict()}
            torch.save(state, d / "ddp.pt")
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d / "dcp"))
    buf = io.BytesIO()
    torch.save(trainer, buf)
    data = buf.getvalue()
    with open(d / TRAINER_FILE.format(rank), "wb") as f:
        if chaos.due("save"):  # a file cut short, as a kill in the middle of a write leaves it
            f.write(data[: len(data) // 2])
            f.flush()
            chaos.kill("save")
        f.write(data)
    dist.barrier()  # every rank's files are written
    if rank == 0:
        world = dist.get_world_size()
        mesh = hsdp_shape(cfg, world, local_world_size()) if mode == "hsdp" else None
        _commit(d, final, step, world, chaos, mesh)
    else:
        chaos.at("commit")
    dist.barrier()
    return final


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(
    d: Path, final: Path, step: int, world: int, chaos: Chaos, mesh: tuple[int, int] | None = None
) -> None:
    """Rank 0 makes a written save a checkpoint: the files and the marker on disk before the
    rename, and the rename on disk before training goes on, so that neither a kill nor a power
    cut can leave a ``step_NNNNNN`` directory whose marker names files that are not there."""
    files = {}
    for f in sorted(p for p in d.rglob("*") if p.is_file()):
        _fsync(f)
        files[str(f.relative_to(d))] = f.stat().st_size
    for sub in sorted({f.parent for f in d.rglob("*") if f.is_file()}):
        _fsync(sub)
    head = dict(step=step, world_size=world) | ({} if mesh is None else {"mesh": list(mesh)})
    marker = json.dumps(dict(**head, files=files), indent=1)
    with open(d / DONE, "w") as f:
        f.write(marker)
        f.flush()
        os.fsync(f.fileno())
    _fsync(d)
    chaos.at("commit")
    old = final.with_name(f".{final.name}.old")
    if final.exists():  # a resume from an older checkpoint saves this step again
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(d, final)
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def remove_torn(root: Path) -> list[str]:
    """Rank 0, before the run's first save: the directories killed saves left behind."""
    gone = []
    for t in torn_checkpoints(root):
        shutil.rmtree(t, ignore_errors=True)
        gone.append(t.name)
    return gone


def load_checkpoint(cfg: dict, d: Path, model, opt, engine, accelerator, device) -> dict:
    """Load what ``save_checkpoint`` wrote (``d`` a complete checkpoint, as ``find_checkpoint``
    names it) into the freshly built model and optimizer; returns this rank's trainer state."""
    mode = cfg["sharding"]["mode"]
    rank, world, saved = dist.get_rank(), dist.get_world_size(), saved_world(d)
    if engine is not None:
        path, _ = engine.load_checkpoint(str(d), tag="deepspeed")
        if path is None:
            raise FileNotFoundError(f"{d}: no DeepSpeed checkpoint (tag 'deepspeed')")
    elif accelerator is not None:
        from accelerate.utils import DistributedType

        if saved != world and accelerator.distributed_type == DistributedType.FSDP:
            raise ConfigError(
                f"checkpoint.resume {str(d)!r}: saved by {saved} processes, resumed by {world} "
                "under Accelerate's FSDP, whose load at another world size this script has "
                "not been tested with (Accelerate runs FSDP only on GPUs): resume at the saved "
                "world size, or save the run under FSDP1 or FSDP2 through torchrun"
            )
        accelerator.load_state(str(d / "accelerate"))
    elif mode == "ddp":
        ck = torch.load(d / "ddp.pt", map_location=device, weights_only=True)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
    elif saved != world and mode == "fsdp1":
        load_fsdp1_elsewhere(d / "dcp", model, opt)
    elif saved != world or moved_mesh(cfg, d, world):
        load_elsewhere(d / "dcp", model, opt)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(d / "dcp"))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    if saved == world:
        return torch.load(d / TRAINER_FILE.format(rank), weights_only=True)
    trainer = torch.load(d / TRAINER_FILE.format(0), weights_only=True)
    gen = torch.Generator().manual_seed(1000 * cfg["seed"] + 7919 * trainer["step"] + rank)
    return {**trainer, "data_rng": gen.get_state(), "world_size": world}


def moved_mesh(cfg: dict, d: Path, world: int) -> bool:
    """Whether an hsdp checkpoint was saved on another (replicate, shard) mesh than this run's
    (the same world size on other nodes): its shard groups, and so Gefen's pieces, differ."""
    if cfg["sharding"]["mode"] != "hsdp" or not (d / DONE).exists():
        return False
    saved = json.loads((d / DONE).read_text()).get("mesh")
    return saved is not None and tuple(saved) != hsdp_shape(cfg, world, local_world_size())


def saved_world(d: Path) -> int:
    """The world size that wrote checkpoint ``d`` (its marker; a legacy flat checkpoint's
    trainer file)."""
    marker = d / DONE
    if marker.exists():
        return int(json.loads(marker.read_text())["world_size"])
    return int(torch.load(d / TRAINER_FILE.format(0), weights_only=True)["world_size"])


def load_elsewhere(dcp_dir: Path, model, opt) -> None:
    """An FSDP2 checkpoint of another world size: the model through DCP, which reshards
    DTensors itself, and Gefen's state consolidated from every saved rank and re-cut for this
    rank's pieces (``gefen_dist.checkpoint``). Every rank reads the whole optimizer state once
    (0.5-1 byte per parameter)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from gefen_dist import checkpoint

    msd = get_model_state_dict(model)
    dcp.load({"model": msd}, checkpoint_id=str(dcp_dir))
    set_model_state_dict(model, msd)
    osd, _ = checkpoint.consolidate(checkpoint.read_dcp(dcp_dir, prefix="optim.")["optim"])
    checkpoint.load_optimizer(opt, model, osd)


def load_fsdp1_elsewhere(dcp_dir: Path, model, opt) -> None:
    """An FSDP1 checkpoint of another world size: the DCP directory read whole in every rank,
    then loaded as full state dicts, FSDP's ``optim_state_dict_to_load`` cutting each rank's
    flat shards and Gefen's state with them (``gefen_dist.integrations.fsdp``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    from gefen_dist import checkpoint

    tree = checkpoint.read_dcp(dcp_dir)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model.load_state_dict(tree["model"])
        osd = FSDP.optim_state_dict_to_load(model, opt, tree["optim"])
    opt.load_state_dict(osd)


def _hash_tensor(h, name: str, t: torch.Tensor) -> None:
    t = _local(t).detach().cpu().contiguous().reshape(-1)
    h.update(f"{name}:{t.dtype}:{t.numel()};".encode())
    h.update(t.view(torch.uint8).numpy().tobytes())


def digest(model, opt) -> dict:
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


def clip(cfg: dict, model, accelerator) -> None:
    limit = cfg["optimizer"]["grad_clip"]
    if limit <= 0:
        return
    if accelerator is not None:
        accelerator.clip_grad_norm_(model.parameters(), limit)
    elif cfg["sharding"]["mode"] == "fsdp1":
        model.clip_grad_norm_(limit)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), limit)


def _bar(step: int, steps: int, loss: float, t0: float) -> None:
    width = 30
    done = int(width * step / steps)
    rate = (time.perf_counter() - t0) / step
    sys.stdout.write(
        f"\r[{'#' * done}{'.' * (width - done)}] {step}/{steps}  loss {loss:.3f}  "
        f"{rate:.2f} s/step  eta {rate * (steps - step):4.0f} s"
    )
    if step == steps:
        sys.stdout.write("\n")
    sys.stdout.flush()


@torch.no_grad()
def evaluate(model, batches) -> float:
    model.eval()
    loss = sum(model(x, y)[1].item() for x, y in batches) / len(batches)
    model.train()
    return loss


def _mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def run_steps(
    cfg: dict,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    engine: object | None,
    accelerator: object | None,
    killer: Chaos,
    data: tuple,
    first: int,
    trace: loop.Trace | None,
    progress: bool,
) -> loop.Trace:
    """Steps ``first + 1 .. steps`` through the shared loop (``gefen_dist.demo.loop``), with
    this script's checkpoints and progress bar after each; ``data`` is (training tokens,
    validation batches, the batch generator, the device, the groups' base lr). A function of its
    own so that the model and optimizer it closes over are released when it returns
    (``train``'s teardown)."""
    train_data, val, gen, device, base_lr = data
    rank, world = dist.get_rank(), dist.get_world_size()
    bs, T = cfg["data"]["batch_size"], cfg["model"]["block_size"]
    ck = cfg["checkpoint"]
    save_at = (ck["save_at"] or cfg["steps"]) if ck["dir"] else None
    every = ck["every"] if ck["dir"] else 0
    t_start = time.perf_counter()

    def step(s: int) -> float:
        killer.step = s
        for g, lr in zip(opt.param_groups, base_lr, strict=True):
            g["lr"] = lr * lr_factor(cfg, s - 1)
        x, y = (t.to(device) for t in get_batch(train_data, bs, T, gen))
        killer.in_forward = True
        loss = model(x, y)[1]
        killer.in_forward = False
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            opt.zero_grad(set_to_none=True)
            accelerator.backward(loss) if accelerator is not None else loss.backward()
            clip(cfg, model, accelerator)
            opt.step()
        return loss.item()

    def after(s: int, trace: loop.Trace) -> None:
        if s == save_at or (every and s % every == 0):
            trainer = dict(step=s, data_rng=gen.get_state(), window=trace.window,
                           curve=trace.curve, config=cfg, world_size=world)  # fmt: skip
            save_checkpoint(cfg, Path(ck["dir"]), s, model, opt, engine, accelerator,
                            trainer, killer)  # fmt: skip
        if rank == 0 and progress:
            last = trace.window[-1] if trace.window else trace.curve[-1]["train_loss"]
            _bar(s - first, cfg["steps"] - first, last, t_start)

    trace = loop.train(
        step,
        cfg["steps"],
        lambda: dict(val_loss=_mean(evaluate(model, val))),
        lambda s: s % cfg["eval_every"] == 0 or s == cfg["steps"],
        trace=trace,
        first=first,
        after=after,
        mean=lambda w: _mean(sum(w) / len(w)),
    )
    return trace


def train(
    cfg: dict,
    out: str | None = None,
    progress: bool = True,
    with_digest: bool = False,
    chaos: tuple[int, int, str] | None = None,
) -> dict | None:
    """Train under the configured sharding; rank 0 returns (and writes to ``out``) the results.
    ``chaos`` is the parsed ``GEFEN_CHAOS_KILL`` test hook (module docstring)."""
    torch.set_num_threads(1)
    m, d = cfg["model"], cfg["data"]
    mcfg = GPTConfig(
        block_size=m["block_size"], n_layer=m["n_layer"], n_head=m["n_head"], n_embd=m["n_embd"]
    )
    torch.manual_seed(cfg["seed"])
    device = rank_device(cfg)
    model, opt, engine, accelerator = setup(cfg, GPT(mcfg), device)
    if engine is not None:
        device = engine.device
    elif accelerator is not None:
        device = accelerator.device
    rank, world = dist.get_rank(), dist.get_world_size()
    killer = Chaos(chaos, rank)
    killer.install(model, opt)
    train_data, val_data = load_corpus(max_bytes=d["max_bytes"])
    bs, T = d["batch_size"], m["block_size"]
    g_val = torch.Generator().manual_seed(10_000 + cfg["seed"])
    val = [
        tuple(t.to(device) for t in get_batch(val_data, bs, T, g_val))
        for _ in range(d["val_batches"])
    ]
    gen = torch.Generator().manual_seed(1000 * cfg["seed"] + rank)
    base_lr = [g["lr"] for g in opt.param_groups]  # the schedule's base, before a resume's
    ck = cfg["checkpoint"]
    first = 0
    trace = None
    if ck["dir"] and rank == 0:
        gone = remove_torn(Path(ck["dir"]))
        if gone:
            print(f"removed torn checkpoints in {ck['dir']}: {', '.join(gone)}", flush=True)
    if ck["resume"]:
        src = find_checkpoint(ck["resume"])
        if src is None:  # checked in main(); here for a caller of train() itself
            raise ConfigError(f"checkpoint.resume {ck['resume']!r}: no complete checkpoint")
        trainer = load_checkpoint(cfg, src, model, opt, engine, accelerator, device)
        first = trainer["step"]
        trace = loop.Trace(curve=trainer["curve"], window=trainer["window"])
        gen.set_state(trainer["data_rng"])
        if rank == 0:
            print(f"resuming at step {first} from {src}", flush=True)

    t_start = time.perf_counter()
    trace = run_steps(
        cfg,
        model,
        opt,
        engine,
        accelerator,
        killer,
        (train_data, val, gen, device, base_lr),
        first,
        trace,
        progress,
    )
    wall = time.perf_counter() - t_start
    curve, times = trace.curve, [ms / 1000 for ms in trace.step_ms]
    ran = what_ran(cfg, opt, engine, accelerator, device)
    held, n = state_bytes(opt)
    mine = torch.tensor(
        [
            held,
            n,
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            statistics.median(times) if times else 0.0,  # none: resumed at the last step
        ],
        dtype=torch.float64,
        device=comm_device(),
    )
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    digests = None
    if with_digest:
        digests = [None] * world
        dist.all_gather_object(digests, dict(rank=rank, **digest(model, opt)))
    result = None
    if rank == 0:
        ranks = [
            dict(
                rank=r,
                state_bytes=int(t[0]),
                state_params=int(t[1]),
                adamw_bytes=8 * int(t[1]),
                peak_rss_bytes=int(t[2]),
                step_time_median_s=float(t[3]),
            )
            for r, t in enumerate(gathered)
        ]
        result = dict(
            config=cfg,
            ran=ran,
            world_size=world,
            resumed_from_step=first,
            n_params=sum(p.numel() for p in GPT(mcfg).parameters()),
            curve=curve,
            final_train_loss=curve[-1]["train_loss"],
            final_val_loss=curve[-1]["val_loss"],
            final_lr=stepped(opt).param_groups[0]["lr"],
            wall_time_s=wall,
            ranks=ranks,
            torch_version=torch.__version__,
        )
        if digests is not None:
            result["digest"] = digests
        if out:
            Path(out).write_text(json.dumps(result, indent=1))
        name, mode = cfg["optimizer"]["name"], cfg["sharding"]["mode"]
        print(
            f"{name} under {mode}, ran {_ran_label(ran)}, {world} ranks"
            + (f", resumed at step {first}" if first else "")
            + f": final val loss {curve[-1]['val_loss']:.4f}"
        )
        for r in ranks:
            ratio = r["state_bytes"] / r["adamw_bytes"] if r["adamw_bytes"] else 0.0
            print(
                f"  rank {r['rank']}: optimizer state {r['state_bytes']:>10} B "
                f"(AdamW would keep {r['adamw_bytes']:>10} B: {ratio:.3f}x)"
            )
    # Every path ends by destroying its process group after a barrier: a rank that exits with
    # gloo's threads still live can abort in teardown ("terminate called without an active
    # exception"), as one accelerate rank and later one DeepSpeed rank did in CI.
    # DDP's C++ Reducer holds the group as well and keeps the GIL in its destructor: freed after
    # the group was destroyed (as this frame returned), it joined a gloo thread waiting for the
    # GIL and the rank hung (twice in accelerate runs). Freed here, while the group is still
    # registered, it leaves the last reference to the group object, which releases the GIL.
    del model, opt, engine
    if accelerator is not None:
        accelerator.free_memory()
    gc.collect()
    if accelerator is not None:
        accelerator.wait_for_everyone()
        accelerator.end_training()
    else:
        dist.barrier()
        dist.destroy_process_group()
    return result


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
