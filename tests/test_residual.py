"""A residual block, against the one-device oracle: batch-norm layers that run side by side.

The main branch (conv-BN-relu-conv-BN) and the projection shortcut (conv1x1-BN) of a ResNet
block do not depend on each other, so each tower may reach their all-reduces in either
order; the rewrite chains them in one order on every device (checked on the NCCL rewrite that
tests/test_nccl_on_cpu.py trains). Built with tf_keras's legacy layers (fused, unfused, and
batch renormalization), towers in `tower_k` scopes on `/cpu:k`, variables shared: resource
variables, and the reference variables (VariableV2, Assign*) of graphs exported by TensorFlow
1.x. Also tf_keras's own (non-legacy) layers in a TF1 graph.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

from bnrewrite import NoBatchNormError, UnsyncedLayerError, rewrite_graph
from bnrewrite.rewrite.collectives import COLLECTIVE_OPS
from models import Built, assert_synced, train

tf1 = tf.compat.v1
IMAGE, CHANNELS, CLASSES, STEPS = 6, 3, 4, 3
#: (layer, input channels, output channels, kernel size) of every convolution.
CONVS = [("stem", CHANNELS, 8, 3), ("a1", 8, 8, 3), ("a2", 8, 16, 3), ("proj", 8, 16, 1)]
BN_LAYERS = ["net/stem_bn", "net/a1_bn", "net/a2_bn", "net/proj_bn"]


def _initial(name: str, shape: tuple) -> np.ndarray:
    rng = np.random.default_rng(sum(map(ord, name)))
    return (rng.normal(size=shape) / np.sqrt(np.prod(shape[:-1]))).astype(np.float32)


def _logits(x, kind: str, ghost: tuple[str, ...], resource: bool):
    from tf_keras.src.legacy_tf_layers import convolutional, core, normalization

    def conv_bn(h, name, relu=True):
        _, c_in, c_out, size = next(c for c in CONVS if c[0] == name)
        h = convolutional.conv2d(h, c_out, size, padding="same", use_bias=False, name=name,
                                 kernel_initializer=tf1.constant_initializer(_initial(name, (size, size, c_in, c_out))))
        h = normalization.batch_normalization(h, training=True, fused=kind == "fused" and name not in ghost,
                                              renorm=kind == "renorm", virtual_batch_size=2 if name in ghost else None,
                                              momentum=0.9, name=f"{name}_bn")
        return tf.nn.relu(h) if relu else h

    with warnings.catch_warnings(), tf1.variable_scope("net", reuse=tf1.AUTO_REUSE, use_resource=resource):
        warnings.simplefilter("ignore")
        h = conv_bn(x, "stem")
        main = conv_bn(conv_bn(h, "a1"), "a2", relu=False)
        h = tf.nn.relu(main + conv_bn(h, "proj", relu=False))
        return core.dense(tf.reduce_mean(h, [1, 2]), CLASSES, name="dense",
                          kernel_initializer=tf1.constant_initializer(_initial("dense", (16, CLASSES))))


def build_block(towers: int, batch: int, kind: str, device: str = "cpu", ghost: tuple[str, ...] = (),
           resource: bool = True) -> Built:
    """ghost: the convolutions whose batch norm uses virtual batches of 2 (ghost batch norm);
    resource=False: reference variables."""
    graph = tf.Graph()
    with graph.as_default():
        opt = tf1.train.MomentumOptimizer(0.1, 0.9)
        inputs, losses, grads = [], [], []
        for k in range(towers):
            with tf.device(f"/{device}:{k}"), tf.name_scope(f"tower_{k}"):
                images = tf1.placeholder(tf.float32, [batch, IMAGE, IMAGE, CHANNELS], name="images")
                labels = tf1.placeholder(tf.int32, [batch], name="labels")
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=labels, logits=_logits(images, kind, ghost, resource)), name="loss")
                grads.append(opt.compute_gradients(loss))
            inputs.append((images.name, labels.name))
            losses.append(loss)
        with tf.device(f"/{device}:0"):
            averaged = [(tf.add_n([g for g, _ in per_var]) / towers, per_var[0][1]) for per_var in zip(*grads)]
            loss = tf.identity(tf.add_n(losses) / towers, name="total_loss")
        train_op = tf.group(opt.apply_gradients(averaged), *tf1.get_collection(tf1.GraphKeys.UPDATE_OPS), name="train_op")
        init = tf1.global_variables_initializer()
        with tf.name_scope("readout"):
            variables = {v.op.name: v.value().name for v in tf1.global_variables()}
    return Built(graph=graph, train_op=train_op.name, loss=loss.name, inputs=inputs, init=init.name, variables=variables)


def block_batches(towers: int, batch: int) -> list:
    rng = np.random.default_rng(7)
    n = towers * batch
    # Towers see differently scaled images, so per-tower statistics are far from the global ones.
    scale = np.repeat(1.0 + np.arange(towers), batch)[:, None, None, None]
    return [((rng.normal(size=(n, IMAGE, IMAGE, CHANNELS)) * scale).astype(np.float32),
             rng.integers(0, CLASSES, n).astype(np.int32)) for _ in range(STEPS)]


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
@pytest.mark.parametrize("kind", ["fused", "unfused", "renorm"])
def test_residual_block_trains_like_one_device(kind, resource):
    """renorm: batch renormalization (unfused), whose r and d read the renorm_mean and
    renorm_stddev it then updates, and whose moving_variance is set from moving_stddev once
    that is updated: one update of each per step, after every tower's r and d."""
    k, b = 3, 2
    built = build_block(k, b, kind, resource=resource)
    result = rewrite_graph(built.graph, backend="collective")
    assert [row.layer for row in result.report.layers] == BN_LAYERS and not result.report.skipped
    statistics = {"moving_mean", "moving_variance"} | ({"renorm_mean", "renorm_stddev", "moving_stddev"} if kind == "renorm" else set())
    nodes = {n.name: n for n in built.graph.as_graph_def().node}
    for row in result.report.layers:
        assert sorted(_written(row, nodes)) == sorted(statistics)
    if kind == "renorm":  # the kept update of renorm_mean and renorm_stddev waits for every tower's r and d
        out = {n.name: n for n in result.graph_def.node}
        for update in (u for row in result.report.layers for u in row.updates_kept if "/renorm_" in out[u].input[0]):
            waited = {c[1:].split("/", 1)[0] for c in out[update].input if c.startswith("^")}
            assert waited == {f"tower_{i}" for i in range(1, k)}, update  # tower 0's own update waited already
    _check_oracle(f"residual {kind} {'resource' if resource else 'ref'}", built, result.graph_def,
                  build_block(1, k * b, kind, resource=resource), k, block_batches(k, b))


def _check_oracle(label: str, built: Built, graph_def, ref: Built, k: int, data: list) -> None:
    """The rewritten graph trains like `ref` on one device fed every example; `built` does not."""
    expected = train(ref.graph, ref, data, num_devices=1)
    synced, unsynced = (train(g, built, data, num_devices=k) for g in (graph_def, built.graph))
    assert_synced(f"{label} K={k}", synced, unsynced, expected, 2e-4)


def _written(row, nodes: dict) -> list[str]:
    """The variables the layer's kept updates write (last part of the name); `nodes`: the built
    graph's NodeDefs by name."""
    return [nodes[update].input[0].rsplit("/", 1)[1] for update in row.updates_kept]


def assert_one_order_on_every_device(graph_def) -> None:
    """Each device's all-reduces form one chain of control edges, and the layers (and phases)
    come in the same order on every device (checked on the NCCL rewrite that
    tests/test_nccl_on_cpu.py then trains)."""
    nodes = {n.name: n for n in graph_def.node}
    collectives = [n for n in graph_def.node if n.op in COLLECTIVE_OPS]
    per_device: dict[str, list] = {}
    for node in collectives:
        per_device.setdefault(node.device, []).append(node)
    orders = []
    for device, members in per_device.items():
        names = {n.name for n in members}
        successor = {}
        for node in members:
            for spec in node.input:
                if spec.startswith("^") and spec[1:] in names:
                    successor[spec[1:]] = node.name
        first = [n.name for n in members if n.name not in successor.values()]
        assert len(first) == 1, (device, first)
        chain = [first[0]]
        while chain[-1] in successor:
            chain.append(successor[chain[-1]])
        assert len(chain) == len(members) == 2 * len(BN_LAYERS), device
        orders.append([nodes[name].attr["shared_name"].s for name in chain])
    assert len(orders) == 2 and orders[0] == orders[1]


def test_ghost_batch_norm_is_reported_not_synchronized():
    """virtual_batch_size normalizes each virtual batch with its own statistics on purpose (and
    one device would split its batch into other virtual batches): such a layer is left as it
    is, with the reason: the graph is refused, and with allow_unsynced the others are synchronized."""
    graph = build_block(2, 4, "unfused", ghost=("proj",)).graph
    with pytest.raises(UnsyncedLayerError, match="virtual_batch_size=2"):
        rewrite_graph(graph, backend="collective")
    result = rewrite_graph(graph, backend="collective", allow_unsynced=True)
    assert [row.layer for row in result.report.layers] == [n for n in BN_LAYERS if n != "net/proj_bn"]
    skipped = result.report.skipped
    assert len(skipped) == 2 and all("proj_bn" in s["node"] and "virtual_batch_size=2" in s["reason"] for s in skipped)
    with pytest.raises(NoBatchNormError, match="ghost batch normalization"):
        rewrite_graph(build_block(2, 4, "unfused", ghost=("stem", "a1", "a2", "proj")).graph)


def _keras_build(towers: int, batch: int, fused: bool) -> Built:
    """tf_keras (not legacy) layers called per tower in a TF1 graph: one layer object shared by
    the towers, its moving-average updates taken from `layer.updates` into the train_op."""
    import tf_keras

    graph = tf.Graph()
    with graph.as_default():
        opt = tf1.train.MomentumOptimizer(0.1, 0.9)
        conv = tf_keras.layers.Conv2D(8, 3, padding="same", use_bias=False,
                                      kernel_initializer=tf1.constant_initializer(_initial("stem", (3, 3, CHANNELS, 8))))
        bn = tf_keras.layers.BatchNormalization(momentum=0.9, fused=fused)
        dense = tf_keras.layers.Dense(CLASSES, kernel_initializer=tf1.constant_initializer(_initial("dense", (8, CLASSES))))
        inputs, losses, grads = [], [], []
        for k in range(towers):
            with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"):
                images = tf1.placeholder(tf.float32, [batch, IMAGE, IMAGE, CHANNELS], name="images")
                labels = tf1.placeholder(tf.int32, [batch], name="labels")
                logits = dense(tf.reduce_mean(tf.nn.relu(bn(conv(images), training=True)), [1, 2]))
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits), name="loss")
                grads.append(opt.compute_gradients(loss))
            inputs.append((images.name, labels.name))
            losses.append(loss)
        with tf.device("/cpu:0"):
            averaged = [(tf.add_n([g for g, _ in per_var]) / towers, per_var[0][1]) for per_var in zip(*grads)]
            loss = tf.identity(tf.add_n(losses) / towers, name="total_loss")
        train_op = tf.group(opt.apply_gradients(averaged), *bn.updates, name="train_op")
        init = tf1.global_variables_initializer()
        with tf.name_scope("readout"):
            variables = {v.op.name: v.value().name for v in tf1.global_variables()}
    return Built(graph=graph, train_op=train_op.name, loss=loss.name, inputs=inputs, init=init.name, variables=variables)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_keras_layers_in_a_tf1_graph_train_like_one_device(fused):
    k, b = 2, 3
    built = _keras_build(k, b, fused)
    result = rewrite_graph(built.graph, backend="collective")
    assert len(result.report.layers) == 1 and len(result.report.layers[0].updates_kept) == 2
    _check_oracle(f"keras BatchNormalization {'fused' if fused else 'unfused'}", built, result.graph_def,
                  _keras_build(1, k * b, fused), k, block_batches(k, b))
