"""The whole optimizer on the Triton backend (CPU tensors, Triton's interpreter): the demo GPT
against the C++ kernel, a checkpoint resumed bit for bit, an lr schedule that compiles nothing
new, and a 2-rank FSDP2 run with a DCP checkpoint."""

import io
import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402
from dist_util import read_results, torchrun  # noqa: E402
from needs import triton_interpreter  # noqa: E402

from gefen_dist import Gefen  # noqa: E402
from gefen_dist.backends import triton_backend  # noqa: E402
from gefen_dist.demo.corpus import get_batch, load_corpus  # noqa: E402
from gefen_dist.demo.model import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    triton_interpreter()


STEPS = 4


def _grads(steps: int):
    """The demo GPT and ``steps + 1`` real gradients of it, computed once."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=32))
    train, _ = load_corpus(2**16)
    gen = torch.Generator().manual_seed(0)
    grads = []
    for _ in range(steps + 1):
        model.zero_grad(set_to_none=True)
        model(*get_batch(train, 4, 32, gen))[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return model, grads


def _run(model, grads, backend: str, bits: int, steps: int, sched=None):
    params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt = Gefen(params, lr=3e-3, weight_decay=0.1, bits=bits)
    opt.backend = backend
    lr = torch.optim.lr_scheduler.LambdaLR(opt, sched) if sched else None
    for t in range(steps):
        for p, g in zip(params, grads[t], strict=True):
            p.grad = g.clone()
        opt.step()
        if lr is not None:
            lr.step()
    return params, opt


@pytest.mark.parametrize("bits", [4, 8])
def test_demo_gpt_on_triton_equals_the_cpp_kernel(bits):
    """Partition, codebook and STEPS steps from real gradients: the same layouts and codebook,
    and parameters that agree but for the rare element a code on a rounding threshold moved
    (the kernels' bound: at most one element in 10^3 off by more than 10^-3 of the largest
    step)."""
    model, grads = _grads(STEPS)
    pt, ot = _run(model, grads, "triton", bits, STEPS)
    pc, oc = _run(model, grads, "native", bits, STEPS)
    assert ot.memory_report()["backend"] == "triton"
    assert oc.memory_report()["backend"] == "native-cpu"
    for a, b in zip(pt, pc, strict=True):
        assert torch.equal(ot.state[a]["layout"], oc.state[b]["layout"])
        assert torch.equal(ot.state[a]["codebook"], oc.state[b]["codebook"])
    kinds = {int(r[3]) > 1 or int(r[3]) < 0 for st in ot.state.values() for r in st["layout"]}
    assert kinds == {True, False}, "the model must have blocked and B = 1 tensors"
    moved = max(
        float((a - q).detach().abs().max()) for a, q in zip(pc, model.parameters(), strict=True)
    )
    off = sum(int(((a - b).abs() > 1e-3 * moved).sum()) for a, b in zip(pt, pc, strict=True))
    total = sum(p.numel() for p in pt)
    assert off <= total // 1000, f"{off} of {total} parameters differ by > 1e-3 of a step"


def test_a_triton_checkpoint_resumes_bit_for_bit():
    model, grads = _grads(STEPS)
    pt, ot = _run(model, grads, "triton", 4, STEPS - 1)
    file = io.BytesIO()  # through a file: a state_dict shares the state's tensors
    torch.save(ot.state_dict(), file)
    file.seek(0)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in pt]
    fresh = Gefen(twin, lr=3e-3, weight_decay=0.1, bits=4)
    fresh.backend = "triton"
    fresh.load_state_dict(torch.load(file, weights_only=True))
    for p, q, g in zip(pt, twin, grads[STEPS - 1], strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    ot.step()
    fresh.step()
    assert all(torch.equal(a, b) for a, b in zip(pt, twin, strict=True))
    for a, b in zip(pt, twin, strict=True):
        for k, v in ot.state[a].items():
            assert torch.equal(v, fresh.state[b][k]), k


def test_an_lr_schedule_compiles_no_new_kernel():
    """Every kernel variant launched is recorded; a warmup + decay schedule over the steps
    changes lr and the step count in the tables only, so after the first step no new variant
    appears."""
    model, grads = _grads(STEPS)
    triton_backend.SIGNATURES.clear()
    _run(model, grads, "triton", 4, 1)
    first = set(triton_backend.SIGNATURES)
    assert first
    _run(model, grads, "triton", 4, STEPS, sched=lambda t: min(1.0, (t + 1) / 2) * 0.7**t)
    assert triton_backend.SIGNATURES == first


@pytest.mark.dist
def test_fsdp2_on_two_ranks_with_triton(tmp_path):
    torchrun(
        "fsdp2_triton.py",
        str(tmp_path / "out"),
        str(tmp_path / "ck"),
        "4",
        env={"TRITON_INTERPRET": "1"},
        timeout=900,
    )
    ranks = read_results(tmp_path / "out", ranks=2)
    for r in ranks:
        assert r["triton"]["backend"] == "triton" and r["resumed"]["backend"] == "triton"
        assert r["native"]["backend"] == "native-cpu"
        assert r["resumed"]["bits_equal"]
        assert r["resumed"]["losses"] == r["triton"]["losses"][3:]
        assert r["triton"]["codebooks"] == r["native"]["codebooks"]
        for a, b in zip(r["triton"]["losses"], r["native"]["losses"], strict=True):
            assert abs(a - b) <= 1e-4 * abs(b), (r["triton"]["losses"], r["native"]["losses"])
        assert r["native"]["max_param_diff"] <= 1e-3 * r["native"]["max_moved"]
    assert ranks[0]["triton"]["codebooks"] == ranks[1]["triton"]["codebooks"]
