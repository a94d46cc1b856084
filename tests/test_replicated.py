"""Replicated variables (the TF benchmark's --variable_update=replicated), against the one-device oracle.

Towers that share no variable: tower i runs on its own device under name scope `tower_i`
and variable scope `v<i>`, with its own copy of every variable (weights, gamma/beta, moving
statistics, Momentum slots), all starting equal. Each variable's gradient is summed over
the towers' copies, divided by K, and a copy of that average is applied on every tower's
device to that tower's copy. Since no variable ties a layer's copies together, they must be
lined up some other way; this checks that they are lined up right (the ResNet block's
main-branch and shortcut batch norms side by side; identical parallel branches in towers
named alpha/beta/omega), that a layer one tower lacks is skipped and the rest synchronized,
and that every tower's copy of every variable ends where one device fed the K*B examples
ends -- with the train_op running every tower's moving-average updates or tower 0's only
(the benchmark's way: the other towers' moving statistics then stay at their initial values
in either graph). Also the NCCL all-reduces of GPU-placed replicas (built, never run).
"""

from __future__ import annotations

import functools
import warnings
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import tensorflow as tf

from bnrewrite import UnsyncedLayerError, rewrite_graph
from bnrewrite.rewrite.report import Report
from models import Built, Result, Spec, assert_synced, kernel_gradients, kernel_moments, make_batches, train, use_passes

tf1 = tf.compat.v1
CLASSES, STEPS, BATCH = 4, 3, 2
CPU, GPU = "/cpu:{}", "/replica:0/task:0/device:GPU:{}"
#: The batch-norm layers of the ResNet block, and their moving statistics' initial values.
BLOCK_BN = ["stem_bn", "a1_bn", "a2_bn", "proj_bn"]
INITIAL = {"moving_mean": 0.0, "moving_variance": 1.0}
#: (images, tower index) -> logits, called inside the tower's device, name and variable scopes.
Model = Callable[[tf.Tensor, int], tf.Tensor]
#: Per tower: (name scope, variable scope).
Towers = Sequence[tuple[str, str]]


def _numbered(k: int) -> list[tuple[str, str]]:
    return [(f"tower_{i}", f"v{i}") for i in range(k)]


def _constant(key: str, shape: tuple[int, ...]):
    """The same initial value in every tower and in the reference, different for each key."""
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    return tf1.constant_initializer((rng.normal(size=shape) / np.sqrt(np.prod(shape[:-1]))).astype(np.float32))


def _conv_bn(h: tf.Tensor, key: str, c_out: int, size: int, fused: bool, *, named: bool = True, bn: bool = True,
             relu: bool = True) -> tf.Tensor:
    """conv (no bias) -> batch norm -> relu with tf_keras's legacy layers; named=False leaves the
    layer names to tf_keras (conv2d, conv2d_1, ..., batch_normalization, batch_normalization_1, ...)."""
    from tf_keras.src.legacy_tf_layers import convolutional, normalization

    h = convolutional.conv2d(h, c_out, size, padding="same", use_bias=False, name=key if named else None,
                             kernel_initializer=_constant(key, (size, size, h.shape[-1], c_out)))
    if bn:
        h = normalization.batch_normalization(h, training=True, fused=fused, momentum=0.9,
                                              name=f"{key}_bn" if named else None)
    return tf.nn.relu(h) if relu else h


def _dense(h: tf.Tensor) -> tf.Tensor:
    from tf_keras.src.legacy_tf_layers import core

    return core.dense(tf.reduce_mean(h, [1, 2]), CLASSES, name="dense",
                      kernel_initializer=_constant("dense", (h.shape[-1], CLASSES)))


def _block(fused: bool, a1_bn_missing_in: int | None = None) -> Model:
    """Stem conv-BN-relu; main branch conv-BN-relu-conv-BN beside the projection shortcut
    conv1x1-BN; add, relu, global mean, dense. Tower `a1_bn_missing_in` has no a1_bn."""

    def logits(images: tf.Tensor, tower: int) -> tf.Tensor:
        h = _conv_bn(images, "stem", 8, 3, fused)
        main = _conv_bn(_conv_bn(h, "a1", 8, 3, fused, bn=tower != a1_bn_missing_in), "a2", 16, 3, fused, relu=False)
        return _dense(tf.nn.relu(main + _conv_bn(h, "proj", 16, 1, fused, relu=False)))

    return logits


def _twins(images: tf.Tensor, tower: int) -> tf.Tensor:
    """A stem, then two branches identical but for their weights, added: every layer named by tf_keras."""
    h = _conv_bn(images, "stem", 8, 3, True, named=False)
    return _dense(_conv_bn(h, "left", 8, 3, True, named=False) + _conv_bn(h, "right", 8, 3, True, named=False))


def _build(model: Model, towers: Towers, batch: int, *, device: str = CPU, every_tower_updates: bool = True,
           resource: bool = True) -> Built:
    """The replicated graph; `variables` maps each variable's name (`v<i>/...`) to its value.
    every_tower_updates=False: the train_op runs tower 0's UPDATE_OPS only."""
    graph = tf.Graph()
    with graph.as_default(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = tf1.train.MomentumOptimizer(0.1, 0.9)
        inputs, losses, updates = [], [], []
        copies: dict[str, list[tuple[tf.Tensor, tf.Variable]]] = defaultdict(list)  # name without the tower's scope
        for i, (name_scope, variable_scope) in enumerate(towers):
            known = len(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))
            with tf.device(device.format(i)), tf.name_scope(name_scope), \
                    tf1.variable_scope(variable_scope, use_resource=resource):
                images = tf1.placeholder(tf.float32, [batch, 6, 6, 3], name="images")
                labels = tf1.placeholder(tf.int32, [batch], name="labels")
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=labels, logits=model(images, i)), name="loss")
                own = tf1.trainable_variables(f"{variable_scope}/")
                for grad, var in opt.compute_gradients(loss, var_list=own):
                    copies[var.op.name.split("/", 1)[1]].append((grad, var))
            if every_tower_updates or i == 0:
                updates += tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)[known:]
            inputs.append((images.name, labels.name))
            losses.append(loss)
        averaged = []
        for pairs in copies.values():
            for _, var in pairs:  # the average on every tower's device, for that tower's copy
                with tf.device(var.device):
                    averaged.append((tf.add_n([grad for grad, _ in pairs]) / len(towers), var))
        with tf.device(device.format(0)):
            loss = tf.identity(tf.add_n(losses) / len(towers), name="total_loss")
        train_op = tf.group(opt.apply_gradients(averaged), *updates, name="train_op")
        init = tf1.global_variables_initializer()
        with tf.name_scope("readout"):
            variables = {v.op.name: v.value().name for v in tf1.global_variables()}
    return Built(graph=graph, train_op=train_op.name, loss=loss.name, inputs=inputs, init=init.name, variables=variables)


def _expected(reference: Result, towers: Towers, every_tower_updates: bool) -> Result:
    """Where every tower's copies should end: at the one-device values, but for the moving
    statistics of towers whose updates the train_op leaves out, which keep their initial values."""
    first = towers[0][1]
    variables = {}
    for i, (_, scope) in enumerate(towers):
        for name, value in reference.variables.items():
            role = name.removeprefix(f"{first}/")
            statistic = role.rsplit("/", 1)[1]
            stale = statistic in INITIAL and not (every_tower_updates or i == 0)
            variables[f"{scope}/{role}"] = np.full_like(value, INITIAL[statistic]) if stale else value
    return Result(losses=reference.losses, variables=variables)


#: The models by name, so that what is built and trained from them can be cached.
MODELS: dict[str, Model] = {"fused": _block(True), "unfused": _block(False), "twins": _twins}


@functools.cache
def _data(k: int) -> list:
    """Each tower's slice scaled and shifted its own way. Seed 1: with seed 0 (K=4, unfused), one
    input of the last relu is 6e-8 at step 3, and round-off flips its gradient (1.9e-2)."""
    return make_batches(Spec(towers=k, batch=BATCH, seed=1), STEPS)


@functools.cache
def _built(model: str, towers: tuple[tuple[str, str], ...], every_tower_updates: bool = True,
           resource: bool = True) -> Built:
    """_build of the named model with B examples per tower, once per process (read-only)."""
    return _build(MODELS[model], towers, BATCH, every_tower_updates=every_tower_updates, resource=resource)


@functools.cache
def _one_device(model: str, first: tuple[str, str], k: int, resource: bool) -> Result:
    """The model on tower `first` alone fed all K*B examples, trained once per process (read-only)."""
    ref = _build(MODELS[model], [first], k * BATCH, resource=resource)
    return train(ref.graph, ref, _data(k), num_devices=1)


@functools.cache
def _as_built(model: str, towers: tuple[tuple[str, str], ...], every_tower_updates: bool, resource: bool) -> Result:
    """The un-rewritten towers trained, once per process (read-only)."""
    built = _built(model, towers, every_tower_updates, resource)
    return train(built.graph, built, _data(len(towers)), num_devices=len(towers))


def _check_oracle(label: str, model: str, towers: Towers, graph_def: tf1.GraphDef, *,
                  every_tower_updates: bool = True, resource: bool = True) -> None:
    """Every tower's copy of every variable, and the losses, of the rewritten graph match one
    device fed all K*B examples; the un-rewritten graph does not."""
    k, towers = len(towers), tuple(towers)
    expected = _expected(_one_device(model, towers[0], k, resource), towers, every_tower_updates)
    synced = train(graph_def, _built(model, towers, every_tower_updates, resource), _data(k), num_devices=k)
    unsynced = _as_built(model, towers, every_tower_updates, resource)
    assert_synced(f"{label} K={k}", synced, unsynced, expected, 1e-4)


def _assert_lined_up(report: Report, towers: Towers, layers: list[str]) -> None:
    """One row per layer, its i-th site in tower i, the same layer in every tower."""
    seen = []
    for row in report.layers:
        parts = [site.split("/", 2) for site in row.sites]
        assert [tuple(p[:2]) for p in parts] == list(towers), row.sites
        assert len({p[2] for p in parts}) == 1, row.sites
        seen.append(parts[0][2].split("/", 1)[0])
    assert sorted(seen) == sorted(layers), [row.sites for row in report.layers]


def _assert_updates_kept(report: Report, graph_def: tf1.GraphDef, towers: Towers, every_tower_updates: bool) -> None:
    """A layer's kept updates write its own copies of the moving statistics, at least those the
    train_op runs (no tower's update is taken for a duplicate of another's)."""
    nodes = {n.name: n for n in graph_def.node}
    for row in report.layers:
        layer = row.sites[0].split("/")[2]
        copies = [{f"{scope}/{layer}/{s}" for s in INITIAL} for _, scope in towers]
        written = {nodes[update].input[0] for update in row.updates_kept}
        trained = set().union(*(copies if every_tower_updates else copies[:1]))
        assert trained <= written <= set().union(*copies), written


@pytest.mark.parametrize(
    "k, fused, every_tower_updates, resource, path",
    [
        pytest.param(2, True, True, True, "collective", id="K2-fused-every_tower"),
        pytest.param(2, False, False, True, "collective", id="K2-unfused-tower0"),
        pytest.param(4, True, False, True, "collective", id="K4-fused-tower0"),
        pytest.param(4, False, True, False, "collective", id="K4-unfused-every_tower-ref"),
        pytest.param(8, True, True, True, "collective", id="K8-fused-every_tower"),
        pytest.param(8, False, False, True, "collective", id="K8-unfused-tower0"),
        pytest.param(4, False, True, False, "local", id="K4-unfused-every_tower-ref-local"),
        pytest.param(4, True, True, False, "local", id="K4-fused-every_tower-ref-local"),
        pytest.param(2, True, False, True, "passes", id="K2-fused-tower0-passes"),
    ],
)
def test_replicated_block_trains_like_one_device(k: int, fused: bool, every_tower_updates: bool, resource: bool,
                                                 path: str, monkeypatch):
    """path: the all-reduce backend, or "passes": local with the elementwise passes where the fused kernels would serve."""
    towers = _numbered(k)
    model = "fused" if fused else "unfused"
    built = _built(model, tuple(towers), every_tower_updates, resource)
    if path == "passes":
        use_passes(monkeypatch)
    result = rewrite_graph(built.graph, backend="collective" if path == "collective" else "local")
    if path == "passes":
        assert not kernel_gradients(result.graph_def) and not kernel_moments(result.graph_def)
    assert "replicated variables" in result.report.layout
    assert not result.report.skipped
    _assert_lined_up(result.report, towers, BLOCK_BN)
    _assert_updates_kept(result.report, result.graph_def, towers, every_tower_updates)
    label = (f"replicated {'fused' if fused else 'unfused'} {'resource' if resource else 'ref'}, "
             f"{'every tower' if every_tower_updates else 'tower 0'} updates")
    _check_oracle(label, model, towers, result.graph_def, every_tower_updates=every_tower_updates, resource=resource)


def test_layer_missing_in_one_tower_refuses_the_graph_or_with_allow_unsynced_is_skipped():
    towers = _numbered(3)
    graph = _build(_block(True, a1_bn_missing_in=2), towers, BATCH).graph
    with pytest.raises(UnsyncedLayerError, match="a1_bn/FusedBatchNormV3: missing from tower"):
        rewrite_graph(graph, backend="collective")  # refused unless allow_unsynced
    result = rewrite_graph(graph, backend="collective", allow_unsynced=True)
    _assert_lined_up(result.report, towers, ["stem_bn", "a2_bn", "proj_bn"])
    skipped = result.report.skipped
    print("a1_bn skipped:", {s["reason"] for s in skipped})
    assert sorted(s["node"] for s in skipped) == [f"{t}/{v}/a1_bn/FusedBatchNormV3" for t, v in towers[:-1]]
    assert all(s["reason"] for s in skipped)
    # In training mode: left exactly as it was; the synced ones normalize in inference mode.
    training = {n.name: n.attr["is_training"].b for n in result.graph_def.node if n.op == "FusedBatchNormV3"}
    assert all(training[s["node"]] for s in skipped)
    for row in result.report.layers:  # replaced by the synchronized forward
        assert row.collectives and not any(training.get(site, False) for site in row.sites), row.sites


def test_identical_parallel_layers_are_paired_right_or_skipped():
    """Towers alpha, beta, omega (variable scopes w_alpha...) follow no naming convention, and
    each has two branches that only their weights tell apart: a wrong pairing mixes the
    statistics of different branches, which the oracle sees."""
    towers = [(name, f"w_{name}") for name in ("alpha", "beta", "omega")]
    result = rewrite_graph(_built("twins", tuple(towers)).graph, backend="collective", allow_unsynced=True)
    branches = ["batch_normalization_1", "batch_normalization_2"]
    skipped = result.report.skipped
    print("branches skipped:", {s["reason"] for s in skipped} if skipped else "no")
    if skipped:
        assert sorted(s["node"] for s in skipped) == sorted(
            f"{t}/{v}/{layer}/FusedBatchNormV3" for t, v in towers for layer in branches)
        assert all(s["reason"] for s in skipped)
        _assert_lined_up(result.report, towers, ["batch_normalization"])
    else:
        _check_oracle("identical parallel branches", "twins", towers, result.graph_def)
        _assert_lined_up(result.report, towers, ["batch_normalization", *branches])


def test_nccl_all_reduces_run_on_each_replicas_gpu():
    """GPU-placed replicas (only built: no GPU here): every all-reduce sits on the GPU of its
    tower's batch norm and joins exactly one member per GPU."""
    k = 4
    towers = _numbered(k)
    result = rewrite_graph(_build(_block(True), towers, BATCH, device=GPU).graph, backend="nccl")
    assert "replicated variables" in result.report.layout
    _assert_lined_up(result.report, towers, BLOCK_BN)
    devices = [GPU.format(i) for i in range(k)]
    nodes = {n.name: n for n in result.graph_def.node}
    for row in result.report.layers:
        assert [nodes[site].device for site in row.sites] == devices
    members: dict[bytes, list[str]] = defaultdict(list)
    nccl = [n for n in result.graph_def.node if n.op == "NcclAllReduce"]
    for node in nccl:
        assert node.attr["num_devices"].i == k, node.name
        members[node.attr["shared_name"].s].append(node.device)
    assert nccl and len(nccl) == sum(row.collectives for row in result.report.layers)
    assert all(sorted(group) == devices for group in members.values()), members
