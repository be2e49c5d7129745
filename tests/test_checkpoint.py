import copy
import subprocess
import sys
import textwrap

import pytest
import torch

from gefen_dist import Gefen
from gefen_dist.demo.model import GPT, GPTConfig

pytestmark = pytest.mark.unit

torch.set_num_threads(1)

TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=64)


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 256, (4, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _train(model, opt, steps, first=0):
    for s in range(first, first + steps):
        opt.zero_grad()
        model(*_batch(s))[1].backward()
        opt.step()


RESUME = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    from gefen_dist import Gefen
    from gefen_dist.demo.model import GPT, GPTConfig
    sys.path.insert(0, {tests!r})
    from test_checkpoint import TINY, _train
    mode, path, bits = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = Gefen(model.parameters(), lr=3e-3, weight_decay=0.1, bits=bits)
    if mode == "full":
        _train(model, opt, 6)
        torch.save(model.state_dict(), path + ".final")
    elif mode == "first":
        _train(model, opt, 3)
        torch.save({{"model": model.state_dict(), "opt": opt.state_dict()}}, path)
    else:
        ckpt = torch.load(path, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        _train(model, opt, 3, first=3)
        torch.save(model.state_dict(), path + ".resumed")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
def test_resume_in_a_fresh_process_is_bit_exact(tmp_path, bits):
    script = tmp_path / "resume.py"
    script.write_text(RESUME.format(tests=str(__import__("pathlib").Path(__file__).parent)))
    ck = str(tmp_path / "ck.pt")
    for mode in ("full", "first", "second"):
        subprocess.run([sys.executable, str(script), mode, ck, str(bits)], check=True)
    full = torch.load(ck + ".final", weights_only=True)
    resumed = torch.load(ck + ".resumed", weights_only=True)
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    saved = torch.load(ck, weights_only=True)["opt"]["state"]
    qkv = saved[4]  # transformer.h.0.attn.c_attn.weight, shape (192, 64)
    assert qkv["layout"][0, 3] > 1
    assert qkv["codes"].dtype == torch.uint8
    assert qkv["codes"].numel() == (192 * 64 if bits == 8 else 192 * 64 // 2)


def _trained(bits=8, cfg=TINY, dtype=torch.float32):
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    opt = Gefen(list(model.named_parameters()), lr=3e-3, bits=bits)
    _train(model, opt, 2)
    return model, opt


def test_state_dict_into_a_different_model_names_the_parameter():
    _, opt = _trained()
    sd = opt.state_dict()
    other = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    opt2 = Gefen(list(other.named_parameters()), lr=3e-3, bits=8)
    with pytest.raises(ValueError, match=r"'transformer.wte.weight'.*different model"):
        opt2.load_state_dict(sd)
    assert not opt2.state  # nothing half-loaded


def test_a_checkpoint_of_another_bit_width_is_refused():
    """The width is the state's size: a 4-bit checkpoint never turns an 8-bit Gefen into a
    4-bit one behind the user's back (torch's loader would install the saved group's bits)."""
    _, opt = _trained(bits=4)
    opt2 = Gefen(list(GPT(TINY).named_parameters()), lr=3e-3, bits=8)
    with pytest.raises(ValueError, match="holds bits=4 state.*built with bits=8"):
        opt2.load_state_dict(opt.state_dict())
    assert not opt2.state


def test_state_dict_with_other_bits_is_refused():
    _, opt = _trained(bits=4)
    model2 = GPT(TINY)
    opt2 = Gefen(list(model2.named_parameters()), lr=3e-3, bits=8)
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        g["bits"] = 8
    with pytest.raises(ValueError, match="16-level codebook.*bits=8"):
        opt2.load_state_dict(sd)


@pytest.mark.parametrize(
    "key,value,says",
    [("lr", float("nan"), "lr"), ("betas", (0.9, 1.5), "betas"), ("bits", 5, "bits")],
)
def test_saved_group_settings_are_checked_like_the_constructor_s(key, value, says):
    """torch's loader installs a saved group's settings as they are: a saved lr of NaN had
    loaded and turned every parameter non-finite at the next step."""
    _, opt = _trained()
    sd = opt.state_dict()
    sd["param_groups"][0][key] = value
    opt2 = Gefen(list(GPT(TINY).named_parameters()), lr=3e-3)
    with pytest.raises(ValueError, match=f"saved param group 0: Invalid {says}"):
        opt2.load_state_dict(sd)
    assert not opt2.state and opt2.param_groups[0]["lr"] == 3e-3


def test_corrupted_state_is_refused():
    _, opt = _trained()
    sd = opt.state_dict()
    sd["state"][4] = dict(sd["state"][4], codes=sd["state"][4]["codes"][:-1])
    opt2 = Gefen(list(GPT(TINY).named_parameters()), bits=8)
    with pytest.raises(ValueError, match=r"c_attn.weight.*'codes'"):
        opt2.load_state_dict(sd)


@pytest.mark.parametrize("how", ["nan", "unsorted"])
def test_a_codebook_the_kernels_cannot_search_is_refused(how):
    _, opt = _trained()
    sd = opt.state_dict()
    levels = sd["state"][4]["codebook"].clone()
    if how == "nan":
        levels[3] = float("nan")
    else:
        levels[[2, 9]] = levels[[9, 2]]
    sd["state"][4] = dict(sd["state"][4], codebook=levels)
    opt2 = Gefen(list(GPT(TINY).named_parameters()), bits=8)
    with pytest.raises(ValueError, match=r"c_attn.weight.*finite, strictly increasing"):
        opt2.load_state_dict(sd)
    assert not opt2.state


def test_bf16_model_state_keeps_its_dtypes_through_load():
    model, opt = _trained(dtype=torch.bfloat16)
    sd = opt.state_dict()
    opt2 = Gefen(list(model.named_parameters()), lr=3e-3, bits=8)
    opt2.load_state_dict(sd)
    for p in model.parameters():
        a, b = opt.state[p], opt2.state[p]
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    _train(model, opt2, 1, first=2)  # and it steps


def test_load_restores_lr_and_codebook_for_late_params():
    model, opt = _trained()
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = 1e-4
    model2 = GPT(TINY)
    opt2 = Gefen(list(model2.named_parameters()), lr=3e-3, bits=8)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 1e-4
    extra = torch.zeros(100, 96, requires_grad=True)
    opt2.add_param_group({"params": [extra], "param_names": ["extra"], "bits": 8})
    extra.grad = torch.randn(100, 96)
    opt2.step()
    assert torch.equal(opt2.state[extra]["codebook"], opt.state[model.lm_head.weight]["codebook"])


MEMORY = textwrap.dedent(
    """
    import resource, sys, torch
    torch.set_num_threads(1)
    from gefen_dist import Gefen
    rows, cols = 4096, 8192                     # 32M elements: 128 MiB of fp32
    g = torch.Generator().manual_seed(0)
    p = torch.zeros(rows, cols, requires_grad=True)
    p.grad = torch.exp(torch.randn(rows, 1, generator=g)) * torch.randn(rows, cols, generator=g)
    opt = Gefen([p], bits=4)
    from gefen_dist.method import codebook as cb    # numba's JIT and LLVM load once per process
    cb.learn_codebook(cb.histogram(torch.randn(1000, generator=g)), 4)
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    base = peak()
    opt.step()
    opt.step()
    rep = opt.memory_report()
    extra = peak() - base - rep["state_bytes"]
    print(rep["tensors"][0]["block_sizes"][0], rep["state_bytes"], extra)
    """
)


def _codebook_storages(opt):
    return {st["codebook"].untyped_storage().data_ptr() for st in opt.state.values() if st}


def test_a_loaded_state_shares_one_codebook_and_keeps_a_foreign_one(tmp_path):
    model, opt = _trained()
    assert len(_codebook_storages(opt)) == 1
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    sd = torch.load(tmp_path / "opt.pt", weights_only=True)
    sd["state"][0]["codebook"] = sd["state"][0]["codebook"].clone()  # as one copy per tensor
    opt2 = Gefen(GPT(TINY).parameters(), lr=3e-3, bits=8)
    opt2.load_state_dict(sd)
    assert len(_codebook_storages(opt2)) == 1
    first = next(iter(opt.state.values()))["codebook"]
    assert torch.equal(next(iter(opt2.state.values()))["codebook"], first)
    # levels that differ from the others' (not written by Gefen) stay that tensor's own
    foreign = sd["state"][1]["codebook"].clone()
    foreign[1:-1] *= 0.5  # its ends stay at -1 and +1 (gefen_dist.method.load_check)
    sd["state"][1]["codebook"] = foreign
    opt3 = Gefen(GPT(TINY).parameters(), lr=3e-3, bits=8)
    opt3.load_state_dict(sd)
    states = [st for st in opt3.state.values() if st]
    assert len(_codebook_storages(opt3)) == 2
    assert torch.equal(states[1]["codebook"], foreign)
    assert torch.equal(states[0]["codebook"], first) and torch.equal(states[2]["codebook"], first)


@pytest.mark.slow
def test_a_step_allocates_no_parameter_sized_temporaries(tmp_path):
    """Peak RSS over the first two steps (partition, codebook, updates) minus the state itself
    stays below what any parameter-sized temporary would take (32 MiB at one byte per element,
    128 MiB in fp32). The codebook's numba code is loaded first: loading it takes about 44 MiB
    once per process (measured on a 2-core x86-64 CPU), which is no temporary of the step; the
    step itself then takes about 4.2 MiB beyond its state there."""
    script = tmp_path / "mem.py"
    script.write_text(MEMORY)
    out = subprocess.run([sys.executable, str(script)], check=True, capture_output=True, text=True)
    block, state_bytes, extra = map(int, out.stdout.split())
    assert block == 8192
    assert state_bytes == 4096 * 8192 // 2 + 8 * 4096 + 4 * 8192  # codes, v and absmax, v_cross
    assert extra < 16 * 2**20, f"step allocated {extra / 2**20:.1f} MiB beyond its state"


def _without_v_cross(sd):
    """``sd`` as a Gefen from before the factored second moment saved it: 4-column layouts,
    no v_cross."""
    old = {k: {kk: vv for kk, vv in st.items() if kk != "v_cross"} for k, st in sd["state"].items()}
    for st in old.values():
        st["layout"] = st["layout"][:, :4].clone()
    return {**sd, "state": old}


def test_a_state_saved_before_v_cross_loads_and_refills_it_in_one_step():
    """The factor is a ratio of v_cross's entries, so a v_cross loaded as zeros is the one a
    fresh start would have: after one step it equals a run's whose v_cross was zeroed by hand."""
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = Gefen(model.parameters(), lr=3e-3, weight_decay=0.1)
    _train(model, opt, 3)
    factored = [st for st in opt.state.values() if st["v_cross"].numel()]
    assert factored, "no tensor of the model keeps v_cross: the test checks nothing"
    sd = opt.state_dict()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    runs = []
    for old in (True, False):  # a loaded state shares its tensors: each run gets its own copy
        model.load_state_dict(weights)
        again = Gefen(model.parameters(), lr=3e-3, weight_decay=0.1)
        again.load_state_dict(_without_v_cross(copy.deepcopy(sd)) if old else copy.deepcopy(sd))
        if not old:
            for st in again.state.values():
                st["v_cross"].zero_()
        assert all(st["layout"].shape[1] == 5 for st in again.state.values())
        _train(model, again, 2, first=3)
        runs.append({k: v.clone() for k, v in model.state_dict().items()})
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k


def test_a_v_cross_of_the_wrong_length_is_refused_by_name():
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = Gefen(model.parameters(), lr=3e-3)
    _train(model, opt, 1)
    sd = opt.state_dict()
    pid = next(k for k, st in sd["state"].items() if st["v_cross"].numel())
    sd["state"][pid] = dict(sd["state"][pid], v_cross=sd["state"][pid]["v_cross"][:-1].clone())
    with pytest.raises(ValueError, match="v_cross"):
        Gefen(model.parameters(), lr=3e-3).load_state_dict(sd)


def test_a_state_saved_with_fp32_b1_state_loads_as_bf16():
    """Before B = 1 state was bf16 it was fp32: such a checkpoint loads, rounded to bf16 once
    (these values were bf16 already, so exactly), and the run continues as if it had never
    been saved. Another dtype is refused by name."""
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = Gefen(model.parameters(), lr=3e-3, weight_decay=0.1)
    _train(model, opt, 3)
    dense = [pid for pid, st in opt.state_dict()["state"].items() if st["exp_avg"].numel()]
    assert dense, "no tensor of the model keeps B = 1 state: the test checks nothing"
    sd = copy.deepcopy(opt.state_dict())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, 2, first=3)
    want = {k: v.clone() for k, v in model.state_dict().items()}

    old = copy.deepcopy(sd)
    for pid in dense:
        for k in ("exp_avg", "exp_avg_sq"):
            old["state"][pid][k] = old["state"][pid][k].float()
    model.load_state_dict(weights)
    again = Gefen(model.parameters(), lr=3e-3, weight_decay=0.1)
    again.load_state_dict(old)
    assert all(st["exp_avg_sq"].dtype == torch.bfloat16 for st in again.state.values())
    _train(model, again, 2, first=3)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k

    bad = copy.deepcopy(sd)
    bad["state"][dense[0]]["exp_avg"] = bad["state"][dense[0]]["exp_avg"].half()
    with pytest.raises(ValueError, match="exp_avg.*float16.*expected torch.bfloat16"):
        Gefen(model.parameters(), lr=3e-3).load_state_dict(bad)
