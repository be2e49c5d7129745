"""Gefen keeps to its tensors' device, whatever torch's default device is.

Why: this machine has no GPU, and two bugs that crashed every GPU step had passed every test
here: the reference B = 1 update drew its hash indices on the default device, and partitioning
added a GPU gradient into a host tensor. Two checks stand in for a second device. The meta
device checks that every operand of an op is on one device, so the reference updates run on
meta tensors; and with the default device set to meta, a tensor made without an explicit
device lands there and fails at its first op with a CPU tensor or its first read, so training
on CPU parameters under it shows every place that leans on the default. What neither catches
is an explicit host tensor meeting a device one; ``launch/gpu_check.py``'s optimizer check
runs the whole optimizer on the device for that."""

import pytest
import torch

from gefen_dist import Gefen
from gefen_dist.backends.reference import (
    block_update,
    column_update,
    dense_update,
)
from gefen_dist.demo.model import GPT, GPTConfig
from gefen_dist.method import codebook
from gefen_dist.method.codes import midpoints
from gefen_dist.method.hyper import Hyper
from gefen_dist.method.segments import num_blocks
from gefen_dist.method.state import SegmentState, cross_length

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [1, 97, -97])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "bf16_sr"])
def test_reference_updates_keep_to_their_tensors_device(bits, block, stochastic):
    """With ``stochastic``, bf16 parameters written with bf16_stochastic_round: the write's
    hash indices are drawn on the parameter's device too."""
    dev, start, numel = torch.device("meta"), 37, 4001
    levels = codebook.learn_codebook(codebook.histogram(torch.linspace(-1, 1, 999)), bits)
    st = SegmentState(start, numel, block)
    if block == 1:
        st.exp_avg = torch.zeros(numel, dtype=torch.bfloat16, device=dev)
        st.exp_avg_sq = torch.zeros(numel, dtype=torch.bfloat16, device=dev)
    else:
        nb = num_blocks(start, numel, block)
        st.codes = torch.zeros(
            numel if bits == 8 else (numel + 1) // 2, dtype=torch.uint8, device=dev
        )
        st.absmax, st.v = torch.zeros(nb, device=dev), torch.zeros(nb, device=dev)
        st.v_cross = torch.zeros(cross_length(block, start + numel), device=dev)
    p, g = torch.zeros(numel, device=dev), torch.zeros(numel, device=dev)
    if stochastic:
        p = p.bfloat16()
    h = Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=2)
    h.bf16_stochastic_round = stochastic
    if block == 1:
        dense_update(p, g, st, h)
    else:
        update = block_update if block > 0 else column_update
        update(p, g, st, h, levels.to(dev), midpoints(levels).to(dev), bits)
    assert p.device == dev and (st.codes if block != 1 else st.exp_avg).device == dev


def _train(bits: int, backend: str, default: str) -> tuple[list[torch.Tensor], float]:
    """Three steps, a state_dict round trip and a fourth, the default device ``default`` from
    the optimizer's first step on (partitioning, with column sums for the 2-D tensors; the
    codebook; the state); the model and its data are made before, on the CPU."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=32))
    x = torch.randint(0, 256, (2, 32))
    opt = Gefen(model.parameters(), lr=1e-3, weight_decay=0.1, bits=bits)
    opt.backend = backend
    with torch.device(default):
        for t in range(4):
            if t == 3:
                opt.load_state_dict(opt.state_dict())
            model.zero_grad(set_to_none=True)
            loss = model(x, x)[1]
            loss.backward()
            opt.step()
        assert opt.memory_report()["backend"].startswith(
            {"native": "native-cpu", "reference": "reference"}[backend]
        )
    return [p.detach().clone() for p in model.parameters()], loss.item()


@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("bits", [4, 8])
def test_training_does_not_depend_on_the_default_device(bits, backend):
    want, loss = _train(bits, backend, "cpu")
    got, loss_meta = _train(bits, backend, "meta")
    assert loss_meta == loss
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_state_left_on_another_device_is_refused_by_name():
    """A model moved after the optimizer's first step leaves its state behind; the kernels take
    raw addresses, so a step must refuse that before any reaches them (a CUDA kernel handed host
    memory faults the context). The meta device stands in for the device left behind."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = Gefen(model.named_parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 64)).square().sum().backward()
        opt.step()
    st = opt.state[model.weight]
    before = {k: v.clone() for k, v in st.items()}
    st["codes"] = st["codes"].to("meta")
    with pytest.raises(RuntimeError, match=r"state of parameter 'weight'.* on meta.*on cpu"):
        opt.step()
    st["codes"] = before["codes"]
    assert all(torch.equal(st[k], before[k]) for k in before)  # nothing was stepped


@pytest.mark.dist
def test_sharded_steps_do_not_depend_on_the_default_device(tmp_path):
    """FSDP1 flat shards (pieces spread over ranks: the statistics gathered, the histogram and
    the v_cross sums all-reduced) and DDP on 2 gloo ranks, as above
    (tests/dist/default_device.py)."""
    from dist_util import read_results, torchrun

    torchrun("default_device.py", str(tmp_path))
    assert read_results(tmp_path, ranks=2) == [{"fsdp1": True, "ddp": True}] * 2
