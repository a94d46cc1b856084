"""The local backend: one AddN per all-reduce on the first tower's device of each sync group,
read by every member through an Identity of its own.

What it must do besides training like one device (tests/test_oracle.py, test_unfused_and_cond.py
and test_tower_shapes.py run it): be what `auto` picks for towers of one process that are not
all GPUs, sum exactly the members of each sync group, and refuse what it cannot reach.
"""

from collections import defaultdict

import pytest

import bnrewrite
from bnrewrite import rewrite_graph
from bnrewrite.collectives import COLLECTIVE_OPS, INSTANCE_ATTR
from models import Spec, build_towers


def _sums_and_members(graph_def):
    nodes = {n.name: n for n in graph_def.node}
    sums = [n for n in graph_def.node if n.op == "AddN" and n.name.endswith("all_reduce/sum")]
    members = defaultdict(list)
    for node in graph_def.node:
        if INSTANCE_ATTR in node.attr:
            members[node.input[0]].append(node)
    return nodes, sums, members


@pytest.mark.parametrize("layer", ["legacy", "legacy_unfused"])
def test_auto_picks_local_on_cpu_towers_one_sum_per_all_reduce(layer):
    k = 3
    result = rewrite_graph(build_towers(Spec(towers=k, layer=layer)).graph)
    assert result.report.backend == "local"
    graph_def = result.graph_def
    assert not [n for n in graph_def.node if n.op in COLLECTIVE_OPS]
    nodes, sums, members = _sums_and_members(graph_def)
    layers = len(result.report.layers)
    assert len(sums) == 2 * layers  # one forward and one backward all-reduce per layer
    for total in sums:
        assert total.device == "/device:CPU:0" and total.attr["N"].i == k == len(total.input)
        assert {nodes[i.split(":")[0]].device for i in total.input} == {f"/device:CPU:{t}" for t in range(k)}
        readers = members[total.name]
        assert sorted(r.device for r in readers) == [f"/device:CPU:{t}" for t in range(k)]
        assert all(r.op == "Identity" for r in readers) and len({r.attr[INSTANCE_ATTR].i for r in readers}) == 1
    assert all(row.collectives == 2 * k for row in result.report.layers)
    assert "backend local" in str(result.report)


def test_sync_groups_sum_only_their_members():
    result = rewrite_graph(build_towers(Spec(towers=4)).graph, backend="local", group_size=2)
    nodes, sums, members = _sums_and_members(result.graph_def)
    by_device = defaultdict(list)
    for total in sums:
        inputs = {nodes[i.split(":")[0]].device for i in total.input}
        readers = {r.device for r in members[total.name]}
        assert inputs == readers and len(inputs) == 2
        by_device[total.device].append(inputs)
    assert set(by_device) == {"/device:CPU:0", "/device:CPU:2"}
    assert all(group == {d, d[:-1] + str(int(d[-1]) + 1)} for d, groups in by_device.items() for group in groups)


def test_control_flow_v2_needs_keyed_all_reduces():
    graph = build_towers(Spec(towers=2, layer="legacy_cond_v2")).graph
    assert rewrite_graph(graph).report.backend == "collective"
    with pytest.raises(bnrewrite.BackendError, match=r"backend local cannot reach .*inside a function.*; use backend=\"collective\" \(or backend=\"nccl\" on GPUs\)$"):
        rewrite_graph(graph, backend="local")


def test_several_workers_need_keyed_all_reduces():
    graph = build_towers(Spec(towers=2)).graph
    assert rewrite_graph(graph, num_workers=2, task_index=0).report.backend == "collective"
    with pytest.raises(bnrewrite.BackendError, match="with several workers use backend=\"collective\""):
        rewrite_graph(graph, backend="local", num_workers=2, task_index=0)


def test_gpu_towers_keep_nccl_and_may_ask_for_local():
    graph = build_towers(Spec(towers=2, device="gpu")).graph
    assert rewrite_graph(graph).report.backend == "nccl"
    _, sums, _ = _sums_and_members(rewrite_graph(graph, backend="local").graph_def)
    assert sums and {s.device for s in sums} == {"/device:GPU:0"}
