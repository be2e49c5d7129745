"""gru_wide at 3x: what the first steps of warmup do to the runs that stall (issue 43).

Why: at lr 0.03 some seeds of gru_wide stall between steps 50 and 200 under Gefen while AdamW
trains on, and per-element state from step 1 recovers them where per-element state switched on
at step ~20 does not. This trains one seed with one optimizer for the first ``--switch`` steps
and another after (``--first``, ``--then``; the second is built fresh at the switch, as a user's
restart would build it), and logs every ``--every`` steps per tensor: the weight's RMS, the
step's RMS over lr, the gradient norm before the clip, and the spectral norm of each gate's
block of the recurrent matrix.

    OMP_NUM_THREADS=1 PYTHONPATH=. python research/gru_warmup.py --seed 1 --first gefen8 \
        --switch 20 --then adamw --out research/results/gru_warmup.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from dataclasses import replace

import torch

from gefen_dist.bench import peers, tasks


def _rev() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def _build(
    name: str, model: torch.nn.Module, h: tasks.Hyper, info: dict, adamw_on: str = "", only=""
):
    """The optimizers of one step: ``name`` over every tensor but those whose name holds one of
    ``adamw_on``'s comma-separated parts, which AdamW steps; with ``only``, ``name`` over those
    tensors alone (fresh state: the switch of ``--adamw-until``)."""
    kw = dict(betas=h.betas, weight_decay=h.weight_decay, **info)
    parts = [x for x in (adamw_on or only).split(",") if x]
    mine = [p for n, p in model.named_parameters() if not any(x in n for x in parts)]
    other = [p for n, p in model.named_parameters() if any(x in n for x in parts)]
    if only:
        return [peers.build(name, model, h.lr, params=other, **kw)]
    opts = [peers.build(name, model, h.lr, params=mine, **kw)]
    if other:
        opts.append(peers.build("adamw", model, h.lr, params=other, **kw))
    return opts


def _gates(w: torch.Tensor, n: int) -> list[float]:
    rows = w.shape[0] // n
    return [torch.linalg.matrix_norm(w[i * rows : (i + 1) * rows], ord=2).item() for i in range(n)]


def jitter(model: torch.nn.Module, seed: int, rel: float = 1e-6) -> None:
    """Every weight times (1 + rel * N(0, 1)), drawn from its own generator: a perturbation of
    the size a different CPU's rounding makes, to tell a seed's property from chaos."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + rel * torch.randn(p.shape, generator=g))


def run(
    task: str,
    lr: float,
    seed: int,
    first: str,
    switch: int,
    then: str,
    every: int,
    jit: int = -1,
    adamw_on: str = "",
    adamw_until: int = 0,
) -> dict:
    torch.set_num_threads(1)
    t = tasks.TASKS[task]
    t = replace(t, hyper=replace(t.hyper, lr=lr))
    h = t.hyper
    inst = tasks.build(t, seed)
    model = inst.model
    if jit >= 0:
        jitter(model, jit)
    names = dict(model.named_parameters())
    opts = _build(first, model, h, inst.model_info, adamw_on)
    gates = 3 if t.sizes["cell"] == "gru" else 4
    log, curve = [], []
    for s in range(1, h.steps + 1):
        if s == switch + 1 and then:
            opts = _build(then, model, h, inst.model_info, adamw_on)
        if s == adamw_until + 1 and adamw_until:
            opts = opts[:1] + _build(first, model, h, inst.model_info, only=adamw_on)
        for opt in opts:
            peers.set_lr(opt, tasks.lr_factor(s - 1, h))
        watch = s % every == 0 or s <= 5
        before = {k: p.detach().clone() for k, p in names.items()} if watch else None
        loss = inst.loss(model, next(inst.batches))
        model.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), h.grad_clip).item()
        for opt in opts:
            opt.step()
        if watch:
            cur_lr = h.lr * tasks.lr_factor(s - 1, h)
            row = dict(step=s, loss=loss.item(), gnorm=gnorm, lr=cur_lr, tensors={})
            for k, p in names.items():
                d = (p.detach() - before[k]).float()
                row["tensors"][k] = dict(
                    w_rms=p.detach().float().pow(2).mean().sqrt().item(),
                    upd_rms=d.pow(2).mean().sqrt().item() / cur_lr,
                    upd_max=d.abs().max().item() / cur_lr,
                )
                if k.startswith("rnn.weight_hh"):
                    row["tensors"][k]["gate_norms"] = _gates(p.detach().float(), gates)
            log.append(row)
        if s % 25 == 0:
            curve.append(dict(step=s, **inst.evaluate(model)))
    return dict(curve=curve, final=curve[-1], log=log)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="gru_wide")
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--first", required=True, help="optimizer for steps 1..switch")
    ap.add_argument("--switch", type=int, default=0)
    ap.add_argument("--then", default="", help="optimizer after the switch (fresh state)")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--jitter", type=int, default=-1, help="perturb the init (generator seed)")
    ap.add_argument("--adamw-on", default="", help="tensors (name parts) AdamW steps instead")
    ap.add_argument(
        "--adamw-until", type=int, default=0, help="with --adamw-on: AdamW's last step there"
    )
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    t0 = time.time()
    body = run(
        a.task,
        a.lr,
        a.seed,
        a.first,
        a.switch,
        a.then,
        a.every,
        a.jitter,
        a.adamw_on,
        a.adamw_until,
    )
    name = a.first + (f">{a.switch}>{a.then}" if a.then else "")
    name += f"~{a.jitter}" if a.jitter >= 0 else ""
    name += f"-adamw:{a.adamw_on}" if a.adamw_on else ""
    name += f"<={a.adamw_until}" if a.adamw_until else ""
    rec = dict(
        key=f"{a.task}|{a.lr}|{name}|{a.seed}",
        task=a.task,
        lr=a.lr,
        optimizer=name,
        seed=a.seed,
        **body,
        seconds=time.time() - t0,
        rev=_rev(),
        machine=platform.processor() or platform.machine(),
    )
    with open(a.out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(rec["key"], rec["final"])


if __name__ == "__main__":
    main()
