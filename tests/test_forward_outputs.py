"""What a synced fused layer's forward op gives: the op stays, under its name, in inference
mode (sync_forward), so Grappler still fuses the ReLU after it as it did the training op, or,
blending running statistics (exponential_avg_factor != 1), an IdentityN of its name takes its
place; either way its outputs read directly are the one-device op's: y, the batch mean and
the Bessel-corrected batch variance of the global batch."""

import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import tensorflow as tf

from bnrewrite import rewrite_graph
from models import Spec, build_towers, make_batches, session_config

tf1 = tf.compat.v1
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fused_relus(graph_def, built, spec: Spec) -> int:
    """Batch norms that ran fused with their ReLU in one traced training step (op types as
    they ran, after Grappler and oneDNN rewrites)."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    images, labels = make_batches(spec, 1)[0]
    per_tower = len(images) // spec.towers
    feeds = {}
    for k, (x, y) in enumerate(built.inputs):
        feeds[x] = images[k * per_tower:(k + 1) * per_tower]
        feeds[y] = labels[k * per_tower:(k + 1) * per_tower]
    options, metadata = tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE), tf1.RunMetadata()
    with tf1.Session(graph=graph, config=session_config(spec.towers)) as session:
        session.run(built.init)
        session.run(built.train_op, feeds, options=options, run_metadata=metadata)
    labels_run = [n.timeline_label for d in metadata.step_stats.dev_stats for n in d.node_stats]
    return sum("FusedBatchNormEx" in label.split("(")[0] for label in labels_run)


def _relu_counts(layer: str) -> tuple[int, int, int]:
    """Batch norms fused with their ReLU: un-rewritten, rewritten with the batch size unknown
    (the count known at run time), rewritten with static shapes (the count a constant)."""
    spec = Spec(towers=2, layer=layer)
    built, unknown = build_towers(spec), build_towers(replace(spec, uneven=True))
    before = _fused_relus(built.graph.as_graph_def(), built, spec)
    after = _fused_relus(rewrite_graph(unknown.graph.as_graph_def()).graph_def, unknown, spec)
    return before, after, _fused_relus(rewrite_graph(built.graph).graph_def, built, spec)


@pytest.mark.parametrize("layer", ["legacy", "fused_op"])
def test_relu_stays_fused_with_the_batch_norm(layer):
    """Whether the count is a constant or known at run time, the op stays and the ReLU fuses
    into it. Grappler fuses a CPU batch norm with its ReLU only under oneDNN, which TensorFlow turns on by
    default on some CPUs alone (an Intel Xeon, not an AMD EPYC with AVX2): the steps run in a
    process with TF_ENABLE_ONEDNN_OPTS=1, so every machine checks the same thing."""
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": os.pathsep.join([_ROOT, os.path.join(_ROOT, "examples"), os.path.join(_ROOT, "tests")])}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), layer], env=env, capture_output=True, text=True,
                         timeout=600, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-3000:]
    before, unknown, static = map(int, out.stdout.split()[-3:])
    print(f"{layer}: batch norms fused with a ReLU: un-rewritten {before}, rewritten {unknown} (batch size unknown), "
          f"{static} (static shapes)")
    assert before == 2 * 2 and unknown == static == before


SCALE = np.linspace(0.5, 2.0, 6, dtype=np.float32)
OFFSET = np.linspace(-1.0, 1.0, 6, dtype=np.float32)
RUNNING = np.full(6, 0.25, np.float32)


def _fused(x, factor: float):
    return tf1.raw_ops.FusedBatchNormV3(x=x, scale=tf1.get_variable("scale", initializer=SCALE),
                                        offset=tf1.get_variable("offset", initializer=OFFSET), mean=RUNNING,
                                        variance=RUNNING, exponential_avg_factor=factor, is_training=True)


def _one_device(x: np.ndarray, factor: float) -> list[np.ndarray]:
    graph = tf.Graph()
    with graph.as_default(), tf1.Session() as session:
        out = _fused(tf.constant(x), factor)
        session.run(tf1.global_variables_initializer())
        return session.run(list(out[:3]))


@pytest.mark.parametrize("factor, known, op", [(1.0, False, "FusedBatchNormV3"), (1.0, True, "FusedBatchNormV3"),
                                              (0.25, True, "IdentityN")])
def test_outputs_read_directly_are_the_global_batchs(factor, known, op):
    """factor 1: the op itself, fed for a count known at run time or (static shapes, inferred
    from the bare GraphDef) a constant one; otherwise (blends) the IdentityN that replaces it."""
    k, shape = 2, (3, 4, 5, 6)
    graph, sites = tf.Graph(), []
    with graph.as_default():
        for i in range(k):
            with tf.device(f"/cpu:{i}"), tf.name_scope(f"tower_{i}"), tf1.variable_scope("", reuse=i > 0):
                x = tf1.placeholder(tf.float32, shape if known else (None, *shape[1:]), name="x")
                out = _fused(x, factor)
                tf.gradients(tf.reduce_sum(out.y ** 2), [x])
                sites.append(out.y.op.name)
        init = tf1.global_variables_initializer().name
    result = rewrite_graph(graph.as_graph_def())
    kept = [n for n in result.graph_def.node if n.name in sites]
    assert [n.op for n in kept] == [op] * k
    rng = np.random.default_rng(0)
    slices = [rng.normal(3.0, 2.0, shape).astype(np.float32) for _ in range(k)]
    expected = _one_device(np.concatenate(slices), factor)
    feeds = {f"tower_{i}/x:0": s for i, s in enumerate(slices)}
    synced = _outputs(result.graph_def, init, feeds, sites, k)
    for i, got in enumerate(synced):
        np.testing.assert_allclose(got[0], expected[0][i * shape[0]:(i + 1) * shape[0]], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[1], expected[1], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got[2], expected[2], rtol=1e-5)
    unsynced = _outputs(graph.as_graph_def(), init, feeds, sites, k)
    differs = [float(np.max(np.abs(got[1] - expected[1]))) for got in unsynced]
    print(f"factor {factor}: un-rewritten towers' batch means off by {differs}")
    assert min(differs) > 1e-2


def _outputs(graph_def, init: str, feeds: dict, sites: list[str], k: int) -> list[list[np.ndarray]]:
    """Outputs 0-2 of each site, read by name, in one run of `graph_def` on k devices."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    with tf1.Session(graph=graph, config=session_config(k)) as session:
        session.run(init)
        return session.run([[f"{site}:{j}" for j in range(3)] for site in sites], feeds)


if __name__ == "__main__":  # test_relu_stays_fused_with_the_batch_norm's own process, oneDNN on
    print(*_relu_counts(sys.argv[1]))
