"""Gefen under the Hugging Face Trainer on 2 CPU ranks: from a DeepSpeed JSON, or as an object.

Run by tests/test_registration.py under torchrun: ``reg_hf.py PHASE OUT CKPT MODE [OUT CKPT
MODE ...]``, PHASE ``train`` or ``resume``, each (OUT, CKPT, MODE) a job run in turn, MODE ``ds``
or ``object``, Accelerate's process-wide state reset before each (what a new process would start
from; the process group stays). ``ds`` passes ``deepspeed=configs/ds_zero2_auto_cpu.json``
(the optimizer is the JSON's Gefen; the Trainer fills its "auto" values); ``object`` passes
``optimizers=(Gefen(...), None)`` under DDP. A tiny GPT-2 is built from a config (no download).
Trains 6 steps saving at 3, then a second Trainer resumes from
checkpoint-3 in a second launch (Accelerate allows one DeepSpeed Accelerator per process): its
losses and final weights must equal the first run's. Writes OUT/rank{r}.json.
"""

import gc
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.state import AcceleratorState
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import gefen_dist
from gefen_dist import Gefen
from teardown import finish

torch.set_num_threads(1)
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randint(0, 256, (64, 16), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def run(out_dir, ckpt, mode, resume):
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=16)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0  # the two modes see the same run
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(
        output_dir=str(ckpt),
        max_steps=6,
        save_steps=3,
        save_strategy="steps",
        logging_steps=1,
        per_device_train_batch_size=2,
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
        opts = (Gefen(model.parameters(), lr=3e-3, weight_decay=0.1), None)
    trainer = Trainer(model=model, args=args, train_dataset=Data(), optimizers=opts)
    trainer.train(resume_from_checkpoint=str(ckpt / "checkpoint-3") if resume else None)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    inner = trainer.optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    if mode == "ds":
        inner = trainer.model_wrapped.basic_optimizer
    weights = {
        n: hashlib.sha256(p.detach().cpu().numpy().tobytes()).hexdigest()
        for n, p in trainer.model.named_parameters()
    }
    info = {
        "basic": type(inner).__name__,
        "wrapped": type(trainer.model_wrapped).__name__,
        "world_size": trainer.accelerator.num_processes,
    }
    return losses, weights, info


def job(out_dir: Path, ckpt: Path, mode: str, phase: str) -> None:
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    AcceleratorState._reset_state(reset_partial_state=True)
    if mode == "ds":
        # Without a GPU, the Trainer's DeepSpeed set-up passes Accelerate no backend and every rank
        # becomes rank 0 of 1 (an unsharded DataLoader): configure the state on gloo first.
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
    losses, weights, info = run(out_dir, ckpt, mode, resume=phase == "resume")
    rank = int(os.environ["RANK"])
    out = {"rank": rank, **info, "losses": losses, "weights": weights}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))


def main():
    phase, *jobs = sys.argv[1:]
    gefen_dist.register()
    for i in range(0, len(jobs), 3):
        out_dir, ckpt, mode = jobs[i : i + 3]
        job(Path(out_dir), Path(ckpt), mode, phase)
        gc.collect()  # the job's Trainer, model and engine, before the next job builds its own
        dist.barrier()


if __name__ == "__main__":
    main()
    finish()
