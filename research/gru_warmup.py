"""gru_wide at 3x: is a bad seed a property of the seed, which tensor's state does it, and when
(issue 43; ``research/results/gru_warmup.md``).

Why: at lr 0.03 some seeds of gru_wide stall between steps 50 and 200 under Gefen while AdamW
trains on. This trains one seed of a recurrent task and can perturb its init by 1e-6 per weight
(``--jitter``: another draw of the same seed), let AdamW step the tensors named by
``--adamw-on`` (for its first ``--adamw-until`` steps only, then a fresh ``--first`` there), or
switch the whole model to a fresh ``--then`` after ``--switch`` steps. It logs every ``--every``
steps per tensor: the weight's RMS, the step's RMS and max over lr, the gradient norm before the
clip, and the spectral norm of each gate's block of the recurrent matrix.

    OMP_NUM_THREADS=1 PYTHONPATH=. python research/gru_warmup.py --seed 1 --first gefen8 \
        --adamw-on rnn.weight_hh --jitter 0 --out research/results/gru_warmup.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from gefen_dist.bench import peers, store, tasks
from research.rank_v import RankV


def run_name(
    first: str,
    switch: int,
    then: str,
    jit: int,
    adamw_on: str,
    adamw_until: int,
    other: str,
) -> str:
    """A record's ``optimizer``: ``first``, then ``>switch>then``, ``~jitter``, ``-other:names``
    (``other`` is ``adamw`` unless ``--other`` says), ``<=until`` where each applies. ``arm``
    reads it back."""
    name = first + (f">{switch}>{then}" if then else "")
    name += f"~{jit}" if jit >= 0 else ""
    name += f"-{other}:{adamw_on}" if adamw_on else ""
    return name + (f"<={adamw_until}" if adamw_until else "")


def arm(name: str) -> str:
    """``run_name`` without its perturbation (``gefen8~3-adamw:x`` -> ``gefen8-adamw:x``): the
    runs of one arm are draws of one distribution, an unperturbed run included."""
    head, _, rest = name.partition("~")
    return head + rest.lstrip("0123456789")


def _split(model: torch.nn.Module, names: str) -> tuple[list, list]:
    """The parameters whose name holds none of ``names``' comma-separated parts, and the rest."""
    parts = [x for x in names.split(",") if x]
    named = list(model.named_parameters())
    mine = [p for n, p in named if not any(x in n for x in parts)]
    return mine, [p for n, p in named if any(x in n for x in parts)]


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
    other: str = "adamw",
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
    kw = dict(betas=h.betas, weight_decay=h.weight_decay, **inst.model_info)
    mine, rest = _split(model, adamw_on)

    def build(name: str) -> list:
        """``name`` over ``mine``, and a fresh AdamW (or ``rank_v``'s oracle) over ``rest``."""
        opts = [peers.build(name, model, h.lr, params=mine, **kw)]
        if not rest:
            return opts
        if other.startswith("rank:"):
            form = other[5:]
            return opts + [RankV(rest, h.lr, h.betas, h.weight_decay, form)]
        return opts + [peers.build(other, model, h.lr, params=rest, **kw)]

    opts = build(first)
    gates = 3 if t.sizes["cell"] == "gru" else 4
    log, curve = [], []
    for s in range(1, h.steps + 1):
        if s == switch + 1 and then:
            opts = build(then)
        if s == adamw_until + 1 and adamw_until:
            opts = opts[:1] + [peers.build(first, model, h.lr, params=rest, **kw)]
        factor = tasks.lr_factor(s - 1, h)
        for opt in opts:
            peers.set_lr(opt, factor)
        watch = s % every == 0 or s <= 5
        before = {k: p.detach().clone() for k, p in names.items()} if watch else None
        loss = inst.loss(model, next(inst.batches))
        model.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), h.grad_clip).item()
        for opt in opts:
            opt.step()
        if watch:
            cur_lr = h.lr * factor
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
    ap.add_argument(
        "--other", default="adamw", help="with --adamw-on: a peer's name or rank:FORM (rank_v.py)"
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
        a.other,
    )
    name = run_name(a.first, a.switch, a.then, a.jitter, a.adamw_on, a.adamw_until, a.other)
    rec = dict(
        key=f"{a.task}|{a.lr}|{name}|{a.seed}",
        task=a.task,
        lr=a.lr,
        optimizer=name,
        seed=a.seed,
        **body,
        seconds=time.time() - t0,
        rev=store.revision()["head"][:7],
        machine=store.cpu_model(),
    )
    with open(a.out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(rec["key"], rec["final"])


if __name__ == "__main__":
    main()
