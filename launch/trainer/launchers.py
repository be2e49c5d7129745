"""One setup per sharding mode: the process group (or the framework that starts it), the wrapped
model and the optimizer, each written to its launcher's conventions (torchrun's, DeepSpeed's,
Accelerate's), and what each actually ran.

Kept apart from the loop and the checkpoint so that adding or changing a launcher touches one
function here, and the rest of the script sees only ``Wrapped``: which of DeepSpeed's engine or
Accelerate's accelerator (or neither) drives the step is a field, not a position in a tuple.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gefen_dist import Gefen
from gefen_dist.demo.model import Block

from .config import ConfigError, hsdp_shape, local_world_size
from .optimizer import build_optimizer, stepped

if TYPE_CHECKING:
    from accelerate import Accelerator
    from deepspeed import DeepSpeedEngine

LAUNCHERS = {
    "ddp": "torchrun --nproc_per_node 2",
    "fsdp1": "torchrun --nproc_per_node 2",
    "fsdp2": "torchrun --nproc_per_node 2",
    "hsdp": "torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint HOST:29500",
    "deepspeed": "deepspeed --num_gpus 2",
    "accelerate": "accelerate launch --multi_gpu --num_processes 2",
}
"""The command each sharding mode is started with, as the error for a bare start prints it."""


class LauncherError(RuntimeError):
    """The script was started without the launcher its sharding mode needs."""


@dataclass
class Wrapped:
    """A rank's model and optimizer as its launcher set them up. Under DeepSpeed ``model`` is
    the engine, which also steps (``engine`` is set); under Accelerate ``accelerator`` runs the
    backward, the clipping and the saves; ``device`` is where the batches go."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    device: torch.device
    engine: DeepSpeedEngine | None = None
    accelerator: Accelerator | None = None


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


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def setup(cfg: dict, model: torch.nn.Module, device: torch.device) -> Wrapped:
    """Wrap the model for the configured sharding on ``device``."""
    return SETUPS[cfg["sharding"]["mode"]](cfg, model, device)


def setup_deepspeed(cfg: dict, model: torch.nn.Module, device: torch.device) -> Wrapped:
    """``deepspeed.initialize`` with the run's batch size, clipping and ZeRO stage, and the
    optimizer built here (``gefen_dist.integrations.deepspeed`` maps Gefen's ZeRO partitions)."""
    import deepspeed

    import gefen_dist.integrations.deepspeed  # noqa: F401  registers Gefen with ZeRO, maps its partitions

    deepspeed.init_distributed(dist_backend=_backend(device))
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg["data"]["batch_size"],
        "gradient_clipping": cfg["optimizer"]["grad_clip"],
        "zero_optimization": {"stage": cfg["sharding"]["zero_stage"]},
    }
    opt = build_optimizer(cfg, model.parameters())
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    return Wrapped(model=engine, opt=opt, device=engine.device, engine=engine)


def setup_accelerate(cfg: dict, model: torch.nn.Module, device: torch.device) -> Wrapped:
    """``Accelerator.prepare`` under whatever ``accelerate launch`` (or its environment) asks:
    DDP, FSDP, or DeepSpeed, whose config may build the optimizer itself."""
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
    return Wrapped(model=model, opt=opt, device=accelerator.device, accelerator=accelerator)


def _torchrun_group(model: torch.nn.Module, device: torch.device) -> None:
    """The process group torchrun's environment describes, and the model on the rank's device."""
    dist.init_process_group(_backend(device))
    model.to(device)


def setup_ddp(cfg: dict, model: torch.nn.Module, device: torch.device) -> Wrapped:
    _torchrun_group(model, device)
    ids = [device.index] if device.type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    opt = build_optimizer(cfg, model.parameters())
    return Wrapped(model=model, opt=opt, device=device)


def setup_fsdp1(cfg: dict, model: torch.nn.Module, device: torch.device) -> Wrapped:
    """FSDP1 with one unit per transformer block; Gefen learns the flat shards' original tensors
    from ``gefen_dist.integrations.fsdp``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import gefen_dist.integrations.fsdp

    _torchrun_group(model, device)
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device)
    opt = build_optimizer(cfg, model.parameters())
    if isinstance(opt, Gefen):
        gefen_dist.integrations.fsdp.configure(model, opt)  # flat shards -> original tensors
    return Wrapped(model=model, opt=opt, device=device)


def setup_fsdp2(cfg: dict, model: torch.nn.Module, device: torch.device) -> Wrapped:
    """``fully_shard`` per block and at the root, on a 1-D mesh (fsdp2) or on hsdp's 2-D
    (replicate, shard) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _torchrun_group(model, device)
    # the mesh on the rank's device: FSDP2's default takes a GPU wherever there is one
    world = dist.get_world_size()
    if cfg["sharding"]["mode"] == "hsdp":
        shape = hsdp_shape(cfg, world, local_world_size())
        mesh = init_device_mesh(device.type, tuple(shape), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = build_optimizer(cfg, model.parameters())
    return Wrapped(model=model, opt=opt, device=device)


SETUPS: dict[str, Callable[[dict, torch.nn.Module, torch.device], Wrapped]] = {
    "ddp": setup_ddp,
    "fsdp1": setup_fsdp1,
    "fsdp2": setup_fsdp2,
    "hsdp": setup_fsdp2,
    "deepspeed": setup_deepspeed,
    "accelerate": setup_accelerate,
}
"""The setup of each ``sharding.mode``."""


def _prepare_accelerate_deepspeed(
    cfg: dict, accelerator: Accelerator, model: torch.nn.Module
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
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


def _warn_accelerate_fallback(accelerator: Accelerator) -> None:
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


def what_ran(cfg: dict, run: Wrapped) -> dict:
    """What the launcher and framework actually ran, which can differ from what was asked: the
    results JSON's ``ran``."""
    ran = dict(
        mode=cfg["sharding"]["mode"],
        device=str(run.device),
        backend=str(dist.get_backend()),
        distributed_type=cfg["sharding"]["mode"].upper(),
        optimizer=type(stepped(run.opt)).__name__,
    )
    if cfg["sharding"]["mode"] == "hsdp":
        ran["mesh"] = list(hsdp_shape(cfg, dist.get_world_size(), local_world_size()))
    if run.engine is not None:
        ran.update(distributed_type="DEEPSPEED", zero_stage=run.engine.zero_optimization_stage(),
                   gradient_clipping=run.engine.gradient_clipping())  # fmt: skip
    elif run.accelerator is not None:
        from accelerate.utils import DistributedType

        accelerator = run.accelerator
        ran["distributed_type"] = accelerator.distributed_type.value
        if accelerator.distributed_type == DistributedType.FSDP:
            ran["fsdp_version"] = 2 if accelerator.is_fsdp2 else 1
        elif accelerator.distributed_type == DistributedType.DEEPSPEED:
            ds = accelerator.deepspeed_engine_wrapped.engine
            ran.update(zero_stage=ds.zero_optimization_stage(),
                       gradient_clipping=ds.gradient_clipping())  # fmt: skip
    return ran
