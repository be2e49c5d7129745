"""The Hugging Face Trainer's ``resume_from_checkpoint`` at another number of processes.

Run by tests/test_accelerate_elastic.py under torchrun: ``accel_elastic_hf.py JOBS``, JOBS a
JSON file of ``[OUT, CKPT, ds|object, train|resume]`` lists run in turn, Accelerate's
process-wide state reset before each (what a new process would start from; the process group
stays; one launch's start-up for several jobs). ``ds``:
``deepspeed=configs/ds_zero2_auto_cpu.json`` (Gefen from the JSON); ``object``:
``optimizers=(Gefen(...), None)`` under DDP. A tiny GPT-2 built from a config (no download),
STEPS steps over the same global batches of 4 sequences at any number of processes
(a sequential sampler and a per-device batch of 4 / processes: Accelerate's sharding hands
process r its slice of each global batch), a checkpoint every SAVE_AT steps; ``resume``
continues from checkpoint-SAVE_AT. Writes OUT/rank{r}.json with the logged per-step losses
(the Trainer's mean over processes) and Gefen's step count at the end.
"""

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.state import AcceleratorState
from torch.utils.data import SequentialSampler
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import gefen_dist
from gefen_dist import Gefen
from teardown import finish

torch.set_num_threads(1)
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STEPS, SAVE_AT, GLOBAL_BATCH = 30, 10, 4


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randint(0, 256, (GLOBAL_BATCH * STEPS, 16), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class InOrder(Trainer):
    """The same global batches at every number of processes: no shuffling."""

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


def run(ckpt: Path, mode: str, resume: bool, world: int) -> tuple[dict, dict]:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=16)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(
        output_dir=str(ckpt),
        max_steps=STEPS,
        save_steps=SAVE_AT,
        save_strategy="steps",
        logging_steps=1,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        learning_rate=3e-3,
        weight_decay=0.1,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        report_to=[],
        ddp_backend="gloo",
        use_cpu=mode == "object",
        deepspeed=str(CONFIGS / "ds_zero2_auto_cpu.json") if mode == "ds" else None,
        seed=0,
        data_seed=0,
        accelerator_config={"use_configured_state": mode == "ds"},
    )
    opts = (None, None)
    if mode == "object":
        opts = (Gefen(model.parameters(), lr=3e-3, weight_decay=0.1, bits=4), None)
    trainer = InOrder(model=model, args=args, train_dataset=Data(), optimizers=opts)
    trainer.train(resume_from_checkpoint=str(ckpt / f"checkpoint-{SAVE_AT}") if resume else None)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    inner = trainer.model_wrapped.basic_optimizer if mode == "ds" else trainer.optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    info = {"basic": type(inner).__name__, "world": trainer.accelerator.num_processes}
    # Gefen's own step count: STEPS where its state came back with the checkpoint's count
    info["gefen_steps"] = sorted({float(st["step"]) for st in inner.state.values() if st})
    return losses, info


def job(out_dir: Path, ckpt: Path, mode: str, phase: str) -> None:
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    AcceleratorState._reset_state(reset_partial_state=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if mode == "ds":
        # The Trainer's DeepSpeed set-up on CPU needs the state on gloo first (reg_hf.py).
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
    losses, info = run(ckpt, mode, phase == "resume", world)
    rank = int(os.environ["RANK"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **info, "losses": losses}))


def main() -> None:
    gefen_dist.register()
    for out_dir, ckpt, mode, phase in json.loads(Path(sys.argv[1]).read_text()):
        job(Path(out_dir), Path(ckpt), mode, phase)
        gc.collect()  # the job's Trainer, model and engine, before the next job builds its own
        if dist.is_initialized():
            dist.barrier()


if __name__ == "__main__":
    main()
    finish()
