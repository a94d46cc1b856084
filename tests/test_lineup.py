"""Lining up layers across towers that share no variable (bnrewrite/match/lineup.py).

Replicated-variable graphs give every tower its own copy of every variable; copies are
paired by the roles of their variables' names, else by structure and dependency order, and
copies that nothing in the graph tells apart are skipped, never paired by a guess. Whether
the pairings train like one device is tested by the oracle tests (test_mirrored.py,
test_replicated.py); here: which sites end up together, and what is refused.
"""

import functools
import warnings

import pytest
import tensorflow as tf

from bnrewrite import TowerMismatchError, UnsyncedLayerError, rewrite_graph
from bnrewrite.match.lineup import role
import structure

tf1 = tf.compat.v1


@pytest.mark.parametrize("name, expected", [
    ("v1/cg/bn0/gamma", "cg/bn0/gamma"),
    ("bn/gamma/replica_1", "bn/gamma"),
    ("tower_3/v3/bn/FusedBatchNormV3", "bn/FusedBatchNormV3"),
    ("replica_2/model/conv1_bn/moments/mean", "model/conv1_bn/moments/mean"),
    ("batch_normalization_1/gamma", "batch_normalization_1/gamma"),  # a layer's own number stays
    ("clone_0/net/bn/beta", "net/bn/beta"),
])
def test_role_takes_tower_and_replica_parts_out(name, expected):
    assert role(name) == expected


def test_role_drops_the_tower_scope_when_towers_are_scopes():
    assert role("alpha/net/bn/Mean", "alpha") == "net/bn/Mean"
    assert role("alpha/net/bn/Mean") == "alpha/net/bn/Mean"


def _towers(scopes: list[str], layers: list[str], parallel: tuple[str, ...] = (), skip: dict | None = None,
            variable_scopes: list[str | None] | None = None) -> tf.Graph:
    """Towers on /cpu:k under name scope scopes[k] and variable scope variable_scopes[k]
    (default "w_" + scopes[k]: names that follow no convention bnrewrite knows; None: a new
    scope named after "model", which TensorFlow uniquifies: model, model_1, ...), each a chain
    of conv+BN `layers`; `parallel`: layers that read the previous chain layer's output side by
    side (summed for the next one); `skip`: tower index -> layers whose BN that tower lacks."""
    from tf_keras.src.legacy_tf_layers import convolutional, normalization

    skip = skip or {}
    variable_scopes = variable_scopes or [f"w_{scope}" for scope in scopes]
    graph = tf.Graph()
    with graph.as_default(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = tf1.train.GradientDescentOptimizer(0.1)
        grads = []
        for k, (scope, variable_scope) in enumerate(zip(scopes, variable_scopes)):
            with tf.device(f"/cpu:{k}"), tf.name_scope(scope), tf1.variable_scope(variable_scope, default_name="model"):
                h = tf1.placeholder(tf.float32, [2, 4, 4, 3], name="images")
                branches: list = []
                for layer in layers:
                    x = h if layer in parallel or not branches else tf.add_n(branches)
                    y = convolutional.conv2d(x, 4, 3, padding="same", use_bias=False, name=f"{layer}_conv")
                    if layer not in skip.get(k, ()):
                        y = normalization.batch_normalization(y, training=True, name=f"{layer}_bn")
                    if layer in parallel:
                        branches.append(y)
                    else:
                        h, branches = y, []
                loss = tf.reduce_mean(tf.square(tf.add_n(branches) if branches else h))
                grads.append(opt.compute_gradients(loss, tf1.trainable_variables(tf1.get_variable_scope().name)))
        ops = _apply_replicated(opt, grads)
        tf.group(*ops, *tf1.get_collection(tf1.GraphKeys.UPDATE_OPS), name="train_op")
    return graph


def _apply_replicated(opt, grads: list) -> list:
    """tf_cnn_benchmarks' replicated variables: each copy gets the mean of its role's gradients
    over the towers that have it (a role: the variable's name below the tower's own scope),
    so the towers train one model (independent copies would be refused)."""
    by_role: dict = {}
    for tower in grads:
        for grad, var in tower:
            by_role.setdefault(var.op.name.split("/", 1)[1], []).append((grad, var))
    ops = []
    for pairs in by_role.values():
        mean = tf.add_n([g for g, _ in pairs]) / len(pairs)
        ops.append(opt.apply_gradients([(mean, var) for _, var in pairs]))
    return ops


def _layer_of(site: str) -> str:
    return site.split("/")[2]  # name scope / variable scope / layer_bn / ...


def test_unconventional_names_are_paired_by_structure_and_order():
    """A chain of identical conv+BN layers: same structure, told apart by their order."""
    result = rewrite_graph(_towers(["alpha", "beta", "gamma"], ["a", "b", "c"]), backend="collective")
    report = result.report
    assert not report.skipped and report.layout == "replicated variables: one copy per tower"
    assert [{_layer_of(s) for s in row.sites} for row in report.layers] == [{"a_bn"}, {"b_bn"}, {"c_bn"}]
    assert all(row.lined_up_by == "structure" and len(row.sites) == 3 for row in report.layers)
    assert "lined up by" in str(report)


def _partial(graph, reason: str):
    """The graph is refused with `reason` in the message; allow_unsynced gives the partial rewrite."""
    with pytest.raises(UnsyncedLayerError, match=reason):
        rewrite_graph(graph, backend="collective")
    return rewrite_graph(graph, backend="collective", allow_unsynced=True)


def test_parallel_twins_nothing_tells_apart_are_skipped_not_guessed():
    """Two identical branches side by side, in towers whose names pair nothing: refused with
    the reason; with allow_unsynced the layers before and after are still synchronized."""
    result = _partial(_towers(["alpha", "beta"], ["stem", "left", "right", "head"], parallel=("left", "right")),
                      "do not depend on each other")
    assert [{_layer_of(s) for s in row.sites} for row in result.report.layers] == [{"stem_bn"}, {"head_bn"}]
    skipped = result.report.skipped
    assert {_layer_of(s["node"]) for s in skipped} == {"left_bn", "right_bn"} and len(skipped) == 4
    assert all("do not depend on each other" in s["reason"] for s in skipped)


def test_parallel_twins_with_conventional_names_are_paired_by_their_roles():
    graph = _towers(["tower_0", "tower_1"], ["stem", "left", "right"], parallel=("left", "right"), variable_scopes=["v0", "v1"])
    rows = rewrite_graph(graph, backend="collective").report.layers
    assert [{_layer_of(s) for s in row.sites} for row in rows] == [{"stem_bn"}, {"left_bn"}, {"right_bn"}]
    assert [(row.layer, row.lined_up_by) for row in rows] == [(f"{layer}_bn", "variable roles") for layer in ("stem", "left", "right")]


def test_uniquified_scopes_are_paired_by_their_roles():
    """Towers built by entering the same scopes again: name scopes tower, tower_1; variable
    scopes model, model_1. Parallel twins that structure cannot tell apart pair by name."""
    graph = _towers(["tower", "tower"], ["stem", "left", "right"], parallel=("left", "right"), variable_scopes=[None, None])
    assert {v.op.name.split("/")[0] for v in graph.get_collection("variables")} == {"model", "model_1"}
    rows = rewrite_graph(graph, backend="collective").report.layers
    assert [[s.split("/")[0] for s in row.sites] for row in rows] == [["tower", "tower_1"]] * 3
    assert [({_layer_of(s) for s in row.sites}, row.lined_up_by) for row in rows] == [
        ({f"{layer}_bn"}, "variable roles") for layer in ("stem", "left", "right")]


def test_a_layer_missing_in_one_tower_is_skipped_the_rest_synced():
    graph = _towers(["tower_0", "tower_1"], ["a", "b", "c"], skip={1: ("b",)}, variable_scopes=["v0", "v1"])
    result = _partial(graph, r"tower_0/v0/b_bn/FusedBatchNormV3: missing from tower\(s\) /device:CPU:1")
    assert [{_layer_of(s) for s in row.sites} for row in result.report.layers] == [{"a_bn"}, {"c_bn"}]
    assert result.report.skipped == [{"node": "tower_0/v0/b_bn/FusedBatchNormV3", "reason": "missing from tower(s) /device:CPU:1"}]


def test_a_layer_missing_where_names_pair_nothing_skips_what_it_changed():
    """Without usable names, the layer after the missing one has another structure in that
    tower (its conv reads a conv): nothing says which copy is missing, so both are skipped."""
    result = _partial(_towers(["alpha", "beta"], ["a", "b", "c"], skip={1: ("b",)}), "missing from tower")
    assert [{_layer_of(s) for s in row.sites} for row in result.report.layers] == [{"a_bn"}]
    assert sorted(s["node"] for s in result.report.skipped) == [
        "alpha/w_alpha/b_bn/FusedBatchNormV3", "alpha/w_alpha/c_bn/FusedBatchNormV3", "beta/w_beta/c_bn/FusedBatchNormV3"]
    assert all(s["reason"].startswith("missing from tower(s)") for s in result.report.skipped)


def test_towers_that_pair_nothing_raise():
    with pytest.raises(TowerMismatchError, match="no batch-norm layer lines up"):
        rewrite_graph(_towers(["alpha", "beta"], ["a", "b"], parallel=("a", "b")), backend="collective")


@functools.lru_cache(maxsize=None)
def _mirrored(replicas: int) -> tf.Graph:
    """MirroredStrategy's graph of `replicas` replicas, built once per process (the tests only
    rewrite it, not in place)."""
    from tf_keras.src.legacy_tf_layers import core, normalization

    graph = tf.Graph()
    with graph.as_default(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{k}" for k in range(replicas)])
        with strategy.scope():
            opt = tf1.train.GradientDescentOptimizer(0.1)

            def step():
                x = tf1.placeholder(tf.float32, [2, 5], name="x")
                h = normalization.batch_normalization(core.dense(x, 4, name="d1"), training=True, name="bn")
                h = normalization.batch_normalization(core.dense(h, 4, name="d2"), training=True, name="bn_1")
                with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
                    return opt.minimize(tf.reduce_mean(h * h))

            strategy.run(step)
    return graph


@pytest.mark.parametrize("tower_by", ["auto", "scope"])
def test_mirrored_strategy_replicas_are_towers(tower_by):
    """Replica 0's ops carry no scope, replica k's `replica_k/`; variables `bn/gamma`,
    `bn/gamma/replica_k`; devices /replica:0/task:0/device:CPU:k."""
    result = rewrite_graph(_mirrored(3), backend="collective", tower_by=tower_by)
    report = result.report
    expected = [f"/replica:0/task:0/device:CPU:{k}" for k in range(3)] if tower_by == "auto" else [f"replica_{k}" for k in range(3)]
    assert report.towers == expected and not report.skipped
    assert [row.layer for row in report.layers] == ["bn", "bn_1"]
    assert [row.sites[1] for row in report.layers] == ["replica_1/bn/moments/mean", "replica_1/bn_1/moments/mean"]
    # Every replica keeps the update of its own copy of each moving statistic.
    kept = {n.name: n for n in result.graph_def.node}
    written = sorted(kept[u].input[0] for row in report.layers for u in row.updates_kept)
    assert written == sorted(f"{layer}/{stat}{suffix}" for layer in ("bn", "bn_1") for stat in ("moving_mean", "moving_variance")
                             for suffix in ("", "/replica_1", "/replica_2"))


def test_every_read_of_a_reference_scale_comes_before_its_gradient():
    """With reference variables, a fused gradient read scale and wrote d(scale) in one kernel;
    after the rewrite ops of its own read scale, and only data edges keep them before d(scale),
    hence before the optimizer's in-place update of scale (tests/test_variable_reads.py checks
    the step Grappler makes of it)."""
    from tf_keras.src.legacy_tf_layers import normalization

    graph = tf.Graph()
    with graph.as_default(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = tf1.train.GradientDescentOptimizer(0.1)
        grads = []
        for k in range(2):
            with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"), tf1.variable_scope("net", reuse=k > 0, use_resource=False):
                x = tf1.placeholder(tf.float32, [2, 4, 4, 3], name="images")
                y = normalization.batch_normalization(x, training=True, fused=True, name="bn")
                grads.append(opt.compute_gradients(tf.reduce_mean(tf.square(y))))
        # every tower trained in the one step (a step running one tower's all-reduce member alone is
        # refused: it would wait forever); the update of scale is free to run early
        opt.apply_gradients([(tf.add_n([g for g, _ in pair]), pair[0][1]) for pair in zip(*grads)], name="apply")
    result = rewrite_graph(graph, backend="collective")
    replaced = [n.name for n in result.graph_def.node if n.op == "IdentityN" and n.name.endswith("FusedBatchNormGradV3")]
    assert structure.assert_scale_read_before_its_gradient(result.graph_def, replaced) == 2
