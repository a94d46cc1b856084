"""What a new user meets first: `check --help`, check's closing line, `print(result.report)`,
`result.find` on the wrong graph, and fetching one tower's tensor alone (issue 28).
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from bnrewrite import BnRewriteError, ForeignGraphError, rewrite_graph
from bnrewrite.rewrite.report import REMOVED_SHOWN
from bnrewrite.rewrite.selfcheck import CaseResult, CheckReport
from models import Spec, build_towers, session_config

tf1 = tf.compat.v1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture(scope="module")
def four_towers():
    """A 4-tower graph and its rewrite: 2 layers x 2 statistics x 3 duplicate towers = 12
    duplicate updates, each with the ops that only fed it."""
    built = build_towers(Spec(towers=4))
    return built, rewrite_graph(built.graph)


def test_check_help_names_the_backend_check_runs_on_cpus():
    proc = subprocess.run([sys.executable, "-m", "bnrewrite", "check", "--help"], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "else local on 2 virtual CPUs" in text and "collective on 2 virtual CPUs" not in text


def test_check_output_points_at_nothing_an_installed_package_lacks():
    report = CheckReport(backend="local", devices="2 virtual CPU devices", cases=[
        CaseResult(case="fused NHWC", backend="local", towers=2, passed=True, error=1e-6, unsynced_error=0.8,
                   all_reduces_per_layer=2, step_ms=1.4, unsynced_step_ms=1.1)])
    text = str(report)
    assert "tools/" not in text and "step times are those of a tiny model" in text


def test_printed_report_is_a_summary_and_the_full_lists_stay_available(four_towers):
    _, result = four_towers
    report = result.report
    updates = [r for r in report.removed if r["why"].startswith("duplicate update")]
    fed = len(report.removed) - len(updates)
    assert len(updates) == 12 and fed > 0
    short, full = str(report), report.text(verbose=True)
    assert short == report.text()
    assert f"removed {len(report.removed)} op(s):" in short
    assert sum(r["node"] in short for r in report.removed) == REMOVED_SHOWN
    assert f"... and {len(updates) - REMOVED_SHOWN} more duplicate update(s) and {fed} op(s) that only fed or read after those" in short
    assert "report.text(verbose=True) lists them all" in short
    assert all(f"{r['node']}: {r['why']}" in full for r in report.removed)
    assert len(short.splitlines()) < len(full.splitlines()) - len(report.removed) + REMOVED_SHOWN + 2
    assert report.to_dict()["removed"] == report.removed and len(report.to_dict()["removed"]) == len(report.removed)
    assert short.rstrip().endswith(f"{report.nodes_before} -> {report.nodes_after} nodes")


def test_find_refuses_a_graph_to_graph_did_not_make(four_towers):
    built, result = four_towers
    loss = built.graph.get_tensor_by_name(built.loss)
    with pytest.raises(ForeignGraphError, match=r"call graph = result.to_graph\(\)") as caught:
        result.find(built.graph, loss)
    assert isinstance(caught.value, BnRewriteError)
    with pytest.raises(ForeignGraphError):
        result.find(tf.Graph(), built.loss)
    graph = result.to_graph()
    assert result.find(graph, loss).graph is graph
    other = rewrite_graph(built.graph)
    with pytest.raises(ForeignGraphError):  # a graph made by another result's to_graph
        other.find(graph, loss)


def test_one_tower_fetched_alone_needs_every_towers_inputs_and_the_docstring_says_how():
    """On the local backend, tower 0's loss alone needs tower 1's placeholders (its all-reduce
    sums tower 1's statistics): the raw TensorFlow error rewrite_graph's docstring explains."""
    spec = Spec(towers=2, batch=2)
    built = build_towers(spec)
    result = rewrite_graph(built.graph, backend="local")
    graph = result.to_graph()
    tower0_loss = graph.get_tensor_by_name("tower_0/loss:0")
    feeds = [tuple(graph.get_tensor_by_name(n) for n in pair) for pair in built.inputs]
    values = {}
    for images, labels in feeds:
        values[images] = np.ones(images.shape.as_list(), np.float32)
        values[labels] = np.zeros(labels.shape.as_list(), np.int32)
    with graph.as_default():
        init = tf1.global_variables_initializer()
    with tf1.Session(graph=graph, config=session_config(spec.towers)) as sess:
        sess.run(init)
        first_tower_only = {t: values[t] for t in feeds[0]}
        with pytest.raises(tf.errors.InvalidArgumentError, match="You must feed a value for placeholder tensor 'tower_1/"):
            sess.run(tower0_loss, first_tower_only)
        assert np.isfinite(sess.run(tower0_loss, values))
    doc = " ".join(rewrite_graph.__doc__.split())
    assert "Every step must run every tower's all-reduces" in doc
    assert "sess.run([train_op, loss], feed)" in doc and "You must feed a value for placeholder tensor" in doc
