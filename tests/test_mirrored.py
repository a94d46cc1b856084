"""Graphs built by tf.distribute.MirroredStrategy in graph mode, against the one-device oracle.

Estimator-era code trains with `MirroredStrategy.run` (or `extended.call_for_each_replica`,
what Estimator calls) and a tf.compat.v1 optimizer: replica 0's ops carry no prefix
(`bn1/FusedBatchNormV3`), replica k's live under `replica_k/`, and every variable has one copy
per replica (`bn1/gamma`, `bn1/gamma/replica_1`; the moving statistics are ON_READ variables
whose copies each replica updates itself). The optimizer sums the replicas' gradients and
updates every copy, so each replica's loss is scaled by 1/K. Synchronized batch norm must
make K replicas of B examples train like one device fed all K·B examples: the losses and
every replica's copy of every variable (weights, γ, β, Momentum slots, moving statistics)
equal to the one-device values. Replicas see differently scaled data (make_batches), so
unsynchronized batch norm is far off. tf_keras's own `BatchNormalization(synchronized=True)`
(not rewritten) checks the harness independently of bnrewrite.
"""

import functools
import warnings
from typing import Callable

import pytest
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops

from bnrewrite import rewrite_graph
from models import (BN_EPSILON, BN_MOMENTUM, FILTERS, LEARNING_RATE, NUM_CLASSES, OPTIMIZER_MOMENTUM, Built,
                    Result, Spec, assert_synced, image_shape, initial_values, kernel_gradients, kernel_moments, make_batches, train,
                    use_passes)

tf1 = tf.compat.v1
STEPS, BATCH = 3, 3
BN_LAYERS = ["bn1", "bn2"]
#: images -> logits, and the moving-average updates made so far.
Model = tuple[Callable[[tf.Tensor], tf.Tensor], Callable[[], list]]


def _model(kind: str, spec: Spec) -> Model:
    """conv3x3 -> BN -> relu -> global average pool -> BN -> relu -> dense, from initial_values(spec).

    kind: "legacy_fused"/"legacy_unfused", tf_keras's legacy `batch_normalization`, or
    "keras_fused"/"keras_unfused", its `BatchNormalization`: the first on the convolution's
    4-D output, fused or not, the second on the pooled 2-D features, unfused;
    "keras_synchronized": tf_keras's own cross-replica `BatchNormalization`, both unfused.
    Keras layers are made here, once, in the strategy's scope; legacy ones at every call."""
    init = {name: tf1.constant_initializer(value) for name, value in initial_values(spec).items()}
    if kind.startswith("legacy"):
        from tf_keras.src.legacy_tf_layers import convolutional, core, normalization

        def norm(h: tf.Tensor, name: str, fused: bool) -> tf.Tensor:
            return normalization.batch_normalization(
                h, training=True, fused=fused, momentum=BN_MOMENTUM, epsilon=BN_EPSILON, name=name,
                gamma_initializer=init[f"{name}/gamma"], beta_initializer=init[f"{name}/beta"])

        def legacy(images: tf.Tensor) -> tf.Tensor:
            h = convolutional.conv2d(images, FILTERS, 3, padding="same", use_bias=False, name="conv1",
                                     kernel_initializer=init["conv1/kernel"])
            h = tf.reduce_mean(tf.nn.relu(norm(h, "bn1", kind == "legacy_fused")), [1, 2])
            return core.dense(tf.nn.relu(norm(h, "bn2", False)), NUM_CLASSES, name="dense",
                              kernel_initializer=init["dense/kernel"], bias_initializer=init["dense/bias"])

        return legacy, lambda: tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)

    import tf_keras

    synchronized = kind == "keras_synchronized"
    conv = tf_keras.layers.Conv2D(FILTERS, 3, padding="same", use_bias=False, name="conv1",
                                  kernel_initializer=init["conv1/kernel"])
    norms = [tf_keras.layers.BatchNormalization(
        momentum=BN_MOMENTUM, epsilon=BN_EPSILON, fused=fused, synchronized=synchronized, name=name,
        gamma_initializer=init[f"{name}/gamma"], beta_initializer=init[f"{name}/beta"])
        for name, fused in (("bn1", kind == "keras_fused"), ("bn2", False))]
    dense = tf_keras.layers.Dense(NUM_CLASSES, name="dense", kernel_initializer=init["dense/kernel"],
                                  bias_initializer=init["dense/bias"])

    def keras(images: tf.Tensor) -> tf.Tensor:
        h = tf.reduce_mean(tf.nn.relu(norms[0](conv(images), training=True)), [1, 2])
        return dense(tf.nn.relu(norms[1](h, training=True)))

    return keras, lambda: [update for norm in norms for update in norm.updates]


def _all_reduce(kind: str, devices: list[str]) -> "cross_device_ops.CrossDeviceOps | None":
    """MirroredStrategy's default (ReductionToOneDevice on CPUs), except for tf_keras's
    synchronized layer: in graph mode, tf.custom_gradient (around its all-reduce) walks back
    from the reduced sum into every replica's inputs and fails on a variable outside the
    global collection ("Unsuccessful at finding variable conv1/kernel/replica_1"). With
    collective all-reduces each replica's sum takes only its own input."""
    if kind != "keras_synchronized":
        return None
    return cross_device_ops.CollectiveAllReduce(devices, len(devices), tf.distribute.experimental.CommunicationOptions())


def _build(kind: str, replicas: int, batch: int, entry: str = "run") -> Built:
    """`replicas` > 1: a MirroredStrategy over /cpu:0.. whose training step is built by
    `strategy.run` or (entry "call_for_each_replica") `strategy.extended.call_for_each_replica`;
    1: the same model and step on /cpu:0 without a strategy. Copies read as "name@replica_k"."""
    spec = Spec(towers=replicas, batch=batch)
    graph = tf.Graph()
    with graph.as_default(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        devices = [f"/cpu:{k}" for k in range(replicas)]
        strategy = tf.distribute.get_strategy()
        if replicas > 1:
            strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=_all_reduce(kind, devices))
        with strategy.scope(), tf.device(devices[0] if replicas == 1 else None):  # MirroredStrategy places replicas
            opt = tf1.train.MomentumOptimizer(LEARNING_RATE, OPTIMIZER_MOMENTUM)
            logits_of, updates = _model(kind, spec)

            def step() -> tuple:
                images = tf1.placeholder(tf.float32, image_shape(spec, batch), name="images")
                labels = tf1.placeholder(tf.int32, [batch], name="labels")
                before = set(updates())
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=labels, logits=logits_of(images)))
                # Only this replica's updates: the other replicas' run in their own steps.
                with tf.control_dependencies([u for u in updates() if u not in before]):
                    # The optimizer sums the replicas' gradients: the mean loss over all K·B examples.
                    minimize = opt.minimize(loss / tf.distribute.get_replica_context().num_replicas_in_sync)
                return images, labels, loss, minimize

            run = strategy.run if entry == "run" else strategy.extended.call_for_each_replica
            images, labels, losses, minimize = (strategy.experimental_local_results(t) for t in run(step))
        with tf.device(devices[0]):
            loss = tf.math.truediv(tf.add_n(losses), float(replicas), name="loss")
        train_op = tf.group(*minimize, name="train_op")
        init = tf1.global_variables_initializer()
        with tf.name_scope("readout"):
            copies = [strategy.experimental_local_results(v) for v in tf1.global_variables()]
            # Named after replica 0's copy: an ON_READ variable's own .op, here, is a new read.
            variables = {f"{per_replica[0].op.name}@replica_{k}": copy.value().name
                         for per_replica in copies for k, copy in enumerate(per_replica)}
    return Built(graph=graph, train_op=train_op.name, loss=loss.name, inputs=[(i.name, l.name) for i, l in zip(images, labels)],
                 init=init.name, variables=variables)


def _every_copy(reference: Result, replicas: int) -> Result:
    """The one-device values as the replicas must hold them: every copy equal to the one variable."""
    return Result(losses=reference.losses, variables={
        f"{name.rsplit('@', 1)[0]}@replica_{k}": value for name, value in reference.variables.items() for k in range(replicas)})


@functools.lru_cache(maxsize=None)
def _one_device(kind: str, replicas: int) -> Result:
    """`kind`'s model on one device fed the examples of `replicas` replicas, trained once per test
    process (several tests meet each kind and replica count; treat it as read-only)."""
    reference = _build(kind, 1, replicas * BATCH)
    return train(reference.graph, reference, make_batches(Spec(towers=replicas, batch=BATCH), STEPS), num_devices=1)


def _check_oracle(label: str, built: Built, synced_graph, unsynced: Built, reference: str) -> None:
    """`synced_graph` (built's graph or a rewrite of it) trains like the `reference` kind on one
    device fed every example in the losses and every copy of every variable; `unsynced` does not."""
    replicas = len(built.inputs)
    data = make_batches(Spec(towers=replicas, batch=BATCH), STEPS)
    expected = _every_copy(_one_device(reference, replicas), replicas)
    assert sorted(built.variables) == sorted(expected.variables)  # no copy left uncompared
    synced = train(synced_graph, built, data, num_devices=replicas)
    unsynced_result = train(unsynced.graph, unsynced, data, num_devices=replicas)
    assert_synced(f"{label} K={replicas}", synced, unsynced_result, expected, 1e-4)


# Not the full product: tf_keras's BatchNormalization builds the legacy layer's graph node for
# node today, and strategy.run calls call_for_each_replica; each legacy kind meets both replica
# counts and both entry points, each Keras kind one of them.
# path: the all-reduce backend, or "passes": local with the elementwise passes where the fused kernels would serve.
@pytest.mark.parametrize(("kind", "replicas", "entry", "path"), [
    ("legacy_fused", 2, "run", "collective"), ("legacy_fused", 4, "call_for_each_replica", "collective"),
    ("legacy_unfused", 2, "call_for_each_replica", "collective"), ("legacy_unfused", 4, "run", "collective"),
    ("keras_fused", 2, "run", "collective"), ("keras_unfused", 4, "call_for_each_replica", "collective"),
    ("legacy_fused", 4, "run", "local"), ("legacy_unfused", 2, "run", "local"), ("keras_fused", 2, "run", "local"),
    ("legacy_fused", 2, "call_for_each_replica", "passes"), ("keras_fused", 4, "run", "passes"),
])
def test_mirrored_strategy_trains_like_one_device(kind: str, replicas: int, entry: str, path: str, monkeypatch) -> None:
    built = _build(kind, replicas, BATCH, entry)
    if path == "passes":
        use_passes(monkeypatch)
    result = rewrite_graph(built.graph, backend="collective" if path == "collective" else "local")
    if path == "passes":
        assert not kernel_gradients(result.graph_def) and not kernel_moments(result.graph_def)
    report = result.report
    assert "replicated variables" in report.layout and not report.skipped
    assert [row.layer for row in report.layers] == BN_LAYERS
    kept = {node.name: node for node in result.graph_def.node}
    for row in report.layers:
        # One site in each replica: replica 0's unprefixed, replica k's under replica_k/.
        scopes = [site.split("/", 1)[0] for site in row.sites]
        assert sorted(scopes) == sorted([row.layer, *(f"replica_{k}" for k in range(1, replicas))]), row.sites
        # Every replica keeps the update of its own copy of each moving statistic, and only one.
        written = sorted(kept[update].input[0] for update in row.updates_kept)
        assert written == sorted(f"{row.layer}/{statistic}" + (f"/replica_{k}" if k else "")
                                 for statistic in ("moving_mean", "moving_variance") for k in range(replicas))
    _check_oracle(f"{kind} {entry} {path}", built, result.graph_def, built, kind)


def test_keras_synchronized_batch_norm_trains_like_one_device() -> None:
    """The harness without bnrewrite: tf_keras's cross-replica BatchNormalization (not
    rewritten) on the replicas trains like its plain layer on one device fed every example;
    the plain layer on the replicas does not. When this fails, the harness is wrong."""
    replicas = 2
    built = _build("keras_synchronized", replicas, BATCH)
    _check_oracle("keras synchronized", built, built.graph, _build("keras_unfused", replicas, BATCH), "keras_unfused")
