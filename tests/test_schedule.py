"""The one lr schedule (gefen_dist.schedule) and the three places that use it."""

import importlib.util
from pathlib import Path

import pytest

from gefen_dist.bench import tasks
from gefen_dist.demo import train as demo
from gefen_dist.schedule import warmup_cosine

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _launch_train():
    spec = importlib.util.spec_from_file_location("launch_train", ROOT / "launch" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_warmup_then_cosine_to_the_floor():
    f = [warmup_cosine(s, 100, 10, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == 1.0
    assert all(a >= b for a, b in zip(f[9:], f[10:], strict=False))
    assert f[-1] > 0.1 and warmup_cosine(100, 100, 10, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(55, 100, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)


def test_the_demo_the_suite_and_launch_train_scale_the_lr_alike():
    steps, warmup, floor = 60, 6, 0.1
    h = tasks.Hyper(steps=steps, lr=1e-3, warmup_frac=0.1, min_lr_frac=floor)
    cfg = dict(steps=steps, optimizer=dict(warmup=warmup, min_lr_frac=floor))
    demo_f = demo.lr_lambda(dict(steps=steps, warmup=warmup, min_lr_frac=floor))
    launch_f = _launch_train().lr_factor
    for s in range(steps + 1):
        want = warmup_cosine(s, steps, warmup, floor)
        assert tasks.lr_factor(s, h) == want == demo_f(s) == launch_f(cfg, s)
