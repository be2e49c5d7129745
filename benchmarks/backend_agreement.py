"""Do two of Gefen's backends take the same steps? Train a bench task with the backend Gefen picks
(the C++ kernel on a CPU) and step a copy of the model with another backend on the very same
gradients, so that nothing but the update differs: the copy never computes a loss of its own, so
a difference cannot feed back through training as it does between two separate runs.

    python benchmarks/backend_agreement.py --task mlp --optimizer gefen4 --lr-factor 10 --seed 0

Prints, at the chosen steps, per weight matrix the relative difference of the parameters
(``|p_a - p_b| / |p_a|``) and of the state (``absmax``, ``v``, ``v_cross``), the fraction of
codes that differ, and both copies' final validation metrics. Why it exists: at the classifiers'
high lrs two runs of one seed that differ in the last bits of a step end apart by as much as the
seeds do (``results/mlp_high_lr.md``), and this tells such chaos apart from an update that differs.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gefen_dist.bench import peers, sweep, tasks  # noqa: E402


@torch.no_grad()
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / a.norm().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="mlp")
    ap.add_argument("--optimizer", default="gefen4")
    ap.add_argument("--lr-factor", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--against", default="reference", help="the copy's backend")
    ap.add_argument("--steps", default="1,2,10,50,100,200,400,800")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = sweep.swept(tasks.TASKS[args.task], args.lr_factor)
    h = spec.hyper
    inst = tasks.build(spec, args.seed)
    a, b = inst.model, copy.deepcopy(inst.model)
    kw = dict(betas=h.betas, weight_decay=h.weight_decay, **inst.model_info)
    oa = peers.build(args.optimizer, a, h.lr, **kw)
    ob = peers.build(args.optimizer, b, h.lr, **kw)
    ob._impl = lambda p, g: args.against
    shown = {int(s) for s in args.steps.split(",")}
    pairs = [(n, pa, pb) for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True)]
    for step in range(1, h.steps + 1):
        for o in (oa, ob):
            peers.set_lr(o, tasks.lr_factor(step - 1, h))
        oa.zero_grad(set_to_none=True)
        inst.loss(a, next(inst.batches)).backward()
        if h.grad_clip:
            torch.nn.utils.clip_grad_norm_(a.parameters(), h.grad_clip)
        for _, pa, pb in pairs:
            pb.grad = pa.grad.clone()
        oa.step()
        ob.step()
        if step not in shown:
            continue
        cols = []
        for name, pa, pb in pairs:
            if pa.dim() < 2:
                continue
            sa, sb = oa.state[pa], ob.state[pb]
            col = f"{name}: p {_rel(pa, pb):.1e}"
            if sa.get("codes") is not None and sa["codes"].numel():
                col += f", codes differ {float((sa['codes'] != sb['codes']).float().mean()):.1e}"
            for k in ("absmax", "v", "v_cross"):
                if sa.get(k) is not None and sa[k].numel():
                    col += f", {k} {_rel(sa[k], sb[k]):.1e}"
            cols.append(col)
        print(f"step {step}: " + "; ".join(cols), flush=True)
    print(f"{oa.memory_report()['backend']}: {inst.evaluate(a)}")
    print(f"{args.against}: {inst.evaluate(b)}")


if __name__ == "__main__":
    main()
