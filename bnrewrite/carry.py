"""A session that has run moves to a new synchronized graph with its variables' values.

Keras makes its session at `compile` (or at the first `set_weights`) and runs it, initializing
and setting the model's variables, before `fit` adds the gradients and updates that make the
graph a multi-tower training graph. The graph then gets a new synchronized graph (a shadow) and
the session a new TensorFlow session on it; what the old session holds is read out of it and
written into the new one, variable by variable, under the variables' own names (the rewrite
keeps every variable and its name).

Invariant: the new session starts with every variable the old one had initialized, at the value
it had, and the old session is closed; state other than variables (queues, iterators, tables,
readers) cannot be carried, and a graph that holds any is left to the caller to refuse.
Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import itertools
from typing import Any

from bnrewrite.c_graph import import_fragment, operations

#: Stateful ops whose state lives in the session and is not a variable: not carried.
_UNCARRIED = ("Queue", "Iterator", "Table", "Reader", "Stack", "Barrier", "Accumulator", "TensorArray")
_VARIABLES = frozenset({"VarHandleOp", "VariableV2", "Variable"})
_serial = itertools.count()


def uncarried(script_ops: list[Any]) -> str:
    """An op holding session state other than variables ("" if none): the first one found."""
    for op in script_ops:
        if any(kind in op.type for kind in _UNCARRIED):
            return f"{op.name} ({op.type})"
    return ""


def carry(session: Any, old_graph: Any, script_ops: list[Any], new_graph: Any) -> tuple[Any, int]:
    """A new TensorFlow session on `new_graph` holding the values of the variables the TF session
    under `session` (on `old_graph`) has initialized, and how many; the variables are those
    among `script_ops` (the ops of the script's graph)."""
    from tensorflow.python.client import pywrap_tf_session as tf_session

    old_ops = operations(old_graph)
    reads = _readers(script_ops, old_ops)
    with old_graph._session_run_lock():
        tf_session.ExtendSession(session._session)
    values = _values(session, [(old_ops[name], index) for _, name, index in reads])
    carried = [(variable, value) for (variable, _, _), value in zip(reads, values) if value is not None]
    kinds = {op.name: op.type for op in script_ops if op.type in _VARIABLES}
    options = tf_session.TF_NewSessionOptions(target=session._target, config=session._config)
    try:
        with new_graph._c_graph.get() as c_graph:
            new = tf_session.TF_NewSessionRef(c_graph, options)
    finally:
        tf_session.TF_DeleteSessionOptions(options)
    if carried:
        _write(new, kinds, carried, new_graph)
    return new, len(carried)


def _readers(script_ops: list[Any], old_ops: dict[str, Any]) -> list[tuple[str, str, int]]:
    """(variable, node to fetch, output) for each variable the old graph holds: a ref variable
    itself, a resource variable through a ReadVariableOp of it (graph-mode variables make one)."""
    read_of: dict[str, str] = {}
    for op in script_ops:
        if op.type == "ReadVariableOp" and op.name in old_ops:
            read_of.setdefault(op.inputs[0].op.name, op.name)
    found = []
    for op in script_ops:
        if op.type not in _VARIABLES or op.name not in old_ops:
            continue
        if op.type != "VarHandleOp":
            found.append((op.name, op.name, 0))
        elif op.name in read_of:
            found.append((op.name, read_of[op.name], 0))
    return found


def _values(session: Any, outputs: list[tuple[Any, int]]) -> list[Any]:
    """The values of `outputs` in `session`'s TF session, None for an uninitialized variable's."""
    from tensorflow.python.framework import c_api_util, errors

    tf_outputs = [c_api_util.tf_output(op, index) for op, index in outputs]
    try:
        return list(session._call_tf_sessionrun(None, {}, tf_outputs, [], None))
    except errors.FailedPreconditionError:  # some are not initialized: one at a time
        values = []
        for output in tf_outputs:
            try:
                values.append(session._call_tf_sessionrun(None, {}, [output], [], None)[0])
            except errors.FailedPreconditionError:
                values.append(None)
        return values


def _write(new: Any, kinds: dict[str, str], carried: list[tuple[str, Any]], new_graph: Any) -> None:
    """Assign every carried value to its variable in the new TF session `new`, through a fragment
    (a placeholder and an assign op per variable) imported into `new_graph`."""
    from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2
    from tensorflow.python.client import pywrap_tf_session as tf_session
    from tensorflow.python.framework import c_api_util, dtypes

    scope = f"bnrewrite_carry_{next(_serial)}"
    fragment = graph_pb2.GraphDef()
    fragment.versions.producer = new_graph.graph_def_versions.producer
    inputs, feeds, assigns = {}, [], []
    for k, (variable, value) in enumerate(carried):
        dtype = dtypes.as_dtype(value.dtype).as_datatype_enum
        placeholder = node_def_pb2.NodeDef(name=f"{scope}/value_{k}", op="Placeholder")
        placeholder.attr["dtype"].CopyFrom(attr_value_pb2.AttrValue(type=dtype))
        assign = node_def_pb2.NodeDef(name=f"{scope}/assign_{k}", input=[f"{variable}:0", placeholder.name])
        if kinds[variable] == "VarHandleOp":
            assign.op = "AssignVariableOp"
            assign.attr["dtype"].CopyFrom(attr_value_pb2.AttrValue(type=dtype))
        else:
            assign.op = "Assign"
            assign.attr["T"].CopyFrom(attr_value_pb2.AttrValue(type=dtype))
            assign.attr["validate_shape"].CopyFrom(attr_value_pb2.AttrValue(b=False))
        fragment.node.extend([placeholder, assign])
        inputs[f"{variable}:0"] = variable
        feeds.append((placeholder.name, value))
        assigns.append(assign.name)
    new_ops = operations(new_graph)
    made = import_fragment(new_graph, fragment.SerializeToString(), {name: (new_ops[v], 0) for name, v in inputs.items()}, {},
                   [name for name, _ in feeds] + assigns)
    targets = dict(zip([name for name, _ in feeds] + assigns, made))
    tf_session.ExtendSession(new)
    feed = {c_api_util.tf_output(targets[name], 0): value for name, value in feeds}
    tf_session.TF_SessionRun_wrapper(new, None, feed, [], [targets[name] for name in assigns], None)
