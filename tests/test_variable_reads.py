"""Reference variables: every op that reads a variable's buffer runs before the step writes it.

A TF1 reference variable's read (`v/read`, an Identity) aliases the buffer that the optimizer's
ApplyMomentum updates in place, so an op reading it after the update sees the new value: the
graph orders every such reader before the update (the fused gradient op reads gamma and gives
gamma's gradient in one op). The rewrite adds readers of gamma to the backward pass; if only a
control edge orders them, Grappler may drop it (an IdentityN split, a removed NoOp) and the
step trains with the updated gamma now and then: 1.1e-3 off one device, more often under load.
The check reads the step graph TensorFlow really runs (after Grappler, from RunMetadata), so it
holds whatever the load: each reader of a variable is an ancestor of each op that writes it.
"""

import networkx as nx
import pytest
import tensorflow as tf

from bnrewrite import rewrite_graph
from models import use_passes

tf1 = tf.compat.v1
TOWERS, BATCH, SIZE = 2, 2, 6
_WRITERS = ("Apply", "Assign", "ResourceApply")


def _graph(fused: bool) -> tuple[tf.Graph, set[str]]:
    """Towers on /device:GPU:k (soft-placed on one CPU: one partition graph), reference
    variables, tf.layers batch norm, Momentum on the averaged gradients; and the names of the
    trainable variables (the K moving-average updates of the graph as built race each other,
    TensorFlow's own race, which the rewrite leaves one of)."""
    graph = tf.Graph()
    with graph.as_default():
        optimizer = tf1.train.MomentumOptimizer(0.1, 0.9)
        grads, updates = [], []
        for k in range(TOWERS):
            with tf.device(f"/device:GPU:{k}"), tf.name_scope(f"tower_{k}") as scope, \
                    tf1.variable_scope("net", reuse=k > 0, use_resource=False):
                x = tf.random.stateless_normal([BATCH, SIZE, SIZE, 3], seed=[k, 1])
                net = tf1.layers.conv2d(x, 4, 3, padding="same", use_bias=False, name="conv")
                net = tf.nn.relu(tf1.layers.batch_normalization(net, training=True, fused=fused, name="bn"))
                logits = tf1.layers.dense(tf.reduce_mean(net, axis=[1, 2]), 3, name="logits")
                loss = tf.reduce_mean(tf.square(logits - 1.0))
                grads.append(optimizer.compute_gradients(loss))
                updates += tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope)
        averaged = [(tf.add_n([g for g, _ in pairs]) / TOWERS, pairs[0][1]) for pairs in zip(*grads)]
        tf.group(optimizer.apply_gradients(averaged), *updates, name="train_op")
        tf1.global_variables_initializer()
        return graph, {v.op.name for v in tf1.trainable_variables()}


def _unordered_reads(graph_def, variables: set[str]) -> tuple[list[str], set[str]]:
    """(readers of one of `variables` not ordered before an op of the step that writes it,
    all its readers) in the partition graph of one training step of `graph_def`."""
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    config = tf1.ConfigProto(device_count={"CPU": 1, "GPU": 0}, allow_soft_placement=True)
    with tf1.Session(graph=graph, config=config) as session:
        session.run("init")
        metadata = tf1.RunMetadata()
        session.run("train_op", options=tf1.RunOptions(output_partition_graphs=True), run_metadata=metadata)
    (step,) = metadata.partition_graphs
    nodes = {node.name: node for node in step.node}
    edges = nx.DiGraph()
    for node in step.node:
        edges.add_node(node.name)
        edges.add_edges_from((name.lstrip("^").split(":")[0], node.name) for name in node.input)
    bad, seen = [], set()
    for variable in variables:
        reads = [n for n in edges.successors(variable) if nodes[n].op == "Identity"]
        readers = {r for read in reads for r in edges.successors(read)}
        seen |= readers
        for writer in (n for n in edges.successors(variable) if nodes[n].op.startswith(_WRITERS)):
            before = nx.ancestors(edges, writer)
            bad += [f"{reader} reads {variable} unordered with {writer}" for reader in sorted(readers - before - {writer})]
    return bad, seen


@pytest.mark.parametrize("form", ["fused", "fused_passes", "unfused"])
def test_every_read_of_a_reference_variable_runs_before_its_update(form, monkeypatch):
    if form == "fused_passes":
        use_passes(monkeypatch)
    graph, trainable = _graph(fused=form != "unfused")
    built = graph.as_graph_def()
    as_built, _ = _unordered_reads(built, trainable)
    assert as_built == []  # TensorFlow's own graph keeps the order
    unordered, readers = _unordered_reads(rewrite_graph(built, backend="local").graph_def, trainable)
    added = readers - {node.name for node in built.node}
    assert added or form == "unfused"  # the check can fail: the rewrite's own ops read gamma
    assert unordered == [], unordered
