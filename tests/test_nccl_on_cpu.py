"""The NCCL backend's output, run on CPU against the one-device oracle (issue 13).

CI has no GPU, so the NCCL graphs were only checked for structure. Here the towers are built
on `/gpu:k`, rewritten with `backend="nccl"`, and `nccl_on_cpu.nccl_to_cpu` turns each
`NcclAllReduce` group into one `CollectiveReduceV2` over the same members, on `/cpu:k`,
keeping the control-edge chains that order each device's all-reduces. The converted graph
must train like one device fed the whole batch (sync groups: like one device per group), and
the un-rewritten graph (devices mapped alike) must not. A wrong group or reduction changes the
numbers; a missing member or an ordering edge that deadlocks fails the step at the
collective's timeout instead of hanging.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from tensorflow.core.framework import graph_pb2
from tensorflow.python.framework.test_util import IsMklEnabled

from bnrewrite import rewrite_graph
from models import Built, Result, Spec, assert_synced, build_reference, build_towers, make_batches, train
from nccl_on_cpu import COLLECTIVE_OP, KEY_INPUTS, NCCL_OP, all_nodes, collective_keys, members, nccl_to_cpu, on_cpu
from test_residual import BN_LAYERS as RESIDUAL_LAYERS, assert_one_order_on_every_device, block_batches, build_block

STEPS = 3
TOLERANCE = 2e-4  # float32 (measured 4e-7 - 1e-5)
SPEC_LAYERS = 2  # batch-norm layers of every Spec model


@pytest.mark.parametrize("spec", [
    Spec(towers=2, device="gpu"),
    pytest.param(Spec(towers=3, device="gpu", data_format="NCHW"), marks=pytest.mark.skipif(
        not IsMklEnabled(), reason="the GPU towers' NCHW convolutions run on CPU only with oneDNN")),
    Spec(towers=2, device="gpu", layer="legacy_unfused"),
    Spec(towers=2, device="gpu", layer="legacy_cond_v1"),
    Spec(towers=2, device="gpu", layer="moments_cond_v1"),
    Spec(towers=2, device="gpu", layer="legacy_cond_v2"),
    Spec(towers=2, device="gpu", layer="moments_cond_v2"),
], ids=lambda s: f"K{s.towers}-{s.layer}-{s.data_format}")
def test_nccl_graph_trains_like_one_device(spec: Spec):
    built = build_towers(spec)
    _, converted = _converted(built, SPEC_LAYERS, list(range(spec.towers)))
    ref = build_reference(spec)
    data = make_batches(spec, STEPS)
    expected = train(ref.graph, ref, data, num_devices=1)
    _assert_oracle(f"nccl {spec.layer} {spec.data_format} K={spec.towers}", built, converted, expected, data)


def test_nccl_parallel_layers_train_like_one_device():
    """tests/test_residual.py's ResNet block: its main branch and projection shortcut do not
    depend on each other, so only the rewrite's control-edge chains order their all-reduces.
    Chained in different orders on two devices, they would deadlock (the step fails at the
    collective's timeout); the rewrite chains them in one order on every device."""
    k, b = 2, 2
    built = build_block(k, b, "fused", device="gpu")
    nccl, converted = _converted(built, len(RESIDUAL_LAYERS), list(range(k)))
    assert_one_order_on_every_device(nccl)
    ref = build_block(1, k * b, "fused")
    data = block_batches(k, b)
    expected = train(ref.graph, ref, data, num_devices=1)
    _assert_oracle(f"nccl residual block K={k}", built, converted, expected, data)


def test_nccl_sync_groups_train_like_one_device_per_group():
    """K=4, group_size=2: towers {0, 1} and {2, 3} train like 2 devices with 2B examples each,
    whose moving statistics are device 0's (the rewrite keeps tower 0's updates); as in
    test_tower_shapes' collective sync-group test."""
    b = 2
    spec = Spec(towers=4, batch=b, device="gpu")
    built = build_towers(spec)
    _, converted = _converted(built, SPEC_LAYERS, [0, 1], [2, 3], group_size=2)
    ref = build_towers(Spec(towers=2, batch=2 * b, updates_tower=0))
    data = make_batches(spec, STEPS)
    expected = train(ref.graph, ref, data, num_devices=2)
    _assert_oracle("nccl sync groups K=4", built, converted, expected, data)


def _converted(built: Built, layers: int, *groups: list[int], **options: int) -> tuple[graph_pb2.GraphDef, graph_pb2.GraphDef]:
    """The NCCL rewrite of `built` (`layers` batch-norm layers; sync groups of tower indices),
    and that rewrite converted to run on CPU, once the conversion is checked."""
    nccl = rewrite_graph(built.graph, backend="nccl", **options).graph_def
    converted = nccl_to_cpu(nccl)
    _assert_conversion(on_cpu(nccl), converted, 2 * layers * len(built.inputs), groups)
    return nccl, converted


def _assert_conversion(nccl: graph_pb2.GraphDef, converted: graph_pb2.GraphDef, count: int, groups: tuple) -> None:
    """One CollectiveReduceV2 per NcclAllReduce of `nccl` (`count` of them): same name, inputs
    and control edges, the keys inserted after the tensor; one instance per shared_name, over
    one of `groups` (one member per device), one group key per group; every other node as in
    `nccl` (whose devices are already mapped)."""
    before = {(m.function, m.node.name): m for m in members(nccl, NCCL_OP)}
    after = {(m.function, m.node.name): m for m in members(converted, COLLECTIVE_OP)}
    assert len(before) == count and before.keys() == after.keys()
    instances, devices = defaultdict(set), defaultdict(list)
    for where, member in after.items():
        old = before[where].node
        tensor, *keys = member.node.input[:4]
        assert [tensor, *member.node.input[4:]] == list(old.input) and member.device == before[where].device
        assert [k.split(":")[0] for k in keys] == [f"{old.name}/{k}" for k in KEY_INPUTS]
        size, group_key, instance_key = collective_keys(converted, member)
        assert size == old.attr["num_devices"].i and member.node.attr["T"] == old.attr["T"]
        instances[instance_key].add((old.attr["shared_name"].s, group_key))
        devices[instance_key].append(member.device)
    assert len(instances) == len({m.node.attr["shared_name"].s for m in before.values()})
    wanted = {tuple(f"/device:CPU:{k}" for k in group) for group in groups}
    group_of_key: dict[int, tuple[str, ...]] = {}
    for instance_key, names_and_keys in instances.items():
        assert len(names_and_keys) == 1, names_and_keys  # one shared_name, one group key
        ((_, group_key),) = names_and_keys
        group = tuple(sorted(devices[instance_key]))
        assert group in wanted, f"instance {instance_key} over {group}, not one of {sorted(wanted)}"
        assert group_of_key.setdefault(group_key, group) == group, f"group key {group_key} on two device sets"
    assert len(set(group_of_key.values())) == len(group_of_key) == len(groups)
    added = {f"{name}/{k}" for (_, name) in after for k in KEY_INPUTS}
    assert _others(converted, added) == _others(nccl, added)


def _others(graph_def: graph_pb2.GraphDef, skip: set[str]) -> dict[tuple[str, str], bytes]:
    """Every node but the all-reduces and the names in `skip`, serialized."""
    return {(function, node.name): node.SerializeToString(deterministic=True) for function, node in all_nodes(graph_def)
            if node.op not in (NCCL_OP, COLLECTIVE_OP) and node.name not in skip}


def _assert_oracle(label: str, built: Built, converted: graph_pb2.GraphDef, expected: Result, data: list) -> None:
    """The converted graph trains like `expected` on one CPU per tower; the un-rewritten graph
    (GPUs mapped to CPUs alike) does not."""
    k = len(built.inputs)
    synced = train(converted, built, data, num_devices=k)
    unsynced = train(on_cpu(built.graph.as_graph_def()), built, data, num_devices=k)
    assert_synced(label, synced, unsynced, expected, TOLERANCE)
