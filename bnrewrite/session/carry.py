"""A session that has run moves to a new synchronized graph with its variables' values.

Keras makes its session at `compile` (or at the first `set_weights`) and runs it, initializing
and setting the model's variables, before `fit` adds the gradients and updates that make the
graph a multi-tower training graph. The graph then gets a new synchronized graph (a shadow) and
the session a new TensorFlow session on it; what the old session holds is read out of it and
written into the new one, variable by variable, under the variables' own names (the rewrite
keeps every variable and its name).

State other than variables (queues, iterators, tables, readers) cannot be read out. The one form
of it that can be remade is state the old session only started: runs that reached nothing of it
but its initializers (MakeIterator, MultiDeviceIteratorInit, table initializers), wrote no
variable and took no feed are run again on the new session (Keras' MirroredStrategy fit
initializes its MultiDeviceIterator before it builds the train function). Anything else that
touched such state (a GetNext, an enqueue, a fed initializer) leaves the session to be refused.

Invariant: the new session starts with every variable the old one had initialized, at the value
it had, and with the non-variable state the old one had started, from its start; the old session
is closed. Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import itertools
from typing import Any

from bnrewrite.graph.c_graph import import_fragment, operations

#: Stateful ops whose state lives in the session and is not a variable: not read out.
_UNCARRIED = ("Queue", "Iterator", "Table", "Reader", "Stack", "Barrier", "Accumulator", "TensorArray")
#: Ops that start such state from its definition, and ops that only read its handle's name.
_STARTERS = frozenset({"MakeIterator", "MultiDeviceIteratorInit", "InitializeTable", "InitializeTableV2",
                       "InitializeTableFromTextFile", "InitializeTableFromTextFileV2"})
_VARIABLES = frozenset({"VarHandleOp", "VariableV2", "Variable"})
_WRITES = ("Assign", "Apply", "Scatter")  # in the type of every op that writes a variable
_serial = itertools.count()


def restarts(graph: Any, seen: list[Any], runs: list[tuple[list[str], bool]]) -> tuple[list[list[str]], str]:
    """The recorded `runs` (op names, whether fed) of the old session that started state other
    than variables held by ops among `seen` (the ops it may have run), to run again on the new
    session; or why that state cannot be remade ("" when it can)."""
    held = {op.name for op in seen if not op.inputs and any(kind in op.type for kind in _UNCARRIED)}  # the makers
    if not held:
        return [], ""
    again = []
    for names, fed in runs:
        reached = _ancestors(graph, names)
        users = [op for op in reached if any(t.op.name in held for t in op.inputs)]
        if not users:
            continue
        other = next((op for op in users if op.type not in _STARTERS and not op.type.endswith("ToStringHandle")), None)
        writer = next((op for op in reached if any(kind in op.type for kind in _WRITES)), None)
        if other is not None or writer is not None or fed:
            user = other or users[0]
            maker = next(t.op for t in user.inputs if t.op.name in held)
            why = (f"ran {other.name} ({other.type}) on it" if other is not None else
                   f"started it in a run that also wrote {writer.name}" if writer is not None else
                   "started it in a run with feeds")
            return [], f"{maker.name} ({maker.type}: {why})"
        again.append(names)
    return again, ""


def _ancestors(graph: Any, names: list[str]) -> list[Any]:
    """The ops of `graph` a run of `names` runs (data and control inputs, transitively)."""
    stack = [graph.get_operation_by_name(name) for name in names]
    seen = {op.name: op for op in stack}
    while stack:
        op = stack.pop()
        for source in [t.op for t in op.inputs] + list(op.control_inputs):
            if source.name not in seen:
                seen[source.name] = source
                stack.append(source)
    return list(seen.values())


def carry(session: Any, old_graph: Any, script_ops: list[Any], new_graph: Any,
          again: list[list[str]]) -> tuple[Any, int]:
    """A new TensorFlow session on `new_graph` holding the values of the variables the TF session
    under `session` (on `old_graph`) has initialized, and how many; the variables are those
    among `script_ops` (the ops of the script's graph). The runs `again` (op names) are then
    run on it, in order (restarts)."""
    from tensorflow.python.client import pywrap_tf_session as tf_session

    old_ops = operations(old_graph)
    reads = _readers(script_ops, old_ops)
    with old_graph._session_run_lock():
        tf_session.ExtendSession(session._session)
    values = _values(session, [(old_ops[name], index) for _, name, index in reads])
    carried = [(variable, value) for (variable, _, _), value in zip(reads, values) if value is not None]
    kinds = {op.name: op.type for op in script_ops if op.type in _VARIABLES}
    new = new_session(session, new_graph)
    if carried:
        _write(new, kinds, carried, new_graph)
    if again:
        new_ops = operations(new_graph)
        tf_session.ExtendSession(new)
        for names in again:
            tf_session.TF_SessionRun_wrapper(new, None, {}, [], [new_ops[name] for name in names], None)
    return new, len(carried)


def new_session(session: Any, graph: Any) -> Any:
    """A TensorFlow session on `graph`'s C graph, with the target and config of Python `session`."""
    from tensorflow.python.client import pywrap_tf_session as tf_session

    options = tf_session.TF_NewSessionOptions(target=session._target, config=session._config)
    try:
        with graph._c_graph.get() as c_graph:
            return tf_session.TF_NewSessionRef(c_graph, options)
    finally:
        tf_session.TF_DeleteSessionOptions(options)


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
