"""The local backend: one AddN per all-reduce (one Pack where it gathers the towers' moments) on
the first tower's device of each sync group, and what is computed from it (the global moments,
the backward's factors) built once beside it.

What it must do besides training like one device (tests/test_oracle.py, test_unfused_and_cond.py
and test_tower_shapes.py run it): be what `auto` picks for towers of one process that are not
all GPUs, sum exactly the members of each sync group, and refuse what it cannot reach.
"""

import dataclasses
from collections import defaultdict

import pytest

import bnrewrite
from bnrewrite import rewrite_graph
from bnrewrite.rewrite.collectives import COLLECTIVE_OPS, GATHER_ROWS, INSTANCE_ATTR
import towers_model
import tensorflow as tf
from bnrewrite.graph.index import Device
from bnrewrite.rewrite.collectives import placed
from models import Spec, assert_synced, build_towers, make_batches, one_device_run, train


def _sums_and_readers(graph_def):
    nodes = {n.name: n for n in graph_def.node}
    sums = [n for n in graph_def.node if n.op == "AddN" and n.name.endswith("all_reduce/sum")
            or n.op == "Pack" and n.name.endswith("all_reduce/rows")]
    readers = defaultdict(list)
    for node in graph_def.node:
        for name in {i.split(":")[0] for i in node.input if not i.startswith("^")}:
            readers[name].append(node)
    return nodes, sums, readers


@pytest.mark.parametrize("layer", ["legacy", "legacy_unfused"])
def test_auto_picks_local_on_cpu_towers_one_sum_per_all_reduce(layer):
    k = 3
    result = rewrite_graph(build_towers(Spec(towers=k, layer=layer)).graph)
    assert result.report.backend == "local"
    graph_def = result.graph_def
    assert not [n for n in graph_def.node if n.op in COLLECTIVE_OPS]
    nodes, sums, readers = _sums_and_readers(graph_def)
    layers = len(result.report.layers)
    assert len(sums) == 2 * layers  # one forward and one backward all-reduce per layer
    assert len({total.attr[INSTANCE_ATTR].i for total in sums}) == len(sums)
    for total in sums:
        rows = GATHER_ROWS if total.op == "Pack" else 1  # a gather's rows: [mean, spread] of each tower
        assert total.device == "/device:CPU:0" and total.attr["N"].i == rows * k == len(total.input)
        assert {nodes[i.split(":")[0]].device for i in total.input} == {f"/device:CPU:{t}" for t in range(k)}
        # the combine is built once, beside the sum: no tower reads the sum itself
        assert readers[total.name] and {r.device for r in readers[total.name]} == {"/device:CPU:0"}
    assert all(row.collectives == 2 * k for row in result.report.layers)
    assert "backend local" in str(result.report)


def test_sync_groups_sum_only_their_members():
    result = rewrite_graph(build_towers(Spec(towers=4)).graph, backend="local", group_size=2)
    nodes, sums, readers = _sums_and_readers(result.graph_def)
    by_device = defaultdict(list)
    for total in sums:
        inputs = {nodes[i.split(":")[0]].device for i in total.input}
        assert {r.device for r in readers[total.name]} == {total.device} and len(inputs) == 2
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
    _, sums, _ = _sums_and_readers(rewrite_graph(graph, backend="local").graph_def)
    assert sums and {s.device for s in sums} == {"/device:GPU:0"}


def _soft_config(num_devices: int) -> tf.compat.v1.ConfigProto:
    """towers_model's session, with soft placement: towers asked for /gpu:i run on the CPU."""
    return tf.compat.v1.ConfigProto(device_count={"CPU": num_devices}, allow_soft_placement=True,
                                    intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)


def test_a_device_the_session_lacks_runs_on_its_cpu_0():
    gpu1, cpu1 = Device.parse("/device:GPU:1"), Device.parse("/device:CPU:1")
    assert placed(gpu1, None, None) == gpu1 and placed(gpu1, 2, 1) == gpu1 and placed(cpu1, 0, 2) == cpu1
    assert str(placed(gpu1, 1, 4)) == str(placed(cpu1, 0, 1)) == "/device:CPU:0"
    assert str(placed(Device.parse("/job:w/task:1/device:GPU:0"), 0, 1)) == "/job:w/task:1/device:CPU:0"


def test_soft_placed_gpu_towers_take_the_local_sum():
    """Issue 49: towers on /gpu:i in a session without GPUs run on its CPU: no NCCL."""
    graph = build_towers(Spec(towers=2, device="gpu")).graph
    report = rewrite_graph(graph, available_gpus=0, available_cpus=1).report
    assert report.backend == "local" and report.cpu_devices == 0
    assert any("all run on /device:CPU:0" in note and "one local sum" in note for note in report.notes), report.notes
    with pytest.raises(bnrewrite.BackendError, match=r"towers sit on /device:GPU:0 \(run on /device:CPU:0"):
        rewrite_graph(graph, backend="nccl", available_gpus=0, available_cpus=1)


@pytest.mark.parametrize("device", ["gpu", "cpu"])
def test_towers_on_one_device_inside_cond_v2_meet_on_a_cpu_each_and_train_like_one_device(device, monkeypatch):
    """Towers soft-placed on one device (missing GPUs, or device_count={"CPU": 1} under /cpu:i),
    batch norm under a cond v2 training flag: the local sum cannot reach into the branches and the
    collective runtime meets one peer per device (both members on CPU 0 waited forever). Each
    tower's all-reduce runs on /device:CPU:k, and the session gets that many CPUs."""
    spec = Spec(towers=2, layer="legacy_cond_v2", device=device)
    built = build_towers(spec)
    result = rewrite_graph(built.graph, available_gpus=0, available_cpus=1)
    assert result.report.backend == "collective" and result.report.cpu_devices == 2
    keyed = [n for f in result.graph_def.library.function for n in f.node_def if n.op == "CollectiveReduceV2"]
    # on /cpu:i each is placed with its If, which the session's second CPU then runs on CPU 1
    pinned = ["/device:CPU:0", "/device:CPU:1"] if device == "gpu" else [""]
    assert sorted({n.device for n in keyed}) == pinned and len(keyed) == 8
    assert any("meet on /device:CPU:0..1" in note for note in result.report.notes), result.report.notes
    if device == "gpu":  # the session's CPUs not known: nothing to spread over, named instead of a hang
        with pytest.raises(bnrewrite.BackendError, match=r"meets one peer per device.*GPU:1 \(run on /device:CPU:0"):
            rewrite_graph(built.graph, backend="collective", available_gpus=0)
    expected = one_device_run(dataclasses.replace(spec, device="cpu"), 3)  # the reference is on /cpu:0 either way
    monkeypatch.setattr(towers_model, "session_config", _soft_config)
    batches = make_batches(spec, 3)
    unsynced = train(built.graph, built, batches, num_devices=1)
    assert_synced(f"cond v2 on {device}, one device", train(result.graph_def, built, batches, num_devices=2), unsynced,
                  expected, 1e-5)
