"""Saving and resuming a run through each framework's own path, at the same world size or
another.

A save writes the framework's part (DDP: one ``torch.save`` by rank 0; FSDP1, FSDP2 and HSDP:
torch.distributed.checkpoint; DeepSpeed: ``engine.save_checkpoint``; Accelerate:
``save_state``) and every rank's trainer file (``TrainerState``) into a directory that
``checkpoint_dir.commit`` then makes a checkpoint. A load at the saved world size continues with
the same losses as a run never stopped. At another world size (every mode, ``ELASTIC``), or on
another HSDP mesh, the framework's own load re-cuts Gefen's state where it can (DeepSpeed's
``engine.load_checkpoint``, Accelerate's ``load_state``), and FSDP1, FSDP2 and HSDP read their
DCP checkpoint whole (``gefen_dist.checkpoint.read_dcp``); each rank then keeps the step, the
curve and the schedule, and draws its batches from a generator seeded by the seed, the step and
its new rank, since the old ranks' streams do not map onto new ones.

Apart from the directory's layout (``checkpoint_dir``: files only) because everything here
needs the process group and the wrapped model, and apart from the loop, which only says when.
"""

from __future__ import annotations

import io
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint_dir import (
    STEP_DIR,
    TRAINER_FILE,
    commit,
    find_checkpoint,
    read_marker,
)
from .config import ConfigError, flatten, hsdp_shape, local_world_size
from .faults import Chaos
from .launchers import Wrapped

ELASTIC = ("ddp", "fsdp1", "fsdp2", "hsdp", "deepspeed", "accelerate")
"""Sharding modes whose checkpoints resume at another world size (module docstring)."""


@dataclass
class TrainerState:
    """What a rank saves besides the model and optimizer, to continue the run: the ``step``
    saved after, the state of its batch generator, the training losses since the last curve
    point, the curve, the run's config and the world size that saved it."""

    step: int
    data_rng: torch.Tensor
    window: list[float]
    curve: list[dict]
    config: dict
    world_size: int

    def to_dict(self) -> dict:
        """The trainer file's content (plain types, for ``torch.load(weights_only=True)``)."""
        return dict(step=self.step, data_rng=self.data_rng, window=self.window,
                    curve=self.curve, config=self.config, world_size=self.world_size)  # fmt: skip

    @classmethod
    def from_dict(cls, saved: dict) -> TrainerState:
        return cls(step=saved["step"], data_rng=saved["data_rng"], window=saved["window"],
                   curve=saved["curve"], config=saved["config"],
                   world_size=saved["world_size"])  # fmt: skip


def _saved_trainer(d: Path, rank: int) -> dict:
    return torch.load(d / TRAINER_FILE.format(rank), weights_only=True)


def save_checkpoint(
    cfg: dict,
    root: Path,
    step: int,
    run: Wrapped,
    trainer: TrainerState,
    chaos: Chaos | None = None,
) -> Path:
    """Each framework's own checkpoint and every rank's trainer file, in a directory that takes
    its final name (``step_NNNNNN``) only once all of it is on disk: a rank killed at any point
    leaves a ``.step_NNNNNN.tmp`` that no resume takes (``checkpoint_dir``)."""
    chaos = chaos or Chaos(None, 0)
    mode = cfg["sharding"]["mode"]
    rank = dist.get_rank()
    final = root / STEP_DIR.format(step)
    d = root / f".{final.name}.tmp"
    if rank == 0:  # a torn save of this step by an earlier, killed run
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    dist.barrier()
    if run.engine is not None:
        # DeepSpeed's own "latest" file lands in d too: renamed with the rest or never seen,
        # and the load names its tag rather than reading it
        run.engine.save_checkpoint(str(d), tag="deepspeed")
    elif run.accelerator is not None:
        run.accelerator.save_state(str(d / "accelerate"))
    elif mode == "ddp":
        if rank == 0:
            state = {"model": run.model.module.state_dict(), "optim": run.opt.state_dict()}
            torch.save(state, d / "ddp.pt")
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(run.model, run.opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d / "dcp"))
    buf = io.BytesIO()
    torch.save(trainer.to_dict(), buf)
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
        commit(d, final, step, world, chaos, mesh)
    else:
        chaos.at("commit")
    dist.barrier()
    return final


def load_checkpoint(cfg: dict, d: Path, run: Wrapped) -> TrainerState:
    """Load what ``save_checkpoint`` wrote (``d`` a complete checkpoint, as ``find_checkpoint``
    names it) into the freshly built model and optimizer; returns this rank's trainer state."""
    mode = cfg["sharding"]["mode"]
    rank, world, saved = dist.get_rank(), dist.get_world_size(), saved_world(d)
    model, opt = run.model, run.opt
    if run.engine is not None:
        path, _ = run.engine.load_checkpoint(str(d), tag="deepspeed")
        if path is None:
            raise FileNotFoundError(f"{d}: no DeepSpeed checkpoint (tag 'deepspeed')")
    elif run.accelerator is not None:
        from accelerate.utils import DistributedType

        if saved != world and run.accelerator.distributed_type == DistributedType.FSDP:
            raise ConfigError(
                f"checkpoint.resume {str(d)!r}: saved by {saved} processes, resumed by {world} "
                "under Accelerate's FSDP, whose load at another world size this script has "
                "not been tested with (Accelerate runs FSDP only on GPUs): resume at the saved "
                "world size, or save the run under FSDP1 or FSDP2 through torchrun"
            )
        run.accelerator.load_state(str(d / "accelerate"))
    elif mode == "ddp":
        ck = torch.load(d / "ddp.pt", map_location=run.device, weights_only=True)
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
        return TrainerState.from_dict(_saved_trainer(d, rank))
    trainer = TrainerState.from_dict(_saved_trainer(d, 0))
    gen = torch.Generator().manual_seed(1000 * cfg["seed"] + 7919 * trainer.step + rank)
    trainer.data_rng, trainer.world_size = gen.get_state(), world
    return trainer


def moved_mesh(cfg: dict, d: Path, world: int) -> bool:
    """Whether an hsdp checkpoint was saved on another (replicate, shard) mesh than this run's
    (the same world size on other nodes): its shard groups, and so Gefen's pieces, differ."""
    if cfg["sharding"]["mode"] != "hsdp":
        return False
    marker = read_marker(d)
    if marker is None or marker.mesh is None:
        return False
    return tuple(marker.mesh) != hsdp_shape(cfg, world, local_world_size())


def saved_world(d: Path) -> int:
    """The world size that wrote checkpoint ``d`` (its marker; a legacy flat checkpoint's
    trainer file)."""
    marker = read_marker(d)
    if marker is not None:
        return marker.world_size
    return int(_saved_trainer(d, 0)["world_size"])


def load_elsewhere(dcp_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """An FSDP2 or HSDP checkpoint of another world size or mesh. Gefen's state of DTensor
    parameters is in global coordinates (``gefen_dist.integrations.dcp``), which DCP's own load
    reshards: each rank reads its new piece and the saved block values around it. A checkpoint
    that holds per-rank entries (one saved before the format changed: docs/history.md) is
    consolidated from every saved rank and re-cut for this
    rank's pieces (``gefen_dist.checkpoint``): every rank reads the whole optimizer state once."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    from gefen_dist import checkpoint

    keys = FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    if not any(".gefen.rank" in k for k in keys):
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(dcp_dir))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        return
    msd = get_model_state_dict(model)
    dcp.load({"model": msd}, checkpoint_id=str(dcp_dir))
    set_model_state_dict(model, msd)
    osd, _ = checkpoint.consolidate(checkpoint.read_dcp(dcp_dir, prefix="optim.")["optim"])
    checkpoint.load_optimizer(opt, model, osd)


def load_fsdp1_elsewhere(dcp_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
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


def check_resume(cfg: dict) -> None:
    """A resumed run must repeat the saved run's settings: any other model, data or schedule
    would not continue the same run, and would fail later and less clearly. Another world size
    is refused only where the mode's checkpoints cannot be re-cut (not in ``ELASTIC``)."""
    d = find_checkpoint(cfg["checkpoint"]["resume"])
    saved = _saved_trainer(d, 0)
    old, new = flatten(saved["config"]), flatten(cfg)
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
