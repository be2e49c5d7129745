"""A small GPT on the Python stdlib source, trained with Gefen under a distributed framework.

The README's distributed examples; each runs on 2 CPU ranks (gloo) here and on GPUs unchanged::

    torchrun --nproc_per_node 2 launch/dist_train.py --mode ddp
    torchrun --nproc_per_node 2 launch/dist_train.py --mode fsdp1        # flat parameters
    torchrun --nproc_per_node 2 launch/dist_train.py --mode fsdp2        # fully_shard
    deepspeed --num_gpus 2 launch/dist_train.py --mode deepspeed --zero 2
    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 launch/dist_train.py --mode accelerate

Rank 0 prints the loss every few steps and, at the end, every rank's optimizer-state bytes next
to what AdamW would keep under the same sharding. ``--optimizer adamw`` runs AdamW instead.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from gefen_dist import Gefen
from gefen_dist.corpus import get_batch, load_corpus
from gefen_dist.model import GPT, Block, GPTConfig


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["ddp", "fsdp1", "fsdp2", "deepspeed", "accelerate"])
    ap.add_argument("--optimizer", choices=["gefen", "adamw"], default="gefen")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--zero", type=int, default=2, help="DeepSpeed ZeRO stage")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--json", help="rank 0 writes the per-rank memory table here")
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args()


def build_optimizer(args, params):
    if args.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1)
    return Gefen(params, lr=args.lr, weight_decay=0.1, bits=args.bits)


def state_bytes(opt) -> tuple[int, int]:
    """(optimizer-state bytes, AdamW's for the same local elements) on this rank."""
    while hasattr(opt, "optimizer"):  # DeepSpeed's and Accelerate's wrappers
        opt = opt.optimizer
    if isinstance(opt, Gefen):
        rep = opt.memory_report()
        return rep["state_bytes"], rep["adamw_bytes"]

    def _local(t):  # a DTensor's (FSDP2) numel() is the whole tensor's
        return t.to_local() if hasattr(t, "to_local") else t

    local = sum(_local(p).numel() for p in opt.state)
    held = sum(
        _local(v).numel() * v.element_size()
        for st in opt.state.values()
        for k, v in st.items()
        if torch.is_tensor(v) and k != "step"
    )
    return held, 8 * local


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    cfg = GPTConfig(block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    torch.manual_seed(0)
    model = GPT(cfg)
    engine = accelerator = None
    if args.mode == "deepspeed":
        import deepspeed

        import gefen_dist.deepspeed  # noqa: F401  maps ZeRO partitions for Gefen

        deepspeed.init_distributed(dist_backend="gloo")
        ds_config = {
            "train_micro_batch_size_per_gpu": args.batch_size,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": args.zero},
        }
        opt = build_optimizer(args, model.parameters())
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        model = engine
    elif args.mode == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator()
        opt = build_optimizer(args, model.parameters())
        model, opt = accelerator.prepare(model, opt)
    else:
        dist.init_process_group("gloo")
        if args.mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
            opt = build_optimizer(args, model.parameters())
        elif args.mode == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            import gefen_dist.fsdp

            model = FSDP(
                model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu")
            )
            opt = build_optimizer(args, model.parameters())
            if args.optimizer == "gefen":
                gefen_dist.fsdp.configure(model, opt)  # flat shards -> original tensors
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.transformer.h:
                fully_shard(block)
            fully_shard(model)
            opt = build_optimizer(args, model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    train, _ = load_corpus(max_bytes=2 * 2**20)
    gen = torch.Generator().manual_seed(1 + rank)
    for step in range(args.steps):
        x, y = get_batch(train, args.batch_size, cfg.block_size, gen)
        loss = model(x, y)[1]
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            opt.zero_grad()
            accelerator.backward(loss) if accelerator is not None else loss.backward()
            opt.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    mine = torch.tensor(state_bytes(opt), dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        rows = [
            dict(rank=r, state_bytes=int(t[0]), adamw_bytes=int(t[1])) for r, t in enumerate(every)
        ]
        print(f"{args.mode} ({args.optimizer}, {world} ranks): optimizer state per rank")
        for r in rows:
            ratio = r["state_bytes"] / r["adamw_bytes"] if r["adamw_bytes"] else 0.0
            print(
                f"  rank {r['rank']}: {r['state_bytes']:>10} B  (AdamW {r['adamw_bytes']:>10} B,"
                f" {ratio:.3f}x)"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    dict(
                        mode=args.mode, optimizer=args.optimizer, ranks=rows, final_loss=loss.item()
                    ),
                    f,
                )
    dist.barrier()
    if dist.is_initialized() and engine is None and accelerator is None:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
