"""Run bnrewrite's NCCL graphs on CPU, so CI can train them against the one-device oracle.

`NcclAllReduce` is registered in the CPU build of TensorFlow but has no CPU kernel, and CI has
no GPU: the NCCL backend's output imports but cannot run. Its semantics are simple, though:
the ops that share a `shared_name` are one all-reduce over their `num_devices` devices, and
each device's control edges decide the order in which it joins them (NCCL hangs when two
devices join two all-reduces in opposite orders). `nccl_to_cpu` rewrites a GraphDef so that
the same program runs on CPU:

- every device `/gpu:i` (`/device:GPU:i`, `/replica:0/task:0/device:GPU:i`, ...) becomes the
  same string with CPU in place of GPU, on the graph's nodes and on its functions' nodes;
- each `NcclAllReduce` becomes a `CollectiveReduceV2` of the same name, input, control
  inputs, dtype and device, with one instance key per `shared_name`, one group key per set of
  member devices, `group_size` = `num_devices`, the reduction as merge op and a timeout, so
  that an all-reduce that never completes (a member missing, an ordering edge that deadlocks)
  fails the step instead of hanging it.

Nothing else changes. The converter refuses a group TensorFlow could not run at all (members
disagreeing on `num_devices`, dtype or reduction; not `num_devices` of them; two on one
device). Members inside function bodies (the branches of a v2 `tf.cond`) have no device of
their own: they run on the device of the op that calls their function.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator

from tensorflow.core.framework import graph_pb2, node_def_pb2, tensor_pb2, types_pb2

NCCL_OP = "NcclAllReduce"
COLLECTIVE_OP = "CollectiveReduceV2"
#: Long enough for a loaded 2-core machine's first step; a deadlock fails after it.
TIMEOUT_SECONDS = 20.0
#: NcclAllReduce's `reduction` -> CollectiveReduceV2's `merge_op`.
MERGE_OPS = {b"sum": "Add", b"prod": "Mul", b"min": "Min", b"max": "Max"}
#: The key inputs of CollectiveReduceV2, after the tensor: group_size, group_key, instance_key.
KEY_INPUTS = ("group_size", "group_key", "instance_key")

_GPU = re.compile(r"(/(?:device:)?)(gpu)(:\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class Member:
    """One all-reduce op: where its NodeDef is (`function` "" for the graph itself) and the
    device it runs on."""

    function: str
    node: node_def_pb2.NodeDef
    device: str


def cpu_device(device: str) -> str:
    """The device string with its GPU replaced by the CPU of the same index, spelled alike."""
    return _GPU.sub(lambda m: m[1] + ("CPU" if m[2].isupper() else "cpu") + m[3], device)


def on_cpu(graph_def: graph_pb2.GraphDef) -> graph_pb2.GraphDef:
    """A copy with every GPU device of the graph's and its functions' nodes mapped to the CPU
    of the same index; nothing else changed."""
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    for _, node in all_nodes(out):
        node.device = cpu_device(node.device)
    return out


def nccl_to_cpu(graph_def: graph_pb2.GraphDef, timeout_seconds: float = TIMEOUT_SECONDS) -> graph_pb2.GraphDef:
    """`on_cpu(graph_def)` with every NcclAllReduce group turned into one CollectiveReduceV2
    instance over the same members (see the module docstring)."""
    out = on_cpu(graph_def)
    groups: dict[bytes, list[Member]] = defaultdict(list)
    for member in members(out, NCCL_OP):
        groups[member.node.attr["shared_name"].s].append(member)
    group_keys: dict[tuple[str, ...], int] = {}
    bodies = {f.signature.name: f for f in out.library.function}
    for instance_key, (shared_name, group) in enumerate(sorted(groups.items()), start=1):
        devices = tuple(sorted(m.device for m in group))
        _check_group(shared_name, group, devices)
        keys = (len(group), group_keys.setdefault(devices, len(group_keys) + 1), instance_key)
        for member in group:
            added = _to_collective(member.node, keys, timeout_seconds, in_function=bool(member.function))
            (bodies[member.function].node_def if member.function else out.node).extend(added)
    return out


def members(graph_def: graph_pb2.GraphDef, op: str) -> list[Member]:
    """Every node of type `op` in the graph and in its functions, with the device it runs on."""
    callers = _function_devices(graph_def)
    found = []
    for function, node in all_nodes(graph_def):
        if node.op != op:
            continue
        device = node.device
        if not device and function:
            if len(callers[function]) != 1:
                where = sorted(callers[function]) or "no device"
                raise ValueError(f"{node.name} in {function} runs on {where}, not on one device")
            (device,) = callers[function]
        found.append(Member(function, node, device))
    return found


def collective_keys(graph_def: graph_pb2.GraphDef, member: Member) -> tuple[int, int, int]:
    """(group_size, group_key, instance_key) of a CollectiveReduceV2: the Consts it reads."""
    consts = {n.name: n for function, n in all_nodes(graph_def) if function == member.function}
    return tuple(consts[name.split(":")[0]].attr["value"].tensor.int_val[0] for name in member.node.input[1:4])


def all_nodes(graph_def: graph_pb2.GraphDef) -> Iterator[tuple[str, node_def_pb2.NodeDef]]:
    """(function name or "", node) for the graph's nodes, then every function's."""
    for node in graph_def.node:
        yield "", node
    for function in graph_def.library.function:
        for node in function.node_def:
            yield function.signature.name, node


def _function_devices(graph_def: graph_pb2.GraphDef) -> dict[str, set[str]]:
    """Function name -> the devices its callers run on (through nested calls too)."""
    bodies = {f.signature.name: f for f in graph_def.library.function}
    devices: dict[str, set[str]] = defaultdict(set)
    pending = [(node, node.device) for node in graph_def.node]
    while pending:
        node, device = pending.pop()
        for name in _called(node, bodies):
            if device not in devices[name]:
                devices[name].add(device)
                pending.extend((inner, inner.device or device) for inner in bodies[name].node_def)
    return devices


def _called(node: node_def_pb2.NodeDef, bodies: dict) -> Iterator[str]:
    """The library functions a node calls: as its op, or in a function-valued attr."""
    if node.op in bodies:
        yield node.op
    for value in node.attr.values():
        if value.HasField("func"):
            yield value.func.name
        yield from (f.name for f in value.list.func)


def _check_group(shared_name: bytes, group: list[Member], devices: tuple[str, ...]) -> None:
    name = shared_name.decode()
    for attr in ("num_devices", "T", "reduction"):
        if len({m.node.attr[attr].SerializeToString(deterministic=True) for m in group}) != 1:
            raise ValueError(f"NCCL group {name}: members disagree on {attr}")
    if len(group) != group[0].node.attr["num_devices"].i:
        raise ValueError(f"NCCL group {name}: {len(group)} members for num_devices={group[0].node.attr['num_devices'].i}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"NCCL group {name}: two members on one device: {list(devices)}")
    if group[0].node.attr["reduction"].s not in MERGE_OPS:
        raise ValueError(f"NCCL group {name}: unknown reduction {group[0].node.attr['reduction'].s!r}")


def _to_collective(node: node_def_pb2.NodeDef, keys: tuple[int, int, int], timeout_seconds: float,
                   in_function: bool) -> list[node_def_pb2.NodeDef]:
    """Turn `node` (an NcclAllReduce) into a CollectiveReduceV2 in place; returns the Consts of
    its keys, to be added beside it. Attributes as bnrewrite's collective backend writes them."""
    data = [i for i in node.input if not i.startswith("^")]
    control = [i for i in node.input if i.startswith("^")]
    consts = [_int32_const(f"{node.name}/{what}", value, node.device) for what, value in zip(KEY_INPUTS, keys)]
    merge_op = MERGE_OPS[node.attr["reduction"].s]
    for attr in ("reduction", "num_devices", "shared_name"):
        del node.attr[attr]
    node.op = COLLECTIVE_OP
    del node.input[:]
    node.input.extend(data + [c.name + (":output:0" if in_function else "") for c in consts] + control)
    node.attr["merge_op"].s = merge_op.encode()
    node.attr["final_op"].s = b"Id"
    node.attr["communication_hint"].s = b"auto"
    node.attr["timeout_seconds"].f = timeout_seconds
    node.attr["is_stateless"].b = False
    node.attr["Nordering_token"].i = 0
    node.attr["max_subdivs_per_device"].i = -1
    return consts


def _int32_const(name: str, value: int, device: str) -> node_def_pb2.NodeDef:
    node = node_def_pb2.NodeDef(name=name, op="Const", device=device)
    node.attr["dtype"].type = types_pb2.DT_INT32
    node.attr["value"].tensor.CopyFrom(tensor_pb2.TensorProto(dtype=types_pb2.DT_INT32, int_val=[value]))
    return node
