"""A later training step that runs ONE tower of the multi-tower step (issue 49, 2 i): a fine-tuning
op `minimize(tower_0_loss)` after the `train_op` over both towers.

It waited forever in every all-reduce for the tower it does not run (refused since, exit 7). Now it
runs copies of that tower's forward pass (bnrewrite.rewrite.step_copies), as python runs it: one device.
The oracle (tests/scripts/partial_steps.py under `bnrewrite run --verify`): the whole script
(multi-tower steps, then fine-tuning steps) against one device fed the whole batch, by the noise
floor, the towers as built far off; and the fine-tuning steps bit-identical to python's from the
same weights (the script replayed from the run's values before them).
"""

import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.compat.v1.layers on TF >= 2.16, before its first use

import tensorflow as tf  # noqa: E402

from bnrewrite import TowerMismatchError, rewrite_graph  # noqa: E402
from script_oracle import ROOT, judge, run_both  # noqa: E402
import zygote

SCRIPT = os.path.join(ROOT, "tests", "scripts", "partial_steps.py")
CASES = ("layers", "moments", "keras_phase", "late")
tf1 = tf.compat.v1


def test_a_step_training_one_tower_trains_as_python_beside_the_synchronized_step(tmp_path):
    err = run_both(SCRIPT, tmp_path, CASES, ("--verify",))
    for case in CASES:
        print(judge(case, str(tmp_path)))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT}
    zygote.run([sys.executable, SCRIPT, "--replay", str(tmp_path / "run"), str(tmp_path), *CASES], env=env,
               check=True, timeout=600, stdin=subprocess.DEVNULL, capture_output=True)
    for case in CASES:
        with np.load(tmp_path / f"{case}.npz") as python, np.load(tmp_path / "run" / f"{case}.npz") as run:
            assert python.files and not [k for k in python.files if not np.array_equal(python[k], run[k])], case
    lines = [line for line in err.splitlines() if line.startswith("bnrewrite:")]
    alone = [line for line in lines if "training step finetune_op runs 2 batch-norm op(s) of one tower alone (e.g. "
             "tower_0/" in line and "unsynchronized, as python does" in line]
    assert len(alone) == len(CASES), lines
    assert any("the graph grew (training step finetune_op added, which trains one tower alone" in line
               and "the session moves to the graph synchronized again" in line for line in lines), lines
    assert sum("verified 2 layers x 2 towers" in line for line in lines) == 3, lines  # keras_phase: in function bodies
    assert not any("error" in line or "warning" in line or "failed" in line for line in lines), lines


def _towers(towers: int, later: tuple[int, ...]) -> tf.Graph:
    """`towers` towers of conv + batch norm, one train op over all, a later one over the towers `later`."""
    graph = tf.Graph()
    with graph.as_default():
        optimizer = tf1.train.GradientDescentOptimizer(0.1)
        losses = []
        for i in range(towers):
            with tf.device(f"/cpu:{i}"), tf1.name_scope(f"tower_{i}"), tf1.variable_scope("net", reuse=tf1.AUTO_REUSE):
                x = tf1.placeholder(tf.float32, [4, 6, 6, 3])
                y = tf1.layers.batch_normalization(tf1.layers.conv2d(x, 4, 3), training=True)
                losses.append(tf.reduce_mean(tf.square(y)))
        optimizer.minimize(tf.add_n(losses), name="train_op")
        tf1.train.GradientDescentOptimizer(0.05).minimize(tf.add_n([losses[i] for i in later]), name="later_op")
    return graph


def test_the_step_runs_copies_named_in_the_report():
    report = rewrite_graph(_towers(2, (1,)).as_graph_def()).report
    assert [[site.split("/", 1)[0] for site in row.sites] for row in report.layers] == [["tower_0", "tower_1"]]
    assert list(report.copies) == ["later_op"] and not report.skipped
    copies = report.copies["later_op"]
    assert copies["tower_1/net/batch_normalization/FusedBatchNormV3"] == \
        "bnrewrite_alone/tower_1/net/batch_normalization/FusedBatchNormV3", copies
    assert not any(name.startswith("tower_0/") for name in copies), copies
    assert report.not_run == ["bnrewrite_alone/tower_1/net/batch_normalization/FusedBatchNormV3"]
    assert report.to_dict()["copies"] == report.copies
    assert any(note.startswith("training step later_op runs 1 batch-norm op(s) of one tower alone (e.g. tower_1/net/")
               for note in report.notes), report.notes


def test_a_step_running_some_towers_but_not_all_is_still_refused_naming_it():
    """Two of three towers: neither one device nor the multi-tower step; it would wait forever."""
    with pytest.raises(TowerMismatchError) as caught:
        rewrite_graph(_towers(3, (0, 1)).as_graph_def())
    message = str(caught.value)
    assert message.startswith("training step later_op runs batch norm tower_0/net/"), message
    assert "but no batch norm of tower(s) /device:CPU:2, which step train_op trains with it" in message, message
