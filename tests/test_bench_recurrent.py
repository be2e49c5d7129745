"""The recurrent tasks of ``gefen_dist.bench.recurrent``: registered, out of the default list, and
trained by the suite's own loop with Gefen's state on their stacked gate matrices."""

from __future__ import annotations

import pytest

from gefen_dist.bench import recurrent, suite, tasks

pytestmark = pytest.mark.unit


def test_recurrent_tasks_are_registered_and_not_in_the_default_list():
    names = [t.name for t in recurrent.RECURRENT]
    assert len(names) >= 3 and {"lstm"} <= set(names)
    for n in names:
        assert tasks.TASKS[n].kind == "lm" and n not in tasks.DEFAULT_TASKS
    assert tasks.DEFAULT_TASKS == ("gpt2", "llama", "resnet", "mlp", "gru")
    # the shapes the suite's gru lacks: a hidden size off 64, a longer sequence, a smaller batch
    gru = tasks.TASKS["gru"].sizes
    sizes = [tasks.TASKS[n].sizes for n in names]
    assert any(s["hidden"] % 64 for s in sizes)
    assert any(s["seq"] > gru["seq"] for s in sizes) and any(
        s["batch"] < gru["batch"] for s in sizes
    )
    recurrent.register_tasks()  # again: the same tasks, accepted


@pytest.mark.parametrize("name", [t.name for t in recurrent.RECURRENT])
def test_the_suite_trains_each_recurrent_task_with_gefen(name):
    t = tasks.scaled(tasks.TASKS[name], 0.02, smoke=True)
    rec = suite.run_one(t, "gefen8", 0)
    assert rec["status"] == "ok", rec
    first, last = rec["curve"][0]["val_loss"], rec["final"]["val_loss"]
    assert last < first
    s = tasks.TASKS[name].sizes
    gates = 4 if s["cell"] == "lstm" else 3
    w_hh = next(x for x in rec["gefen"]["tensors"] if "rnn.weight_hh_l0" in x["name"])
    assert w_hh["shape"] == [gates * s["hidden"], s["hidden"]]
    assert rec["bytes_per_param"] < 2.0  # blocked state, not AdamW's 8 bytes
