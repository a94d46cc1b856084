"""Moments over other axes: the legacy layer on a 2-D input (moments over the batch axis
only), against the one-device oracle, also with towers of unequal static batch sizes;
tf.nn.weighted_moments is reported as skipped; a moments site knows the scale and offset
variables of the normalization it feeds."""

import contextlib

import numpy as np
import pytest
import tensorflow as tf
from tf_keras.src.legacy_tf_layers.normalization import batch_normalization

from bnrewrite import rewrite_graph
from models import session_config

tf1 = tf.compat.v1
FEATURES, UNITS, STEPS, B = 5, 6, 3, 4


def _build(sizes: list[int], weighted: bool = False, tape: bool = False, dynamic: bool = False,
           under_updates: bool = False) -> tf.Graph:
    """A tower per size (its batch): x -> dense -> legacy batch norm (2-D: unfused, axes [0]) ->
    squared loss, each tower's weighted by its share so that their average is the mean over all;
    `tape`: each tower's gradients by tf.GradientTape; `dynamic`: x of unknown batch size;
    `under_updates`: the gradients taken under control_dependencies(UPDATE_OPS), the TF1 habit
    (every gradient op then also waits on the updates)."""
    k, total = len(sizes), sum(sizes)
    rng = np.random.default_rng(0)
    kernel0 = rng.normal(size=(FEATURES, UNITS)).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        opt = tf1.train.MomentumOptimizer(0.1, 0.9)
        grads, losses = [], []
        for i, batch in enumerate(sizes):
            with tf.device(f"/cpu:{i}"), tf.name_scope(f"tower_{i}"):
                x = tf1.placeholder(tf.float32, [None if dynamic else batch, FEATURES], name="x")
                with tf.GradientTape() if tape else contextlib.nullcontext() as recorded:
                    with tf1.variable_scope("net", reuse=tf1.AUTO_REUSE):
                        h = tf.matmul(x, tf1.get_variable("kernel", initializer=kernel0))
                        if weighted:
                            mean, var = tf.nn.weighted_moments(h, [0], tf.ones([batch, 1]))
                            y = tf.nn.batch_normalization(h, mean, var, None, None, 1e-3)
                        else:
                            y = batch_normalization(h, training=True, momentum=0.9)
                    loss = tf.multiply(tf.reduce_sum(tf.square(y - tf.range(UNITS, dtype=tf.float32))),
                                       k / (total * UNITS), name="loss")
                losses.append(loss)
                waits = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS) if under_updates else []
                with tf.control_dependencies(waits):
                    if tape:
                        variables = tf1.trainable_variables()
                        grads.append(list(zip(recorded.gradient(loss, variables), variables)))
                    else:
                        grads.append(opt.compute_gradients(loss))
        with tf.device("/cpu:0"):
            avg = [(tf.add_n([g for g, _ in gv]) / k, gv[0][1]) for gv in zip(*grads)]
            tf.identity(tf.add_n(losses) / k, name="total_loss")
        tf.group(opt.apply_gradients(avg), *tf1.get_collection(tf1.GraphKeys.UPDATE_OPS), name="train_op")
        tf1.global_variables_initializer()
    return graph


def _train(graph_like, sizes: list[int], data: list) -> dict:
    graph = graph_like if isinstance(graph_like, tf.Graph) else tf.Graph()
    if graph is not graph_like:
        with graph.as_default():
            tf1.import_graph_def(graph_like, name="")
    names = [n.name for n in graph.as_graph_def().node if n.op == "VarHandleOp"]
    with graph.as_default():
        reads = {name: tf1.raw_ops.ReadVariableOp(resource=graph.get_tensor_by_name(f"{name}:0"), dtype=tf.float32) for name in names}
    losses = []
    with tf1.Session(graph=graph, config=session_config(len(sizes))) as sess:
        sess.run("init")
        for x in data:
            feed = {f"tower_{i}/x:0": part for i, part in enumerate(np.split(x, np.cumsum(sizes)[:-1]))}
            losses.append(sess.run(["train_op", "total_loss:0"], feed)[1])
        values = sess.run(reads)
    values["loss"] = np.array(losses)
    return values


def _error(got: dict, want: dict) -> float:
    """Per-tensor relative error; the floor of 1e-2 keeps the kernel's momentum slot, which
    batch norm right after a linear layer leaves near 1e-3, from measuring round-off alone."""
    return max(np.max(np.abs(got[n] - want[n])) / max(np.max(np.abs(want[n])), 1e-2) for n in want)


@pytest.mark.parametrize("k", [2, 4])
def test_legacy_layer_on_2d_input(k):
    rng = np.random.default_rng(1)
    data = [(rng.normal(size=(k * B, FEATURES)) * np.repeat(1 + np.arange(k), B)[:, None]).astype(np.float32) for _ in range(STEPS)]
    _check_oracle([B] * k, data)


def test_towers_of_unequal_static_sizes():
    """Towers holding 2 and 6 examples (static shapes): each tower's local count weighs its
    gradients (the backward once counted 1 per tower, right only for equal towers)."""
    rng = np.random.default_rng(2)
    _check_oracle([2, 6], [(rng.normal(size=(8, FEATURES)) * 3 + 1).astype(np.float32) for _ in range(STEPS)])


@pytest.mark.parametrize("dynamic, under_updates", [(False, False), (True, False), (False, True)],
                         ids=["static", "dynamic", "under_updates"])
def test_legacy_layer_under_a_gradient_tape(dynamic, under_updates):
    """tf.GradientTape's gradients (ops named after the forward scope, no `mean_grad`): the
    moments' gradient entries are found by structure, towers of 2 and 6 examples."""
    rng = np.random.default_rng(3)
    _check_oracle([2, 6], [(rng.normal(size=(8, FEATURES)) * 3 + 1).astype(np.float32) for _ in range(STEPS)],
                  tape=True, dynamic=dynamic, under_updates=under_updates)


@pytest.mark.parametrize("kind", ["applied_twice", "chained", "two_streams"])
def test_one_device_tape_programs_are_no_towers(kind):
    """On one device, moments layers differentiated by one tape keep the tower rule's verdict
    (one gradient computation; chained layers), now that their gradients are found: bnrewrite
    run leaves them as they are."""
    from bnrewrite import NotReplicasError

    graph = tf.Graph()
    with graph.as_default():
        a, b = (tf1.placeholder(tf.float32, [4, FEATURES], name=name) for name in "ab")

        def net(x, scope):
            with tf1.variable_scope(scope, reuse=tf1.AUTO_REUSE):
                return batch_normalization(tf.matmul(x, tf1.get_variable("kernel", [FEATURES, UNITS])), training=True)

        with tf.GradientTape() as tape:
            if kind == "chained":
                out = net(tf.matmul(net(a, "l1"), tf.ones([UNITS, FEATURES])), "l2")
            else:
                out = net(a, "net") - net(b, "net" if kind == "applied_twice" else "other")
            loss = tf.reduce_mean(tf.square(out))
        variables = tf1.trainable_variables()
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            tf1.train.GradientDescentOptimizer(0.1).apply_gradients(zip(tape.gradient(loss, variables), variables))
    with pytest.raises(NotReplicasError, match="feeds batch norm" if kind == "chained" else "from one gradient computation"):
        rewrite_graph(graph)


def _check_oracle(sizes: list[int], data: list, **kwargs: bool) -> None:
    graph = _build(sizes, **kwargs)
    result = rewrite_graph(graph, backend="collective")
    assert [row.data_format for row in result.report.layers] == ["axes=0"]
    assert [len(row.gradients) for row in result.report.layers] == [len(sizes)]
    want = _train(_build([sum(sizes)], **kwargs), [sum(sizes)], data)
    synced, unsynced = _error(_train(result.graph_def, sizes, data), want), _error(_train(graph, sizes, data), want)
    print(f"2-D legacy, towers of {sizes} {kwargs}: synced {synced:.2e}, unsynced {unsynced:.2e}")
    assert unsynced > 1e-2
    assert synced < 2e-4


def test_weighted_moments_are_reported_as_skipped():
    graph = _build([B, B], weighted=True)
    with pytest.raises(Exception, match="no batch-norm op found"):
        rewrite_graph(graph)
    from bnrewrite.graph.index import Graph
    from bnrewrite.match.sites import scan

    skips = scan(Graph.from_graph_def(graph.as_graph_def())).skips
    assert len(skips) == 2 and all("weighted_moments" in s.reason for s in skips)


@pytest.mark.parametrize("affine", ["scale+offset", "offset", "scale", "none"])
def test_moments_sites_know_the_variables_their_normalization_reads(affine):
    """tf.nn.moments + tf.nn.batch_normalization, by hand, with resource variables read through
    reshapes: the site records the scale and offset variables (what groups a layer's copies
    across towers when their names do not line up), None where the layer has none."""
    from bnrewrite.graph.index import Graph
    from bnrewrite.match.sites import scan

    graph = tf.Graph()
    with graph.as_default(), tf1.variable_scope("bn"):
        x = tf1.placeholder(tf.float32, [B, 2, 2, 3], name="x")
        gamma = tf1.get_variable("gamma", initializer=np.ones(3, np.float32))
        beta = tf1.get_variable("beta", initializer=np.zeros(3, np.float32))
        mean, var = tf.nn.moments(x, [0, 1, 2])
        y = tf.nn.batch_normalization(
            x, tf.reshape(mean, [1, 1, 1, 3]), tf.reshape(var, [1, 1, 1, 3]),
            tf.reshape(beta, [1, 1, 1, 3]) if "offset" in affine else None,
            tf.reshape(gamma, [1, 1, 1, 3]) if "scale" in affine else None, 1e-3)
        tf1.gradients(tf.reduce_sum(y * y), [x])
    (site,) = scan(Graph.from_graph_def(graph.as_graph_def())).sites
    assert site.kind == "moments"
    assert site.scale_var == ("bn/gamma" if "scale" in affine else None)
    assert site.offset_var == ("bn/beta" if "offset" in affine else None)


def test_a_gradient_tape_of_unknown_form_is_refused_named():
    """tf.GradientTape names a gradient's ops after the forward op's scope (no `mean_grad`); its
    moments' gradients are found by structure (the oracle above). Where that structure is not
    there (here: the Sub that the SquaredDifference gradient makes no longer waits on the
    variance's gradient), the layer is refused, naming the tape, not synchronized in its forward
    pass alone (13.5 off one device on a scale of 267 in a 2-tower test, before); the fused layer
    beside it, whose gradient op is found by type, is synchronized with allow_unsynced."""
    from bnrewrite.errors import UnsyncedLayerError

    graph = tf.Graph()
    with graph.as_default():
        with tf1.variable_scope("net"):
            kernel = tf1.get_variable("kernel", initializer=np.eye(3, dtype=np.float32) + 0.1)
            gamma = tf1.get_variable("gamma", initializer=np.ones(3, np.float32))
            beta = tf1.get_variable("beta", initializer=np.zeros(3, np.float32))
        grads = []
        for i in range(2):
            with tf.device(f"/cpu:{i}"), tf.name_scope(f"tower_{i}"):
                x = tf1.placeholder(tf.float32, [None, 4, 4, 3], name="x")
                with tf.GradientTape() as tape:
                    h, _, _ = tf1.nn.fused_batch_norm(tf.tensordot(x, kernel, 1), gamma, beta, is_training=True)
                    mean, var = tf.nn.moments(h, [0, 1, 2])
                    y = tf.nn.batch_normalization(h, mean, var, None, None, 1e-3)
                    loss = tf.reduce_sum(tf.tanh(y))
                grads.append(tape.gradient(loss, [kernel, gamma, beta]))
        tf.group(*[tf.add_n(list(g)) for g in zip(*grads)], name="train_op")
    report = rewrite_graph(graph).report
    assert [row.op for row in report.layers] == ["FusedBatchNormV3", "Moments"]
    assert [len(row.gradients) for row in report.layers] == [2, 2]
    graph_def = graph.as_graph_def()
    for node in graph_def.node:
        if node.op == "Sub" and node.name.startswith("gradient_tape") and any(i.startswith("^") for i in node.input):
            kept = [i for i in node.input if not i.startswith("^")]
            del node.input[:]
            node.input.extend(kept)
    with pytest.raises(UnsyncedLayerError, match=r"tower_0/moments/mean was built by tf.GradientTape"):
        rewrite_graph(graph_def)
    report = rewrite_graph(graph_def, allow_unsynced=True).report
    assert [row.op for row in report.layers] == ["FusedBatchNormV3"]
    assert len(report.skipped) == 2 and all("GradientTape" in s["reason"] for s in report.skipped)
