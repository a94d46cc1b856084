"""Hostile and careless input (issue 27's input half, issue 28's fast errors), one test per defect:

- sniffing decides the format from a walk over the top-level protobuf fields, in bounded
  memory and before TensorFlow is imported (zero-byte files, checkpoint .index/.data files,
  truncated files);
- every malformed graph is a classified error, never an internal one or an output TensorFlow
  cannot import (attrs of the wrong kind or dtype, output indices out of range, device
  strings with a task that is no number, edges of a dtype their consumer does not take, long
  Identity chains, self-loops);
- graph queries stay linear with one node reading every node;
- in_place leaves the caller's message as it was after an exception at any point, at any bytecode from
  the reordering on, a signal handler's (SIGINT, SIGALRM) included;
- rewrite_graph's arguments and a tf.Graph that changes while it is read;
- messages: NaN epsilon, towers without a device, inspect --json on failure.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from io import StringIO

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.training.moving_averages import assign_moving_average

import bnrewrite
import ticks
from bnrewrite import BnRewriteError, GraphValidationError, InputFormatError, io, rewrite_graph
from bnrewrite.io import sniff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "TF_CPP_MIN_LOG_LEVEL": "3"}
MiB = 1 << 20


def _towers(towers: int = 2, layers: int = 1) -> tf.compat.v1.GraphDef:
    """K towers of `layers` fused batch norms in a row, variables shared, with gradients and
    moving-average updates."""
    graph = tf.Graph()
    with graph.as_default():
        params = []
        for i in range(layers):
            with tf.compat.v1.variable_scope(f"bn{i}"):
                params.append([tf.compat.v1.get_variable(n, initializer=np.full(2, v, np.float32), trainable=t)
                               for n, v, t in (("gamma", 1, True), ("beta", 0, True), ("mean", 0, False), ("var", 1, False))])
        ops = []
        for k in range(towers):
            with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"):
                x = y = tf.compat.v1.placeholder(tf.float32, [2, 3, 3, 2], name="x")
                for gamma, beta, mean, var in params:
                    y, m, v = tf.compat.v1.nn.fused_batch_norm(y, gamma, beta, is_training=True)
                    ops += [assign_moving_average(mean, m, 0.9, zero_debias=False),
                            assign_moving_average(var, v, 0.9, zero_debias=False)]
                    y = tf.nn.relu(y)
                ops += tf.gradients(tf.reduce_sum(tf.square(y)), [x] + [p for ps in params for p in ps[:2]])
        tf.group(*ops, name="train_op")
    return graph.as_graph_def()


@pytest.fixture(scope="module")
def base() -> tf.compat.v1.GraphDef:
    return _towers()


def _copy(graph_def):
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    return out


def _cli(*args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float, int]:
    """Run `python -m bnrewrite ARGS` in a subprocess: the result, its wall time and its peak
    resident memory in KiB (a wrapper process measures its one child)."""
    wrapper = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
               "p = subprocess.run([sys.executable, '-m', 'bnrewrite', *sys.argv[1:]]); "
               "sys.stderr.write(f'\\n@@ {time.perf_counter() - t} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\\n'); "
               "sys.exit(p.returncode)")
    proc = subprocess.run([sys.executable, "-c", wrapper, *args], capture_output=True, text=True, env=ENV, timeout=timeout)
    stderr, _, figures = proc.stderr.rpartition("\n@@ ")
    seconds, rss = figures.split()
    proc.stderr = stderr
    return proc, float(seconds), int(rss)


# ---------------------------------------------------------------------------
# Sniffing: bounded memory, no TensorFlow, named
# ---------------------------------------------------------------------------


def test_sniff_field_tables_match_tensorflow():
    """The hand-written top-level field tables agree with TensorFlow's descriptors."""
    pb = io.model.protos()
    for kind, cls in (("pb", pb.GraphDef), ("meta", pb.MetaGraphDef), ("savedmodel", pb.SavedModel)):
        table = {}
        for field in cls.DESCRIPTOR.fields:
            delimited = field.type in (field.TYPE_MESSAGE, field.TYPE_STRING, field.TYPE_BYTES)
            table[field.number] = (2 if delimited else 0, field.is_repeated)
        assert sniff.FIELDS[kind] == table, kind


def test_zero_bytes_rejected_fast_without_tensorflow(tmp_path):
    """A 50 MB file of zero bytes: one line naming it, within seconds, in little memory, and
    TensorFlow never imported (it used to take 30 s and 2.9 GB)."""
    path = tmp_path / "zeros.pb"
    with open(path, "wb") as f:
        f.truncate(50 * MiB)
    proc, seconds, rss = _cli("inspect", str(path))
    assert proc.returncode == InputFormatError.exit_code, proc.stderr
    assert "zero bytes" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert seconds < 5 and rss < 150 * 1024, (seconds, rss)
    probe = ("import sys; from bnrewrite import io\ntry:\n    io.check_input(sys.argv[1])\nexcept Exception as e:\n"
             "    print(type(e).__name__)\nprint('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, env=ENV, timeout=60)
    assert out.stdout.split() == ["InputFormatError", "False"], out


def test_checkpoint_files_and_truncated_graphs_rejected_before_tensorflow(tmp_path, base):
    """A checkpoint's .index and .data shard and a truncated GraphDef are told apart from a
    model by check_input, which runs before TensorFlow is imported."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.get_variable("v", initializer=np.arange(1000, dtype=np.float32))
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            prefix = saver.save(sess, str(tmp_path / "ckpt"))
    with pytest.raises(InputFormatError, match=r"checkpoint's \.index file"):
        io.check_input(prefix + ".index")
    with pytest.raises(InputFormatError, match="not a GraphDef, MetaGraphDef or SavedModel"):
        io.check_input(prefix + ".data-00000-of-00001")
    data = base.SerializeToString()
    for cut in (len(data) // 3, len(data) - 1):
        (tmp_path / "cut.pb").write_bytes(data[:cut])
        with pytest.raises(InputFormatError, match="runs .* past the end of the file"):
            io.check_input(str(tmp_path / "cut.pb"))
    (tmp_path / "ok.pb").write_bytes(data)
    io.check_input(str(tmp_path / "ok.pb"))  # a real model passes


def test_many_tiny_entries_stop_the_walk_early():
    """Millions of empty repeated entries (which protobuf would turn into millions of objects)
    are no model: rejected after a few fields, whatever the length."""
    data = b"\x0a\x00" * (4 * MiB)
    start = time.perf_counter()
    with pytest.raises(InputFormatError, match="match none of these message types"):
        io.parse_bytes(data, "tiny.pb")
    assert time.perf_counter() - start < 1


def test_corrupt_graph_def_is_not_called_a_meta_graph_def(base):
    """A GraphDef whose node contents are damaged is described by what its fields fit."""
    data = bytearray(base.SerializeToString())
    data[3:7] = b"\xff\xff\xff\xff"  # inside the first node: a field runs wild
    with pytest.raises(InputFormatError) as info:
        io.parse_bytes(bytes(data), "bad.pb")
    message = str(info.value)
    assert "GraphDef" in message and "does not decode as a MetaGraphDef" not in message, message


def test_fast_errors_end_to_end(tmp_path, base):
    """inspect on a small bad file answers in about the interpreter's start-up time; on a good
    one it pays for TensorFlow's import."""
    bad = tmp_path / "bad.pb"
    bad.write_bytes(base.SerializeToString()[:500])
    proc, seconds, _ = _cli("inspect", str(bad))
    assert proc.returncode == InputFormatError.exit_code and seconds < 3, (proc.stderr, seconds)
    missing, seconds_missing, _ = _cli("inspect", str(tmp_path / "missing.pb"))
    assert missing.returncode == InputFormatError.exit_code and seconds_missing < 3


# ---------------------------------------------------------------------------
# Malformed graphs: classified errors
# ---------------------------------------------------------------------------


def _bn(graph_def):
    return next(n for n in graph_def.node if n.op.startswith("FusedBatchNormV"))


def _grad(graph_def):
    return next(n for n in graph_def.node if n.op.startswith("FusedBatchNormGrad"))


def _set(attr, **value):
    def mutate(graph_def):
        target = _bn(graph_def) if attr != "grad_T" else _grad(graph_def)
        field, content = next(iter(value.items()))
        setattr(target.attr[attr.removeprefix("grad_")], field, content)
    return mutate


def _device(spec):
    def mutate(graph_def):
        _bn(graph_def).device = spec
    return mutate


def _read_output(index):
    def mutate(graph_def):
        graph_def.node[-1].input.insert(0, f"{_bn(graph_def).name}:{index}")
    return mutate


def _untouched(mutate_node):
    """Mutate the first Relu: a node the rewrite copies as it is."""
    def mutate(graph_def):
        mutate_node(next(n for n in graph_def.node if n.op == "Relu"), graph_def)
    return mutate


def _feed_int32(node, graph_def):
    """Feed `node` (taking float) a new int32 Const."""
    const = graph_def.node.add(name="ints", op="Const")
    const.attr["dtype"].type = tf.int32.as_datatype_enum
    const.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.zeros([2, 3, 3, 2], np.int32)))
    node.input[0] = const.name


def _float_into_resource(graph_def):
    """A VarIsInitializedOp (taking a resource) reading a Relu's float output."""
    relu = next(n for n in graph_def.node if n.op == "Relu")
    next(n for n in graph_def.node if n.op == "VarIsInitializedOp").input[0] = relu.name


def _huge_count(graph_def):
    """An AddN whose N says 2**62 inputs (a few bytes asking for exabytes if listed)."""
    relu = next(n for n in graph_def.node if n.op == "Relu")
    add = graph_def.node.add(name="sum_of_many", op="AddN", input=[relu.name, relu.name])
    add.attr["T"].type = tf.float32.as_datatype_enum
    add.attr["N"].i = 2**62


def _bn_input(slot, other):
    """Swap data input `slot` of the first forward (other < 0: of its gradient, with slot -other)."""
    def mutate(graph_def):
        node = _bn(graph_def) if other >= 0 else _grad(graph_def)
        j = abs(other)
        node.input[slot], node.input[j] = node.input[j], node.input[slot]
    return mutate


MALFORMED = [
    ("unregistered_op", _untouched(lambda n, g: setattr(n, "op", "NoSuchOp")),
     "op 'NoSuchOp' is neither a TensorFlow op nor a function of the graph's library"),
    ("attr_of_wrong_kind", _untouched(lambda n, g: setattr(n.attr["T"], "s", b"float")),
     r"\(Relu\): attr T holds a string value where Relu takes a type"),
    ("dtype_not_allowed", _untouched(lambda n, g: setattr(n.attr["T"], "type", tf.string.as_datatype_enum)),
     r"\(Relu\): attr T is DT_STRING; Relu takes DT_"),
    ("required_attr_missing", _untouched(lambda n, g: n.attr.pop("T")), r"\(Relu\): attr T is missing"),
    ("extra_input", _untouched(lambda n, g: n.input.append(n.input[0])), r"\(Relu\) has 2 data inputs; Relu takes 1"),
    ("data_after_control", _untouched(lambda n, g: n.input.insert(0, "^" + _bn(g).name)), "comes after a control input"),
    ("colocated_with_nothing", _untouched(lambda n, g: n.attr["_class"].list.s.append(b"loc:@gone")),
     "to be colocated with 'gone', which does not exist"),
    ("bn_channels_mismatch", _set("data_format", s=b"NCHW"), "has 2 channels where .* has 3"),
    ("grad_dy_a_vector", _bn_input(0, -3), r"input 0 '.*FusedBatchNormV3:3' has shape \[2\], of rank 1; it takes rank 4"),
    ("epsilon_string", _set("epsilon", s=b"0.001"), "attr epsilon holds a string value"),
    ("avg_factor_string", _set("exponential_avg_factor", s=b"1"), "attr exponential_avg_factor holds a string"),
    ("T_unknown_enum", _set("T", type=77), "attr T is unknown dtype 77"),
    ("T_int32", _set("T", type=tf.int32.as_datatype_enum), "attr T is DT_INT32; FusedBatchNormV3 takes"),
    ("grad_T_int32", _set("grad_T", type=tf.int32.as_datatype_enum), "attr T is DT_INT32; FusedBatchNormGradV3"),
    ("output_999", _read_output(999), "reads '.*:999', but .* has 6 outputs"),
    ("float_into_resource", _float_into_resource,
     r"\(VarIsInitializedOp\) input 0 reads '.*Relu:0' of float, where it takes resource$"),
    ("int32_into_relu", _untouched(_feed_int32), r"\(Relu\) input 0 reads 'ints:0' of int32, where it takes float$"),
    ("count_of_2_62", _huge_count, r"'sum_of_many' \(AddN\) has 2 data inputs; AddN takes 4611686018427387904$"),
    ("task_abc", _device("/job:worker/task:abc/device:CPU:0"), "task 'abc' is not a number"),
    ("replica_x", _device("/replica:x/device:CPU:0"), "replica 'x' is not a number"),
]


@pytest.mark.parametrize("case,mutate,message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_graph_is_a_validation_error(base, case, mutate, message):
    graph_def = _copy(base)
    mutate(graph_def)
    with pytest.raises(GraphValidationError, match=message):
        rewrite_graph(graph_def)


def _main(*args: str) -> tuple[int, str, str]:
    """The command line's main() run in this process on ARGS: (exit code, stderr, stdout)."""
    from bnrewrite.cli import main

    err, out = StringIO(), StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(list(args))
    return code, err.getvalue(), out.getvalue()


def test_malformed_graph_through_the_command_line(tmp_path, base):
    """T int32 on a batch norm: convert (run by main() in process) exits 11 (GraphValidationError),
    nothing written; it used to exit 0 with an output TensorFlow cannot import."""
    graph_def = _copy(base)
    _set("T", type=tf.int32.as_datatype_enum)(graph_def)
    path, out = tmp_path / "in.pb", tmp_path / "out.pb"
    path.write_bytes(graph_def.SerializeToString())
    code, err, _ = _main("convert", str(path), str(out))
    assert code == GraphValidationError.exit_code, err
    assert err.startswith("bnrewrite: error: ") and "DT_INT32" in err
    assert not out.exists()


@pytest.mark.parametrize("case", ["unregistered_op", "attr_of_wrong_kind", "extra_input", "grad_dy_a_vector",
                                  "float_into_resource"])
def test_untouched_node_tensorflow_rejects_through_the_command_line(tmp_path, base, case):
    """A node the rewrite would copy as it is, which TensorFlow's import rejects: convert (run by
    main() in process) exits with GraphValidationError's code and one line, nothing written;
    it used to exit 0 with an output TensorFlow cannot import."""
    graph_def = _copy(base)
    next(m for m in MALFORMED if m[0] == case)[1](graph_def)
    path, out = tmp_path / "in.pb", tmp_path / "out.pb"
    path.write_bytes(graph_def.SerializeToString())
    code, err, _ = _main("convert", str(path), str(out))
    assert code == GraphValidationError.exit_code, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bnrewrite: error: node "), lines
    assert not out.exists() and os.listdir(tmp_path) == ["in.pb"]


def _reference_variable_towers() -> tf.compat.v1.GraphDef:
    """Two towers of a batch norm whose variables are reference variables (VariableV2: Identity,
    Assign, ApplyMomentum and, through a cond v1, RefSwitch and RefMerge read their _ref outputs)."""
    from tensorflow.python.ops import control_flow_util

    graph, v2 = tf.Graph(), control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
    try:
        with graph.as_default():
            with tf.compat.v1.variable_scope("bn", use_resource=False):
                gamma, beta, mean, var = (tf.compat.v1.get_variable(n, initializer=np.full(2, v, np.float32), trainable=t)
                                          for n, v, t in (("gamma", 1, True), ("beta", 0, True), ("mean", 0, False),
                                                          ("var", 1, False)))
            grads, updates = [], []
            for k in range(2):
                with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"):
                    x = tf.compat.v1.placeholder(tf.float32, [2, 3, 3, 2], name="x")
                    y, m, v = tf.compat.v1.nn.fused_batch_norm(x, gamma, beta, is_training=True)
                    updates += [assign_moving_average(mean, m, 0.9, zero_debias=False),
                                assign_moving_average(var, v, 0.9, zero_debias=False)]
                    grads.append(tf.gradients(tf.reduce_sum(tf.square(y)), [gamma, beta]))
            step = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).apply_gradients(
                [(tf.add_n([g[i] for g in grads]), p) for i, p in enumerate((gamma, beta))])
            with tf.compat.v1.variable_scope("other", use_resource=False):
                other = tf.compat.v1.get_variable("other", initializer=np.zeros(2, np.float32), trainable=False)
            chosen = tf.compat.v1.cond(tf.reduce_sum(gamma) > 0, lambda: tf.compat.v1.assign_add(other, gamma),
                                       lambda: tf.compat.v1.assign_sub(other, gamma))
            tf.group(step, chosen, *updates, name="train_op")
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = v2
    return graph.as_graph_def()


def test_reference_variables_pass_the_dtype_check():
    """Reference outputs read where their base dtype is taken (Identity, Mul, the cond's
    RefSwitch) and where a reference is (Assign, ApplyMomentum) are no error: the graph is
    rewritten and the output imports. A value fed to a reference input is refused, as
    TensorFlow's import refuses it."""
    graph_def = _reference_variable_towers()
    ops = {n.op for n in graph_def.node}
    assert {"VariableV2", "Assign", "ApplyMomentum", "RefSwitch"} <= ops, ops
    result = rewrite_graph(graph_def)
    assert len(result.report.layers) == 1 and result.report.collectives > 0, result.report
    with tf.Graph().as_default():
        tf.compat.v1.import_graph_def(result.graph_def, name="")
    assign = next(n for n in graph_def.node if n.op == "Assign")
    assign.input[0] = "tower_0/x"
    with pytest.raises(GraphValidationError, match=rf"'{assign.name}' \(Assign\) input 0 reads 'tower_0/x:0' of float, "
                                                   "where it takes float_ref$"):
        rewrite_graph(graph_def)


def test_long_identity_chain_between_batch_norm_and_gradient(base):
    """3,000 Identity ops between a batch norm's reserve space and its gradient: the chain is
    followed with a loop (it raised RecursionError), and the output imports."""
    graph_def = _copy(base)
    grad = _grad(graph_def)
    previous = grad.input[3]
    for i in range(3000):
        node = graph_def.node.add(name=f"chain/{i}", op="Identity", input=[previous])
        node.attr["T"].type = tf.float32.as_datatype_enum
        previous = node.name
    grad.input[3] = previous
    result = rewrite_graph(graph_def)
    assert result.report.layers and all(row.gradients for row in result.report.layers)
    assert io.import_check(io.Entry(result.graph_def)) is None  # tf.import_graph_def


def test_self_loop_is_reported_as_itself(base):
    graph_def = _copy(base)
    node = graph_def.node[5]
    node.input.append(f"^{node.name}")
    with pytest.raises(GraphValidationError, match=f"cycle: {node.name} -> {node.name}$"):
        rewrite_graph(graph_def)


def test_cycle_names_only_nodes_on_it(base):
    graph_def = _copy(base)
    a = _bn(graph_def)
    b = next(n for n in graph_def.node if n.input and n.input[0] == a.name)
    a.input.append(f"^{b.name}")
    with pytest.raises(GraphValidationError) as info:
        rewrite_graph(graph_def)
    shown = str(info.value).split("cycle: ")[1].split(" -> ")
    assert shown[0] == shown[-1] and sorted(shown[1:]) == sorted([a.name, b.name]), shown
    # every edge shown is in the graph
    inputs = {n.name: {i.lstrip("^").split(":")[0] for i in n.input} for n in graph_def.node}
    assert all(src in inputs[dst] for src, dst in zip(shown, shown[1:]))


# ---------------------------------------------------------------------------
# Linear graph queries
# ---------------------------------------------------------------------------


def test_wide_fan_in_costs_no_more_than_its_edges(monkeypatch):
    """One node with a control input from every node: the input parsing the rewrite does (and
    its time) stays within 1.5 x the same graph without that node (each consumer's inputs
    used to be parsed again for every producer asked about)."""
    import bnrewrite.graph.index as graph_module

    plain = _towers(towers=2, layers=12)
    wide = _copy(plain)
    wide.node.add(name="wide_fan_in", op="NoOp", input=[f"^{n.name}" for n in plain.node])
    parse = graph_module.parse_input
    counted = {"calls": 0}

    def counting(spec):
        counted["calls"] += 1
        return parse(spec)

    monkeypatch.setattr(graph_module, "parse_input", counting)
    work, seconds = {}, {}
    for label, graph_def in (("plain", plain), ("wide", wide)):
        counted["calls"] = 0
        rewrite_graph(graph_def)
        work[label] = counted["calls"]
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            rewrite_graph(graph_def)
            runs.append(time.perf_counter() - start)
        seconds[label] = min(runs)
    assert work["wide"] <= 1.5 * work["plain"], work
    assert seconds["wide"] <= 2.5 * seconds["plain"], seconds  # 1.5 on a quiet machine; shared CI is noisy


# ---------------------------------------------------------------------------
# in_place: all or nothing
# ---------------------------------------------------------------------------


def _meta_of(graph_def):
    meta = tf.compat.v1.MetaGraphDef()
    meta.graph_def.CopyFrom(graph_def)
    meta.collection_def["train_op"].node_list.value.append("train_op")
    meta.collection_def["updates"].node_list.value.extend(n.name for n in graph_def.node if n.op == "AssignVariableOp")
    return meta


def _interrupted_at(message, n: int, how: str) -> tuple[int, bool]:
    """rewrite_graph(message, in_place=True), interrupted at the n-th call of a bnrewrite
    function: KeyboardInterrupt raised there ("raise") or a real SIGINT sent ("signal").
    Returns (calls seen, whether it was interrupted)."""
    package = os.path.dirname(bnrewrite.__file__)
    calls = [0]

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls[0] += 1
            if calls[0] == n:
                if how == "raise":
                    raise KeyboardInterrupt(f"injected at call {n}")
                os.kill(os.getpid(), signal.SIGINT)
        return None

    gc.disable()  # no collection in the run: it could close an earlier run's generators, as calls counted here
    sys.settrace(tracer)
    try:
        rewrite_graph(message, in_place=True)
    except KeyboardInterrupt:
        return calls[0], True
    finally:
        sys.settrace(None)
        gc.enable()
    return calls[0], False


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # generators the interrupt closes
@pytest.mark.parametrize("kind", ["graph_def", "meta_graph_def"])
def test_in_place_interrupted_anywhere_leaves_the_input_as_it_was(base, kind):
    """Interrupt at points spread over the whole rewrite and at every one of the last calls
    (the final assembly): the message is equal to before (deterministic bytes: a map's order
    is not part of a message), or the rewrite completed; SIGINT's handler is the one before."""
    original = base if kind == "graph_def" else _meta_of(base)
    rewrite_graph(_copy(original))  # a first rewrite fills caches: the calls counted next are those of every run
    total, _ = _interrupted_at(_copy(original), 0, "raise")
    points = sorted({*range(1, total, max(1, total // 40)), *range(max(1, total - 60), total + 1)})
    before = original.SerializeToString(deterministic=True)
    interrupted, completed = 0, []
    handler = signal.getsignal(signal.SIGINT)
    for n in points:
        for how in ("raise", "signal") if n > total - 60 else ("raise",):
            message = _copy(original)
            calls, stopped = _interrupted_at(message, n, how)
            assert signal.getsignal(signal.SIGINT) is handler, (n, how)  # put back, whatever was interrupted
            if stopped:
                interrupted += 1
                assert message.SerializeToString(deterministic=True) == before, (n, how)
            else:
                completed.append((n, how, calls))
                assert message.SerializeToString(deterministic=True) != before
    assert interrupted >= len(points), (total, completed)


@contextlib.contextmanager
def _alarm_raises():
    """SIGALRM's handler raises KeyboardInterrupt, as a signal-based timeout's does."""
    def on_alarm(signum, frame):
        raise KeyboardInterrupt("SIGALRM")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        yield
    finally:
        signal.signal(signal.SIGALRM, previous)


def _handlers() -> dict:
    """The Python handler of each signal that has one."""
    return {s: h for s in signal.valid_signals() if callable(h := signal.getsignal(s))}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # generators the interrupt closes
def test_in_place_exception_at_any_bytecode_from_the_reordering_on(base):
    """rewrite_graph(message, in_place=True) with an exception at a bytecode from the moment the
    nodes start being put in order to the call's return instruction (tests/ticks.py; CPython
    runs no signal handler right before a return, and after it the call has returned): raised
    there (a MetaGraphDef: at the first bytecode of each line of bnrewrite's code in that span,
    and at its first and last), or by a SIGALRM handler, as pytest-timeout's, that a signal sent
    there runs (a GraphDef and a MetaGraphDef: 12 points spread over it). The message is
    byte-identical to before, or, when the exception was lost (one raised in a finished
    generator's close is only printed), the rewrite's result; the signal handlers are as they
    were."""
    from bnrewrite.graph.index import Graph

    start, outer = Graph.to_graph_def.__code__, bnrewrite.rewrite.api.rewrite_graph.__code__
    handlers = _handlers()

    def interrupted(original, n: int, action) -> tuple[bytes, list]:
        """The message's bytes after the call interrupted at tick n, and the ticks seen ([]: interrupted)."""
        message = _copy(original)
        try:
            seen = ticks.run_ticked(lambda: rewrite_graph(message, in_place=True), start, outer, n, action)
        except KeyboardInterrupt:
            seen = []
        return message.SerializeToString(deterministic=True), seen

    bad = []
    for kind, original in (("graph_def", base), ("meta_graph_def", _meta_of(base))):
        before = original.SerializeToString(deterministic=True)
        result = rewrite_graph(original)
        expected = (result.meta_graph_def if kind == "meta_graph_def" else result.graph_def).SerializeToString(
            deterministic=True)
        done, seen = interrupted(original, 0, None)
        assert done == expected != before
        window = seen[:max(i for i, t in enumerate(seen) if t.code is outer and t.event == "opcode")]  # to RETURN_VALUE
        if kind == "meta_graph_def":
            package = os.path.dirname(bnrewrite.__file__)
            points = ticks.spread(window, lambda code: code.co_filename.startswith(package))
            assert len(points) > 30
            for n in points:
                data, seen = interrupted(original, n, _raise_keyboard_interrupt)
                for signum, handler in handlers.items():  # a tick inside the handlers' swap may leave one held
                    signal.signal(signum, handler)
                if data != (expected if seen else before):
                    bad.append((kind, "raise", n, window[n - 1]))
        with _alarm_raises():
            for n in sorted({*range(1, len(window) + 1, max(1, len(window) // 11)), len(window)}):
                data, seen = interrupted(original, n, lambda: signal.raise_signal(signal.SIGALRM))
                if seen or data != before:
                    bad.append((kind, "alarm", n, window[n - 1]))
            assert {s: h for s, h in _handlers().items() if s != signal.SIGALRM} == {
                s: h for s, h in handlers.items() if s != signal.SIGALRM}
    assert bad == []


def _raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt("injected")


def test_in_place_pass_failure_leaves_the_input_as_it_was(base, monkeypatch):
    """An exception from the final assembly itself (patched to fail after its sort)."""
    from bnrewrite.graph.index import Graph

    graph_def = _copy(base)
    before = graph_def.SerializeToString(deterministic=True)
    real = Graph._assemble_in_place

    def failing(self):
        real(self)
        raise MemoryError("injected after the assembly")

    monkeypatch.setattr(Graph, "_assemble_in_place", failing)
    with pytest.raises(MemoryError):
        rewrite_graph(graph_def, in_place=True)
    assert graph_def.SerializeToString(deterministic=True) == before


# ---------------------------------------------------------------------------
# The API's arguments
# ---------------------------------------------------------------------------


BAD_ARGUMENTS = [
    ({"group_size": 0}, "group_size=0 is not valid; give a positive integer"),
    ({"group_size": "2"}, "group_size='2' is not valid"),
    ({"group_size": True}, "group_size=True is not valid"),
    ({"timeout_seconds": -5}, "timeout_seconds=-5 is not valid; give a finite number of seconds, 0 or more"),
    ({"timeout_seconds": math.nan}, "timeout_seconds=nan is not valid"),
    ({"timeout_seconds": math.inf}, "timeout_seconds=inf is not valid"),
    ({"timeout_seconds": "10"}, "timeout_seconds='10' is not valid"),
    ({"num_workers": 0}, "num_workers=0 is not valid; give a positive integer"),
    ({"num_workers": 2.0, "task_index": 0}, "num_workers=2.0 is not valid"),
    ({"num_workers": 2, "task_index": 2}, "task_index=2 is not valid; give an integer from 0 to 1"),
    ({"task_index": "0"}, "task_index='0' is not valid"),
    ({"tower_by": None}, "unknown tower_by None"),
    ({"if_rewritten": ["keep"]}, "unknown if_rewritten"),
    ({"in_place": "yes"}, "in_place='yes' is not valid"),
]


@pytest.mark.parametrize("kwargs,message", BAD_ARGUMENTS, ids=[str(a[0]) for a in BAD_ARGUMENTS])
def test_bad_arguments_name_the_valid_range(base, kwargs, message):
    graph_def = _copy(base)
    with pytest.raises(BnRewriteError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rewrite_graph(graph_def, **kwargs)
    assert graph_def == base


def test_graph_changed_by_another_thread_is_read_whole_or_refused(base):
    """A tf.Graph another thread keeps adding ops to: a consistent result (every collection
    entry in the graph it came with) or a BnRewriteError, never a raw KeyError."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(base, name="")
    stop = threading.Event()

    def grow():
        with graph.as_default():
            i = 0
            while not stop.is_set():
                op = tf.constant(float(i), name=f"grown_{i}").op
                graph.add_to_collection("grown", op)
                i += 1

    thread = threading.Thread(target=grow, daemon=True)
    thread.start()
    try:
        outcomes = set()
        for _ in range(5):
            try:
                result = rewrite_graph(graph)
            except BnRewriteError as exc:
                outcomes.add(type(exc).__name__)
                continue
            names = {n.name for n in result.graph_def.node}
            grown = result.meta_graph_def.collection_def["grown"].node_list.value
            assert all(v in names for v in grown)
            result.to_graph()
            outcomes.add("consistent")
    finally:
        stop.set()
        thread.join()
    assert outcomes <= {"consistent", "BnRewriteError"}, outcomes


# ---------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------


def test_nan_epsilon_on_every_tower_lines_up():
    """NaN equals NaN when towers are compared (it said "epsilon differs (nan vs nan)")."""
    graph_def = _towers()
    for node in graph_def.node:
        if node.op.startswith("FusedBatchNorm"):
            node.attr["epsilon"].f = math.nan
    result = rewrite_graph(graph_def)
    assert len(result.report.layers) == 1


def test_tower_without_device_is_shown_as_no_device():
    """A tower whose batch norm has no device is "(no device)" in messages (it printed
    "found towers , /device:CPU:1")."""
    graph_def = _towers()
    for node in graph_def.node:
        if node.op == "FusedBatchNormV3":
            if node.name.startswith("tower_0/"):
                node.device = ""
            else:
                node.attr["epsilon"].f = 0.5  # the towers no longer line up
    with pytest.raises(BnRewriteError, match=r"found towers \(no device\), /device:CPU:1 but no batch-norm layer"):
        rewrite_graph(graph_def, tower_by="device")


def test_inspect_json_prints_json_on_failure(tmp_path, base):
    """Format, validation and nothing-to-do failures all print one JSON document with the error
    (the format errors from a process of its own, which imports no TensorFlow for them; the
    validation error from main() in this process)."""
    zeros = tmp_path / "zeros.pb"
    zeros.write_bytes(b"\0" * 1000)
    malformed = _copy(base)
    _set("T", type=77)(malformed)
    bad_graph = tmp_path / "bad_graph.pb"
    bad_graph.write_bytes(malformed.SerializeToString())
    for path, error in ((zeros, "InputFormatError"), (bad_graph, "GraphValidationError"), (tmp_path / "nothing", "InputFormatError")):
        if error == "InputFormatError":
            proc, _, _ = _cli("inspect", str(path), "--json")
            code, err, out = proc.returncode, proc.stderr, proc.stdout
        else:
            code, err, out = _main("inspect", str(path), "--json")
        document = json.loads(out)
        assert document["error"]["class"] == error, document
        assert document["error"]["exit_code"] == code != 0
        assert document["error"]["message"] in err


def test_fifo_inside_a_saved_model_is_an_input_error(tmp_path):
    """A FIFO inside the SavedModel is named as the input's problem (exit 3) before anything is
    parsed or copied (it came out as an output error, exit 10, with a Python list repr)."""
    from model_files import SPEC, write_saved_model
    from models import build_towers

    saved = str(tmp_path / "saved")
    write_saved_model(saved, build_towers(SPEC), SPEC)
    io.check_input(saved)
    os.mkfifo(os.path.join(saved, "variables", "pipe"))
    with pytest.raises(InputFormatError, match=r"holds variables/pipe, a FIFO \(named pipe\), not a file or folder; remove it"):
        io.check_input(saved)
    proc, _, _ = _cli("convert", saved, str(tmp_path / "out"))
    assert proc.returncode == InputFormatError.exit_code and "variables/pipe" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------
# Millions of near-empty nodes: refused before any per-node index is built
# ---------------------------------------------------------------------------


def _no_ops(count: int, name_length: int) -> bytes:
    """The serialized nodes of a GraphDef: `count` NoOps with names of `name_length` characters."""
    parts = []
    for i in range(count):
        name = f"{i:0{name_length}d}"[-name_length:].encode() if name_length >= len(str(i)) else str(i).encode()
        node = b"\x0a" + bytes([len(name)]) + name + b"\x12\x04NoOp"
        parts.append(b"\x0a" + bytes([len(node)]) + node)
    return b"".join(parts)


def test_graph_of_near_empty_nodes_is_refused_before_indexing(base, tmp_path):
    """Above graph.DENSITY_FROM_NODES nodes, a graph averaging under MIN_NODE_BYTES a node is an
    InputFormatError (the API; the command line: exit 3, one line); just above the floor it is
    indexed (and then refused for what it is: no towers among the NoOps)."""
    from bnrewrite.graph.index import DENSITY_FROM_NODES, MIN_NODE_BYTES, Graph

    count = DENSITY_FROM_NODES + 1 - len(base.node)
    tiny = tf.compat.v1.GraphDef.FromString(base.SerializeToString() + _no_ops(count, 1))
    assert tiny.ByteSize() < MIN_NODE_BYTES * len(tiny.node)
    with pytest.raises(InputFormatError, match=r"the graph has 100,001 nodes in [\d,]+ bytes \(\d+ bytes a node\); "
                                               r"a model's nodes .* take at least 64 bytes each"):
        rewrite_graph(tiny)
    path = tmp_path / "tiny.pb"
    path.write_bytes(tiny.SerializeToString())
    code, err, _ = _main("convert", str(path), str(tmp_path / "out.pb"))
    assert code == InputFormatError.exit_code and len(err.splitlines()) == 1, err
    assert "100,001 nodes" in err and not (tmp_path / "out.pb").exists()

    dense = tf.compat.v1.GraphDef.FromString(base.SerializeToString() + _no_ops(count, MIN_NODE_BYTES - 8))
    assert dense.ByteSize() >= MIN_NODE_BYTES * len(dense.node)
    assert len(Graph.from_graph_def(dense)) == DENSITY_FROM_NODES + 1


@pytest.mark.slow
def test_memory_on_a_million_near_empty_nodes_is_a_small_multiple_of_the_file(tmp_path, base):
    """A GraphDef of 1M NoOps with 1-4 character names: rewrite_graph in a fresh process
    refuses it, its peak memory over the baseline (TensorFlow imported) within 16 times the
    file, most of it the protobuf parse (docs/performance-history.md, "Millions of near-empty nodes")."""
    path = tmp_path / "tiny.pb"
    path.write_bytes(base.SerializeToString() + _no_ops(1_000_000, 4))
    script = ("import resource, sys; from tensorflow.core.framework import graph_pb2; import bnrewrite\n"
              "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
              "graph_def = graph_pb2.GraphDef.FromString(open(sys.argv[1], 'rb').read())\n"
              "try:\n    bnrewrite.rewrite_graph(graph_def)\nexcept bnrewrite.InputFormatError:\n    print('refused')\n"
              "print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    verdict, figures = proc.stdout.splitlines()
    before, after = (int(v) * 1024 for v in figures.split())
    assert verdict == "refused"
    assert after - before <= 16 * path.stat().st_size, (after - before) / path.stat().st_size
