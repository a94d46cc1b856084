"""rewrite_graph's contract: NCCL structure, keys and order, names kept, input untouched,
idempotence, the report, and one specific exception per kind of bad input."""

import functools
import json
from collections import defaultdict

import numpy as np
import pytest
import tensorflow as tf

import bnrewrite
from bnrewrite import rewrite_graph
from bnrewrite.errors import PassError
from bnrewrite.graph.index import Graph
from bnrewrite.graph.names import parse_input
from bnrewrite.graph.nodes import MARK
from bnrewrite.rewrite.passes import run_passes
from bnrewrite.rewrite.plan import KEYS_PER_LAYER
from models import Spec, build_reference, build_towers

tf1 = tf.compat.v1
BN_LAYERS = 2  # the harness model has two batch-norm layers


@functools.lru_cache(maxsize=None)
def towers(spec: Spec):
    """build_towers(spec), built once per process: every test here rewrites it not in place, or a
    copy of its GraphDef, and leaves it as it was."""
    return build_towers(spec)


def _by_op(graph_def, op):
    return [n for n in graph_def.node if n.op == op]


def _chain_order(graph_def, names):
    """The all-reduces of one device in the order their control edges chain them."""
    nodes = {n.name: n for n in graph_def.node}
    preds = {name: [parse_input(i)[0] for i in nodes[name].input if i.startswith("^") and parse_input(i)[0] in names] for name in names}
    heads = [n for n in names if not preds[n]]
    assert len(heads) == 1, f"all-reduces of one device are not one chain: {preds}"
    order, current = [heads[0]], heads[0]
    while True:
        nxt = [n for n in names if current in preds[n]]
        if not nxt:
            return order
        assert len(nxt) == 1
        current = nxt[0]
        order.append(current)


@pytest.mark.parametrize("k", [2, 4])
def test_nccl_structure_on_gpu_towers(k):
    built = towers(Spec(towers=k, device="gpu"))
    result = rewrite_graph(built.graph)  # auto: every tower is a GPU
    assert result.report.backend == "nccl"
    nccl = _by_op(result.graph_def, "NcclAllReduce")
    assert not _by_op(result.graph_def, "CollectiveReduceV2")
    assert len(nccl) == 2 * BN_LAYERS * k  # one forward + one backward per layer per tower
    by_name = defaultdict(list)
    for node in nccl:
        assert node.attr["reduction"].s == b"sum"
        assert node.attr["num_devices"].i == k
        by_name[node.attr["shared_name"].s].append(node.device)
    assert len(by_name) == 2 * BN_LAYERS, "shared_name must be unique per collective"
    for devices in by_name.values():
        assert sorted(devices) == sorted(f"/device:GPU:{i}" for i in range(k)), "one member per tower's GPU"
    per_device = defaultdict(set)
    for node in nccl:
        per_device[node.device].add(node.name)
    orders = []
    for names in per_device.values():
        chain = _chain_order(result.graph_def, names)
        nodes = {n.name: n for n in result.graph_def.node}
        orders.append([nodes[n].attr["shared_name"].s for n in chain])
    assert all(o == orders[0] for o in orders), "towers must launch their all-reduces in the same order"
    # The forward all-reduces come before the backward ones of the same step.
    phases = [int(s.rsplit(b"_i", 1)[1]) % KEYS_PER_LAYER for s in orders[0]]
    assert phases[:BN_LAYERS] == [0] * BN_LAYERS and all(p > 0 for p in phases[BN_LAYERS:])
    tf1.import_graph_def(result.graph_def, name="")  # NCCL graphs import on a CPU build


def test_collective_keys():
    k = 4
    result = rewrite_graph(towers(Spec(towers=k)).graph, backend="collective")
    reduces = _by_op(result.graph_def, "CollectiveReduceV2")
    assert len(reduces) == 2 * BN_LAYERS * k
    consts = {n.name: tf.make_ndarray(n.attr["value"].tensor) for n in _by_op(result.graph_def, "Const")}
    instances = defaultdict(list)
    for node in reduces:
        size, group, instance = (int(consts[parse_input(i)[0]]) for i in node.input[1:4])
        assert size == k
        instances[(group, instance)].append(node.device)
    assert len(instances) == 2 * BN_LAYERS
    assert all(len(set(devices)) == k for devices in instances.values())


def test_sync_groups_split_towers():
    result = rewrite_graph(towers(Spec(towers=4)).graph, backend="collective", group_size=2)
    assert result.report.sync_groups == [["/device:CPU:0", "/device:CPU:1"], ["/device:CPU:2", "/device:CPU:3"]]
    consts = {n.name: tf.make_ndarray(n.attr["value"].tensor) for n in _by_op(result.graph_def, "Const")}
    groups = defaultdict(set)
    for node in _by_op(result.graph_def, "CollectiveReduceV2"):
        assert int(consts[parse_input(node.input[1])[0]]) == 2
        groups[int(consts[parse_input(node.input[2])[0]])].add(node.device)
    assert sorted(map(sorted, groups.values())) == [["/device:CPU:0", "/device:CPU:1"], ["/device:CPU:2", "/device:CPU:3"]]


def test_input_untouched_names_kept_and_report():
    built = towers(Spec(towers=2))
    graph_def = built.graph.as_graph_def()
    before = graph_def.SerializeToString(deterministic=True)
    result = rewrite_graph(graph_def)
    assert graph_def.SerializeToString(deterministic=True) == before
    removed = {r["node"] for r in result.report.removed}
    names = {n.name for n in result.graph_def.node}
    for node in graph_def.node:
        assert node.name in removed or node.name in names
    for fetch in (built.train_op, built.init, parse_input(built.loss)[0], *(parse_input(i)[0] for pair in built.inputs for i in pair)):
        assert fetch in names
    Graph.from_graph_def(result.graph_def).validate()

    report = result.report
    assert len(report.layers) == BN_LAYERS and report.towers == ["/device:CPU:0", "/device:CPU:1"]
    assert all(row.collectives == 4 for row in report.layers)
    # One of the two towers' moving-average updates goes, for each of 2 layers x 2 statistics.
    updates = [r for r in report.removed if r["why"].startswith("duplicate update")]
    assert len(updates) == BN_LAYERS * 2 and all(r["node"].startswith("tower_1/") for r in updates)
    assert not any(r["node"].startswith("tower_0/") for r in report.removed)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["totals"]["collectives_added"] == 2 * BN_LAYERS * 2
    text = str(report)
    assert "2 batch-norm layer(s) synchronized across 2 towers" in text and "removed" in text


def test_meta_graph_collections_stay_consistent():
    built = towers(Spec(towers=2))
    result = rewrite_graph(built.graph)
    assert result.meta_graph_def is not None
    names = {n.name for n in result.meta_graph_def.graph_def.node}
    update_ops = result.meta_graph_def.collection_def["update_ops"].node_list.value
    assert len(update_ops) == BN_LAYERS * 2  # tower 0's updates are what is left
    for value in update_ops:
        assert parse_input(value)[0] in names
    with tf.Graph().as_default():
        tf1.train.import_meta_graph(result.meta_graph_def)


def test_rewriting_twice():
    result = rewrite_graph(towers(Spec(towers=2)).graph)
    with pytest.raises(bnrewrite.AlreadyRewrittenError, match="already rewritten"):
        rewrite_graph(result.graph_def)
    again = rewrite_graph(result.graph_def, if_rewritten="keep")
    assert again.graph_def == result.graph_def
    assert again.report.already_rewritten and "nothing changed" in str(again.report)


def _inference_graph():
    graph = tf.Graph()
    with graph.as_default():
        for i in range(2):
            with tf.device(f"/cpu:{i}"), tf.name_scope(f"tower_{i}"):
                x = tf1.placeholder(tf.float32, [2, 4, 4, 3])
                tf1.nn.fused_batch_norm(x, tf.ones([3]), tf.zeros([3]), mean=tf.zeros([3]), variance=tf.ones([3]), is_training=False)
    return graph


def _no_bn_graph():
    graph = tf.Graph()
    with graph.as_default():
        tf.nn.relu(tf1.placeholder(tf.float32, [2]))
    return graph


def _per_tower_bn(channels: list[int]):
    """Towers with their own batch-norm variables; tower i's layer j has channels[i][j] channels."""
    graph = tf.Graph()
    with graph.as_default():
        for i, layers in enumerate(channels):
            with tf.device(f"/cpu:{i}"), tf.name_scope(f"tower_{i}"):
                for j, c in enumerate(layers):
                    with tf1.variable_scope(f"tower_{i}/bn{j}"):
                        gamma = tf1.get_variable("gamma", initializer=np.ones(c, np.float32))
                        beta = tf1.get_variable("beta", initializer=np.zeros(c, np.float32))
                    with tf.name_scope(f"bn{j}"):
                        tf1.nn.fused_batch_norm(tf1.placeholder(tf.float32, [2, 4, 4, c]), gamma, beta, is_training=True)
    return graph


def _misaligned_graph():
    """Two towers whose only batch-norm layer differs in channel count."""
    return _per_tower_bn([[3], [4]])


def test_layer_missing_in_one_tower_refuses_the_graph_unless_allow_unsynced():
    graph = _per_tower_bn([[3, 5], [3]])
    with pytest.raises(bnrewrite.UnsyncedLayerError, match=r"1 training batch-norm op\(s\) of the 2 towers cannot be "
                       r"synchronized.*tower_0/bn1/FusedBatchNormV3: missing from tower\(s\) /device:CPU:1") as info:
        rewrite_graph(graph)
    assert info.value.exit_code == 7 and isinstance(info.value, bnrewrite.TowerMismatchError)
    result = rewrite_graph(graph, allow_unsynced=True)
    assert [row.sites for row in result.report.layers] == [["tower_0/bn0/FusedBatchNormV3", "tower_1/bn0/FusedBatchNormV3"]]
    assert result.report.skipped == [{"node": "tower_0/bn1/FusedBatchNormV3", "reason": "missing from tower(s) /device:CPU:1"}]
    kept = {n.name: n.op for n in result.graph_def.node}
    assert kept["tower_0/bn1/FusedBatchNormV3"] == "FusedBatchNormV3"  # left exactly as it was


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: build_reference(Spec(towers=2)).graph, bnrewrite.NoTowersError, "only one tower"),
        (lambda: towers(Spec(towers=1)).graph, bnrewrite.NoTowersError, "only one tower"),
        (_inference_graph, bnrewrite.InferenceOnlyError, "inference mode"),
        (_no_bn_graph, bnrewrite.NoBatchNormError, "no batch-norm op"),
        (_misaligned_graph, bnrewrite.TowerMismatchError, "lines up"),
    ],
    ids=["no-towers", "single-tower", "inference-only", "no-batch-norm", "misaligned"],
)
def test_bad_input_raises_specific_error(make, error, message):
    with pytest.raises(error, match=message) as info:
        rewrite_graph(make())
    assert "\n" not in str(info.value)
    assert isinstance(info.value, bnrewrite.BnRewriteError)


def test_bad_options():
    graph = towers(Spec(towers=2)).graph
    with pytest.raises(bnrewrite.BackendError, match=r'nccl needs every tower on a GPU.*; use backend="local" \(or backend="collective" across workers\)$'):
        rewrite_graph(graph, backend="nccl")  # in Python's words, not the command line's
    with pytest.raises(bnrewrite.BnRewriteError, match='with several workers use backend="collective"$'):
        rewrite_graph(graph, backend="nccl", num_workers=2, task_index=0)
    with pytest.raises(bnrewrite.BackendError, match="unknown backend"):
        rewrite_graph(graph, backend="mpi")
    with pytest.raises(bnrewrite.BnRewriteError, match="divide"):
        rewrite_graph(towers(Spec(towers=4)).graph, group_size=3)
    with pytest.raises(bnrewrite.BnRewriteError, match="takes a tf.Graph"):
        rewrite_graph("model.pb")


def test_inference_batch_norm_in_v2_branches_is_counted_once():
    """The else branch's inference-mode batch norm, flattened beside the graph, is not counted
    again from the function library (which counts it when the branch stays unflattened)."""
    from bnrewrite.rewrite.api import take_census

    graph = towers(Spec(towers=2, layer="legacy_cond_v2")).graph
    _, _, census = take_census(Graph.from_graph_def(graph.as_graph_def()))
    assert (len(census.sites), len(census.inference)) == (4, 4)
    assert all("/_fn_else/" in name for name in census.inference)


@pytest.mark.parametrize("layer", ["legacy", "legacy_cond_v1", "moments_cond_v2"])
def test_in_place_gives_the_same_graph_in_the_input_order(layer):
    """Also with branch functions, which the rewrite flattens into the graph and writes back."""
    graph_def = towers(Spec(towers=2, layer=layer)).graph.as_graph_def()
    original = [n.name for n in graph_def.node]
    copied = rewrite_graph(graph_def, backend="collective").graph_def
    result = rewrite_graph(graph_def, backend="collective", in_place=True)
    assert result.graph_def is graph_def
    assert graph_def.SerializeToString(deterministic=True) == copied.SerializeToString(deterministic=True)
    removed = {r["node"] for r in result.report.removed}
    kept = [name for name in original if name not in removed]
    assert [n.name for n in graph_def.node[:len(kept)]] == kept  # replaced ops where they were
    assert all(MARK in n.attr for n in graph_def.node[len(kept):])


def test_meta_graph_def_copied_or_in_place_and_its_collections():
    graph = towers(Spec(towers=2)).graph
    with graph.as_default():
        meta = tf1.train.export_meta_graph(graph=graph)
    before = meta.SerializeToString(deterministic=True)
    copied = rewrite_graph(meta).meta_graph_def
    assert meta.SerializeToString(deterministic=True) == before
    assert copied.meta_info_def == meta.meta_info_def and copied.saver_def == meta.saver_def
    assert copied.graph_def.versions == meta.graph_def.versions and len(copied.graph_def.node) > len(meta.graph_def.node)
    result = rewrite_graph(meta, in_place=True)
    assert result.meta_graph_def is meta
    assert meta.SerializeToString(deterministic=True) == copied.SerializeToString(deterministic=True)
    names = {n.name for n in meta.graph_def.node}
    assert len(names) == len(result.graph_def.node) and any(MARK in n.attr for n in meta.graph_def.node)
    update_ops = meta.collection_def["update_ops"].node_list.value
    assert len(update_ops) == BN_LAYERS * 2 and all(parse_input(v)[0] in names for v in update_ops)


def test_in_place_rewrite_that_fails_leaves_the_graph_as_it_was(monkeypatch):
    graph_def = towers(Spec(towers=2)).graph.as_graph_def()
    before = graph_def.SerializeToString(deterministic=True)

    def passes_then_failure(graph, plan):
        run_passes(graph, plan)  # the real passes: they append hundreds of nodes
        raise PassError("pass injected_failure produced an invalid graph")

    monkeypatch.setattr(bnrewrite.rewrite.api, "run_passes", passes_then_failure)
    with pytest.raises(PassError, match="injected_failure"):
        rewrite_graph(graph_def, in_place=True)
    assert graph_def.SerializeToString(deterministic=True) == before
