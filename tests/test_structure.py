"""Rewritten graphs checked by an independent structural oracle (tests/structure.py, networkx):
no cycle, every tower launching its keyed all-reduces in one order, d(scale) and d(offset)
waiting for dx, and the train op running each moving statistic's update once per step where
the original graph ran it once per tower. Each check is also shown failing on a graph broken
on purpose, so it can fail.
"""

import pytest
import tensorflow as tf

import structure
from bnrewrite import rewrite_graph
from models import Spec, build_towers
from test_residual import BN_LAYERS, build_block


def _graph_def(built) -> "tf.compat.v1.GraphDef":
    return built.graph.as_graph_def()


def _fused_gradients(report) -> list[str]:
    return [g for row in report.layers if row.op.startswith("FusedBatchNorm") for g in row.gradients]


def _without_control_inputs(graph_def, keep) -> "tf.compat.v1.GraphDef":
    """A copy with every control input `keep(node, source)` rejects dropped."""
    broken = tf.compat.v1.GraphDef()
    broken.CopyFrom(graph_def)
    for node in broken.node:
        kept = [i for i in node.input if not i.startswith("^") or keep(node, i[1:])]
        del node.input[:]
        node.input.extend(kept)
    return broken


@pytest.fixture(scope="module")
def four_towers():
    built = build_towers(Spec(towers=4, layer="legacy"))
    return built, rewrite_graph(built.graph, backend="local")


def test_train_op_runs_each_moving_statistic_update_once_and_every_other_update_as_before(four_towers):
    built, result = four_towers
    before, after = _graph_def(built), result.graph_def
    structure.assert_acyclic(before)
    structure.assert_acyclic(after)
    train_before = structure.updates_reached(before, built.train_op)
    train_after = structure.updates_reached(after, built.train_op)
    moving = {v for v in train_before if "moving_" in v}
    assert len(moving) == 4  # 2 layers x (mean, variance)
    assert all(train_before[v] == 4 for v in moving) and all(train_after[v] == 1 for v in moving)
    others = set(train_before) - moving
    assert others and {v: train_after[v] for v in others} == {v: train_before[v] for v in others}
    assert structure.updates_reached(after, "tower_0/loss:0") == {} == structure.updates_reached(before, "tower_0/loss:0")
    # The kept update of each statistic is tower 0's: fetching it runs exactly that one.
    kept = [u for row in result.report.layers for u in row.updates_kept]
    assert len(kept) == 4 and all(u.startswith("tower_0/") for u in kept)
    assert sorted(v for u in kept for v in structure.updates_reached(after, u)) == sorted(moving)


def test_every_read_of_the_scale_comes_before_its_gradient(four_towers):
    _, result = four_towers
    gradients = _fused_gradients(result.report)
    assert structure.assert_scale_read_before_its_gradient(result.graph_def, gradients) == 2 * 4
    broken = type(result.graph_def)()
    broken.CopyFrom(result.graph_def)
    for node in broken.node:  # d(scale) from a constant: nothing that reads the scale reaches it
        if node.name in gradients:
            node.input[1] = node.input[3]
    with pytest.raises(AssertionError, match="may have updated it"):
        structure.assert_scale_read_before_its_gradient(broken, gradients)


@pytest.mark.parametrize("backend, device, towers", [("collective", "cpu", 3), ("nccl", "gpu", 2)])
def test_every_tower_launches_its_all_reduces_in_one_order(backend, device, towers):
    """A ResNet block (four layers, two of them side by side, so data alone does not order
    them): the keyed all-reduces form one chain per device, in the same order on every device."""
    built = build_block(towers, 2, "fused", device=device)  # GPU graphs are built, never run
    result = rewrite_graph(built.graph, backend=backend)
    structure.assert_acyclic(result.graph_def)
    order = structure.collective_order(result.graph_def)
    assert len(order) == towers
    first = next(iter(order.values()))
    assert len(first) == 2 * len(BN_LAYERS) and len(set(first)) == len(first)  # forward + backward per layer
    assert all(keys == first for keys in order.values())
    assert structure.assert_scale_read_before_its_gradient(result.graph_def, _fused_gradients(result.report)) == len(BN_LAYERS) * towers
    collectives = {n.name for n in result.graph_def.node if n.op in structure.KEYED_COLLECTIVES}
    unordered = _without_control_inputs(result.graph_def, lambda node, src: not (node.name in collectives and src in collectives))
    with pytest.raises(AssertionError, match="may launch them in either order"):
        structure.collective_order(unordered)


def test_the_oracle_sees_a_cycle(four_towers):
    _, result = four_towers
    broken = tf.compat.v1.GraphDef()
    broken.CopyFrom(result.graph_def)
    names = {n.name: n for n in broken.node}
    names["tower_0/images"].input.append("^train_op")  # train_op already depends on tower 0's images
    with pytest.raises(AssertionError, match="cycle"):
        structure.assert_acyclic(broken)
