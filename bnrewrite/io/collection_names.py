"""The graph elements `import_meta_graph` looks up by name in a MetaGraphDef's collections, so
that `convert` can check them against TensorFlow's C++ import of the graph rather than run the
Python loader, which makes a Python Operation per node (as long as the rewrite itself).

The look-ups are those of TensorFlow's meta_graph import and the from_proto functions it calls:
node_list items; a VariableDef's variable, initializer, initial value and snapshot (a resource
variable's snapshot leads back through input 0 to a ReadVariableOp, or is the handle's
`Read/ReadVariableOp:0` when unnamed); a QueueRunnerDef's queue and ops; a SaverDef's tensors
and restore op; a CondContextDef's or WhileContextDef's pred, pivots, loop enters and exits,
maximum_iterations, external values and the ops of its values, nested contexts included.
Invariant: a collection whose items TensorFlow would rebuild some other way (a from_proto
function of a type not listed here) is not judged: `unresolved` returns None for the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

#: Looks up a graph element the way `Graph.as_graph_element` does: "op" or "op:k".
Resolves = Callable[[str], bool]


def output_counts(graph: Any) -> dict[str, int]:
    """Name -> number of outputs of every op of `graph`'s C graph (a C import's result)."""
    from tensorflow.python.client import pywrap_tf_session as c_api

    from bnrewrite.graph.c_graph import operations

    return {name: c_api.TF_OperationNumOutputs(op) for name, op in operations(graph).items()}


def resolver(outputs: dict[str, int]) -> Resolves:
    def resolves(spec: str) -> bool:
        name, colon, index = spec.rpartition(":")
        if not colon:
            return spec in outputs
        return index.isdigit() and int(index) < outputs.get(name, 0)
    return resolves


def unresolved(meta: Any, graph_def: Any, resolves: Resolves) -> list[str] | None:
    """The names `import_meta_graph` would fail to find in `meta`'s collections and saver_def
    (each as "collection: name"), or None when a collection is rebuilt in a way not known here.
    (TensorFlow is imported here, not with the module: inputs refused early never load it.)"""
    from tensorflow.core.framework import variable_pb2
    from tensorflow.core.protobuf import control_flow_pb2, queue_runner_pb2, saver_pb2
    from tensorflow.python.framework import ops

    lookups = {variable_pb2.VariableDef: _variable, queue_runner_pb2.QueueRunnerDef: _queue_runner,
               saver_pb2.SaverDef: _saver, control_flow_pb2.CondContextDef: _context,
               control_flow_pb2.WhileContextDef: _context}

    nodes = {node.name: node for node in graph_def.node}
    missing: list[str] = []
    for key, collection in sorted(meta.collection_def.items()):
        kind = collection.WhichOneof("kind")
        if key == ops.GraphKeys.METRIC_VARIABLES:  # TensorFlow rebuilds them as global variables
            from_proto = ops.get_from_proto_function(ops.GraphKeys.GLOBAL_VARIABLES)
            proto_type = ops.get_collection_proto_type(ops.GraphKeys.GLOBAL_VARIABLES)
        else:
            from_proto, proto_type = ops.get_from_proto_function(key), ops.get_collection_proto_type(key)
        if from_proto and kind == "bytes_list":
            names = lookups.get(proto_type)
            if names is None:
                return None
            for data in collection.bytes_list.value:
                missing.extend(f"{key}: {n}" for n in names(proto_type.FromString(data), nodes, resolves))
        elif kind == "node_list":
            missing.extend(f"{key}: {name}" for name in collection.node_list.value if not resolves(name))
    if meta.HasField("saver_def"):  # the Saver import_meta_graph makes from it
        missing.extend(f"saver_def: {n}" for n in _saver(meta.saver_def, nodes, resolves))
    return missing


def _variable(proto: Any, nodes: dict[str, Any], resolves: Resolves) -> Iterator[str]:
    names = [proto.variable_name, proto.initializer_name]
    names += [proto.initial_value_name] if proto.initial_value_name else []
    if proto.snapshot_name or not proto.is_resource:
        names.append(proto.snapshot_name)
    else:  # TensorFlow's default for a resource variable saved without one
        names.append(proto.variable_name.split(":")[0] + "/Read/ReadVariableOp:0")
    yield from (n for n in names if not resolves(n))
    if proto.is_resource and proto.snapshot_name and resolves(proto.snapshot_name):
        if not _reads_variable(proto.snapshot_name.split(":")[0], nodes):
            yield f"{proto.snapshot_name} (no ReadVariableOp behind it)"


def _reads_variable(name: str, nodes: dict[str, Any]) -> bool:
    """Whether following data input 0 from `name` reaches a ReadVariableOp, as TensorFlow does."""
    seen: set[str] = set()
    while name in nodes and name not in seen:
        node = nodes[name]
        if node.op == "ReadVariableOp":
            return True
        seen.add(name)
        data = [i for i in node.input if not i.startswith("^")]
        name = data[0].split(":")[0] if data else ""
    return False


def _queue_runner(proto: Any, nodes: dict[str, Any], resolves: Resolves) -> Iterator[str]:
    names = [proto.queue_name, *proto.enqueue_op_name]
    names += [n for n in (proto.close_op_name, proto.cancel_op_name) if n]
    yield from (n for n in names if not resolves(n))


def _saver(proto: Any, nodes: dict[str, Any], resolves: Resolves) -> Iterator[str]:
    yield from (n for n in (proto.filename_tensor_name, proto.save_tensor_name, proto.restore_op_name)
                if not resolves(n))


def _context(proto: Any, nodes: dict[str, Any], resolves: Resolves) -> Iterator[str]:
    if proto.DESCRIPTOR.name == "CondContextDef":
        names = [proto.pred_name, proto.pivot_name]
    else:
        names = [proto.pivot_for_pred_name, proto.pivot_for_body_name, proto.pivot_name,
                 *proto.loop_exit_names, *proto.loop_enter_names]
        names += [proto.maximum_iterations_name] if proto.maximum_iterations_name else []
    external = proto.values_def.external_values
    names += list(external.values())
    names += sorted({v.split(":")[0] for v in proto.values_def.values if v not in external})
    yield from (n for n in names if not resolves(n))
    for nested in proto.nested_contexts:
        yield from _context(getattr(nested, nested.WhichOneof("ctxt")), nodes, resolves)

