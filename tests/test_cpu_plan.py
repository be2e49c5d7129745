"""The C++ step's kept tables (``cpu_plan.CpuPlan``): a step on them is the step the long way
would take, bit for bit, and anything that changes what the tables describe sends the step the
long way."""

import copy

import pytest
import torch
from needs import cpp_kernel

from gefen_dist import Gefen
from gefen_dist.backends import native_cpu
from gefen_dist.backends.cpu_plan import CpuPlan

pytestmark = pytest.mark.unit
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def _cpp_kernel():
    cpp_kernel()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 96),  # factored (96 rows of 64)
        torch.nn.GELU(),
        torch.nn.Linear(96, 80),
        torch.nn.LayerNorm(80),  # B = 1
        torch.nn.Linear(80, 10),
    )


def _grads(model, t, dtype=torch.float32):
    """New gradient tensors each step, as zero_grad(set_to_none=True) and backward give."""
    g = torch.Generator().manual_seed(t)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * (1 + t % 3)).to(dtype)


@pytest.fixture
def ran(monkeypatch):
    """Whether each step ran on the kept tables."""
    out = []
    real = CpuPlan.run

    def run(self, opt, backend):
        out.append(real(self, opt, backend))
        return out[-1]

    monkeypatch.setattr(CpuPlan, "run", run)
    return out


def _pair(**kw):
    """Two copies of the model, each with its own Gefen (``kw``, lr 1e-2 unless given)."""
    ma, mb = _model(), _model()
    kw = {"lr": 1e-2, **kw}
    return ma, Gefen(ma.parameters(), **kw), mb, Gefen(mb.parameters(), **kw)


def _step_both(ma, oa, mb, ob):
    """A step of ``oa`` as it comes (kept tables where they fit) and of ``ob`` the long way, which
    must leave the two alike."""
    oa.step()
    ob._plan = None  # the long way
    ob.step()
    _assert_same(ma, oa, mb, ob)


def _assert_same(ma, oa, mb, ob):
    for a, b in zip(ma.parameters(), mb.parameters(), strict=True):
        assert torch.equal(a, b)
        sa, sb = oa.state.get(a, {}), ob.state.get(b, {})  # no entry made for a state-less one
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("bits", [4, 8])
def test_kept_tables_step_as_the_long_way(bits, ran):
    """Ten steps with new gradient tensors, an lr schedule and betas changed midway: every step
    after the first runs on the kept tables, and parameters and state equal those of an
    optimizer made to take the long way each step."""
    ma, oa, mb, ob = _pair(weight_decay=0.1, bits=bits)
    sched = [torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5) for o in (oa, ob)]
    for t in range(10):
        if t == 5:
            for o in (oa, ob):
                o.param_groups[0]["betas"] = (0.8, 0.99)
        _grads(ma, t)
        _grads(mb, t)
        _step_both(ma, oa, mb, ob)
        for s in sched:
            s.step()
    assert ran[:9] == [True] * 9 and ob._plan is not None
    assert oa.memory_report()["backend"] == "native-cpu"


def test_a_missing_gradient_or_a_moved_parameter_takes_the_long_way_then_plans_again(ran):
    ma, oa, mb, ob = _pair()
    for t in range(6):
        _grads(ma, t)
        _grads(mb, t)
        if t == 2:  # a parameter without its gradient this step
            ma[0].bias.grad = mb[0].bias.grad = None
        if t == 4:  # storage swapped: the same values elsewhere
            for m in (ma, mb):
                m[2].weight.data = m[2].weight.data.clone()
        _step_both(ma, oa, mb, ob)
    # step 2 misses a gradient (long way), step 3 differs from step 2's tables (long way);
    # the moved parameter at step 4 keeps the plan: only its address changed
    assert ran == [True, False, False, True, True]


def test_a_parameter_that_never_gets_a_gradient_keeps_the_tables_in_use(ran):
    """A parameter without a gradient at every step has no state, so not all state is in place;
    without a process group the steps still run on the kept tables."""
    ma, oa, mb, ob = _pair()
    for t in range(4):
        _grads(ma, t)
        _grads(mb, t)
        ma[0].bias.grad = mb[0].bias.grad = None
        _step_both(ma, oa, mb, ob)
    assert not oa.state.get(ma[0].bias) and ran == [True, True, True]


def test_a_replaced_state_dict_takes_the_long_way(ran):
    """A parameter's state dict replaced in place (``opt.state[p] = ...``, same tensors' values
    in new tensors): the kept tables point into the old tensors, so the step must go the long
    way and update the new ones, as an optimizer that took the long way throughout does."""
    ma, oa, mb, ob = _pair()
    for t in range(5):
        _grads(ma, t)
        _grads(mb, t)
        if t == 3:
            for m, o in ((ma, oa), (mb, ob)):
                p = m[2].weight
                o.state[p] = {k: v.clone() for k, v in o.state[p].items()}
        _step_both(ma, oa, mb, ob)
    assert ran == [True, True, False, True]


def test_a_loaded_state_is_not_stepped_on_the_old_tables(ran):
    """After load_state_dict the next step updates the loaded state, as a fresh optimizer that
    loaded the same state does; the kept tables of the replaced state are not used."""
    ma, mb = _model(), _model()
    oa = Gefen(ma.parameters(), lr=1e-2)
    for t in range(3):
        _grads(ma, t)
        oa.step()
    saved = copy.deepcopy(oa.state_dict())
    mb.load_state_dict(ma.state_dict())
    for t in range(3, 5):  # move on, then go back to the saved state
        _grads(ma, t)
        oa.step()
    ma.load_state_dict(mb.state_dict())
    old = oa._plan
    oa.load_state_dict(copy.deepcopy(saved))  # as torch's, a loaded state is not copied
    assert old is not None and oa._plan is None
    oa._plan = old  # as if nothing had dropped it: its own checks must refuse it
    ob = Gefen(mb.parameters(), lr=1e-2)
    ob.load_state_dict(copy.deepcopy(saved))
    ran.clear()
    for t in range(5, 8):
        _grads(ma, t)
        _grads(mb, t)
        oa.step()
        ob.step()
        _assert_same(ma, oa, mb, ob)
    assert ran == [False, True, True, True, True]


def test_what_the_tables_cannot_describe_goes_the_long_way(ran):
    """A gradient of another dtype, or a non-contiguous one, is the long way's to handle: it
    updates from bf16 gradients and refuses the non-contiguous one by name, as without a plan."""
    m = _model()
    for p in m.parameters():
        p.grad_dtype = None  # fp32 parameters may take bf16 gradients
    o = Gefen(m.parameters(), lr=1e-2)
    for t in range(2):
        _grads(m, t)
        o.step()
    _grads(m, 2, torch.bfloat16)
    o.step()
    _grads(m, 3, torch.bfloat16)
    w = m[0].weight
    w.grad = torch.randn(w.shape[::-1]).t().to(torch.bfloat16)  # same shape, not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        o.step()
    assert ran == [True, False, False]


def test_the_kept_tables_count_the_steps_a_replaced_count_goes_the_long_way(ran):
    """The kept tables count each step once (in C, not torch._foreach_add_): after five steps
    every count is 5, as the long way's. A count replaced by hand (an fp64 one here) is not
    theirs to touch: that step goes the long way, which counts it as torch would."""
    ma, oa, mb, ob = _pair()
    first = next(iter(ma.parameters()))
    for t in range(6):
        if t == 5:
            assert ran == [True] * 4
            assert {float(oa.state[p]["step"]) for p in ma.parameters()} == {5.0}
            for m, o in ((ma, oa), (mb, ob)):
                p = next(iter(m.parameters()))
                o.state[p]["step"] = torch.tensor(9.0, dtype=torch.float64)
        _grads(ma, t)
        _grads(mb, t)
        _step_both(ma, oa, mb, ob)
    assert ran == [True] * 4 + [False]
    assert oa.state[first]["step"].dtype == torch.float64 and float(oa.state[first]["step"]) == 10
    assert {float(oa.state[p]["step"]) for p in ma.parameters()} == {10.0, 6.0}


def test_count_steps_refuses_outputs_of_another_length():
    from array import array

    with pytest.raises(ValueError, match="2 addresses but 1 outputs"):
        native_cpu.count_steps(array("q", [0, 0]), array("f", [0.0]))
