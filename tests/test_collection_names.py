"""convert's loader check without the Python loader (issue 42): the C++ import plus every name
import_meta_graph looks up (bnrewrite.io.collection_names) must judge a MetaGraph as TensorFlow's
own `import_meta_graph` does. A MetaGraph holding every kind of collection the check knows
(ref and resource variables, a v1 cond and while loop, a queue runner, a Saver, node lists) is
loaded intact and with one name broken at a time; both checks must agree each time."""

from __future__ import annotations

import copy
import importlib

import pytest

from bnrewrite.io.model import Entry
from bnrewrite.io.verify import import_check, loads_whole


def _meta_graph():
    import tensorflow as tf

    tf1 = tf.compat.v1
    was_v2 = tf1.control_flow_v2_enabled()
    tf1.disable_control_flow_v2()
    try:
        with tf.Graph().as_default():
            ref = tf1.get_variable("ref", [2], use_resource=False)
            res = tf1.get_variable("res", [2], use_resource=True)
            x = tf1.placeholder(tf.float32, [2], name="x")
            flag = tf1.placeholder_with_default(True, [], name="flag")
            y = tf1.cond(flag, lambda: x * ref, lambda: x + res, name="branch")
            _, total = tf1.while_loop(lambda i, t: i < 3, lambda i, t: (i + 1, t + y), [0, tf.zeros([2])], name="loop")
            loss = tf.reduce_sum(total, name="loss")
            train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
            queue = tf1.FIFOQueue(4, [tf.float32], name="queue")
            tf1.train.add_queue_runner(tf1.train.QueueRunner(queue, [queue.enqueue([1.0])]))
            tf1.add_to_collection("train_op", train)
            tf1.add_to_collection("outputs", loss)
            tf1.train.Saver()
            return tf1.train.export_meta_graph()
    finally:
        if was_v2:
            tf1.enable_control_flow_v2()


def _set_first(values, new: str) -> None:
    values[0] = new


def _bytes_item(meta, key: str, proto_type, edit) -> None:
    data = meta.collection_def[key].bytes_list.value
    proto = proto_type.FromString(data[0])
    edit(proto)
    data[0] = proto.SerializeToString()


def _break(kind: str, meta) -> None:
    from tensorflow.core.framework import variable_pb2
    from tensorflow.core.protobuf import control_flow_pb2, queue_runner_pb2

    variables = meta.collection_def["variables"].bytes_list.value
    resource = next(i for i, d in enumerate(variables) if variable_pb2.VariableDef.FromString(d).is_resource)
    if kind == "node list: a missing op":
        _set_first(meta.collection_def["train_op"].node_list.value, "no_such_op")
    elif kind == "node list: an output past the last":
        _set_first(meta.collection_def["outputs"].node_list.value, "loss:1")
    elif kind == "variable: its variable":
        _bytes_item(meta, "variables", variable_pb2.VariableDef, lambda p: setattr(p, "variable_name", "gone:0"))
    elif kind == "variable: its snapshot":
        _bytes_item(meta, "variables", variable_pb2.VariableDef, lambda p: setattr(p, "snapshot_name", "gone/read:0"))
    elif kind == "resource variable: a snapshot read from no variable":
        variables[0], variables[resource] = variables[resource], variables[0]
        _bytes_item(meta, "variables", variable_pb2.VariableDef, lambda p: setattr(p, "snapshot_name", "x:0"))
    elif kind == "cond: its predicate":
        _bytes_item(meta, "cond_context", control_flow_pb2.CondContextDef, lambda p: setattr(p, "pred_name", "nope:0"))
    elif kind == "cond: a value":
        _bytes_item(meta, "cond_context", control_flow_pb2.CondContextDef, lambda p: p.values_def.values.append("nope:0"))
    elif kind == "while: an exit":
        _bytes_item(meta, "while_context", control_flow_pb2.WhileContextDef, lambda p: _set_first(p.loop_exit_names, "nope:0"))
    elif kind == "queue runner: an enqueue op":
        _bytes_item(meta, "queue_runners", queue_runner_pb2.QueueRunnerDef, lambda p: _set_first(p.enqueue_op_name, "nope"))
    elif kind == "saver: its restore op":
        meta.saver_def.restore_op_name = "save/no_restore"


BROKEN = ["node list: a missing op", "node list: an output past the last", "variable: its variable",
          "variable: its snapshot", "resource variable: a snapshot read from no variable", "cond: its predicate",
          "cond: a value", "while: an exit", "queue runner: an enqueue op", "saver: its restore op"]


@pytest.fixture(scope="module")
def meta():
    return _meta_graph()


def test_an_intact_meta_graph_loads_both_ways(meta):
    entry = Entry(meta.graph_def, meta)
    assert {"variables", "cond_context", "while_context", "queue_runners", "train_op"} <= set(meta.collection_def)
    assert loads_whole(entry) is None and import_check(entry) is None


@pytest.mark.parametrize("kind", BROKEN)
def test_a_broken_name_is_refused_as_import_meta_graph_refuses_it(meta, kind):
    broken = copy.deepcopy(meta)
    _break(kind, broken)
    entry = Entry(broken.graph_def, broken)
    fast, full = loads_whole(entry), import_check(entry)
    assert full is not None, f"TensorFlow's loader accepts it: the case tests nothing ({kind})"
    assert fast is not None and "the MetaGraph names what its graph lacks" in fast, (fast, full)


def test_a_collection_rebuilt_some_other_way_goes_to_the_python_loader(meta, monkeypatch):
    """A proto collection of a type the check does not know is judged by import_meta_graph."""
    from tensorflow.core.framework import tensor_shape_pb2
    from tensorflow.python.framework import ops

    verify = importlib.import_module("bnrewrite.io.verify")
    ops.register_proto_function("bnrewrite_test_shapes", proto_type=tensor_shape_pb2.TensorShapeProto,
                                to_proto=lambda x, export_scope=None: x, from_proto=lambda p, import_scope=None: p)
    extended = copy.deepcopy(meta)
    extended.collection_def["bnrewrite_test_shapes"].bytes_list.value.append(
        tensor_shape_pb2.TensorShapeProto().SerializeToString())
    called = []
    monkeypatch.setattr(verify, "import_check", lambda entry: called.append(entry) or None)
    assert verify.loads_whole(Entry(extended.graph_def, extended)) is None and len(called) == 1
    assert verify.loads_whole(Entry(meta.graph_def, meta)) is None and len(called) == 1
