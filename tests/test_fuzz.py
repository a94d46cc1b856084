"""Fuzz: mutated graphs through the API and the command line's path end in a valid rewritten
graph (one TensorFlow imports) or a BnRewriteError, never in any other exception.

Mutations: deleted nodes, inputs to missing nodes or outputs (x:999), wrong attributes
(data_format "XYZW", is_training flipped, T/U changed or no DataType, epsilon NaN or a string,
...), changed op types and attrs of the wrong kind on any node, devices (task:abc, replica:x, ...), duplicate names, cycles and
self-loops, Identity chains (up to 3,000 long) between a batch norm and its gradient,
bnrewrite's mark on stray nodes, truncated bytes and byte flips. The totals by outcome are
printed by the last test (run pytest with -s to see them). The whole module is slow.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import zlib
from collections import Counter

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensorflow.core.framework import types_pb2
from tensorflow.python.client import pywrap_tf_session as c_api
from tensorflow.python.framework import c_api_util
from tensorflow.python.training.moving_averages import assign_moving_average

from bnrewrite import BnRewriteError, io, rewrite_graph
from bnrewrite.io import sniff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTALS: Counter = Counter()
FUZZ = settings(
    deadline=None, database=None, derandomize=not os.environ.get("BNREWRITE_FUZZ_RANDOM"),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
BN_OPS = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
DTYPES = (types_pb2.DT_FLOAT, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16, types_pb2.DT_DOUBLE,
          types_pb2.DT_INT32, types_pb2.DT_STRING, types_pb2.DT_INVALID)


# ---------------------------------------------------------------------------
# Base graphs (built once)
# ---------------------------------------------------------------------------


def _small(towers: int = 2, data_format: str = "NHWC") -> tf.compat.v1.GraphDef:
    """K towers of fused batch norm with shared variables, gradients and moving-average updates."""
    graph = tf.Graph()
    shape = [2, 3, 3, 2] if data_format == "NHWC" else [2, 2, 3, 3]
    with graph.as_default():
        with tf.compat.v1.variable_scope("net"):
            gamma = tf.compat.v1.get_variable("gamma", initializer=np.ones(2, np.float32))
            beta = tf.compat.v1.get_variable("beta", initializer=np.zeros(2, np.float32))
            mean = tf.compat.v1.get_variable("moving_mean", initializer=np.zeros(2, np.float32), trainable=False)
            var = tf.compat.v1.get_variable("moving_variance", initializer=np.ones(2, np.float32), trainable=False)
        ops = []
        for k in range(towers):
            with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"):
                x = tf.compat.v1.placeholder(tf.float32, shape, name="x")
                y, m, v = tf.compat.v1.nn.fused_batch_norm(x, gamma, beta, is_training=True, data_format=data_format)
                loss = tf.reduce_sum(tf.square(y), name="loss")
                ops += tf.gradients(loss, [x, gamma, beta])
                ops += [assign_moving_average(mean, m, 0.9, zero_debias=False),
                        assign_moving_average(var, v, 0.9, zero_debias=False)]
        tf.group(*ops, name="train_op")
    return graph.as_graph_def()


@pytest.fixture(scope="module")
def bases():
    from model_files import SPEC
    from models import build_towers

    built = build_towers(SPEC)
    with built.graph.as_default():
        meta = tf.compat.v1.train.export_meta_graph(graph=built.graph, clear_devices=False)
    return {
        "small_nhwc": _small(2, "NHWC"),
        "small_nchw": _small(2, "NCHW"),
        "small_k3": _small(3, "NHWC"),
        "towers": built.graph.as_graph_def(),
        "meta": meta,
    }


# ---------------------------------------------------------------------------
# Mutations
# ---------------------------------------------------------------------------


def _bn_nodes(graph_def) -> list:
    return [n for n in graph_def.node if n.op.startswith("FusedBatchNorm")]


def _pick(draw, items):
    return items[draw(st.integers(0, len(items) - 1))] if items else None


def _set_attr(draw, node) -> str:
    key = draw(st.sampled_from(["data_format", "is_training", "T", "U", "epsilon", "exponential_avg_factor", "drop"]))
    if key == "data_format":
        value = draw(st.sampled_from(["XYZW", "NCHW", "NHWC", "NDHWC", "NCDHW", "", "N", "nhwc"]))
        node.attr["data_format"].s = value.encode()
        return f"{node.name}.data_format={value}"
    if key == "is_training":
        node.attr["is_training"].b = not node.attr["is_training"].b
        return f"{node.name}.is_training flipped"
    if key in ("T", "U"):
        value = draw(st.sampled_from(DTYPES))
        node.attr[key].type = value
        return f"{node.name}.{key}={types_pb2.DataType.Name(value)}"
    if key in ("epsilon", "exponential_avg_factor"):
        value = draw(st.sampled_from([0.0, -1.0, math.nan, math.inf, 1e-3, 0.5, 1e9]))
        node.attr[key].f = value
        return f"{node.name}.{key}={value}"
    attrs = sorted(node.attr)
    if attrs:
        victim = draw(st.sampled_from(attrs))
        del node.attr[victim]
        return f"{node.name}: attr {victim} deleted"
    return "no attr to drop"


#: Attr values of the wrong kind or out of range, by attr.
ODD_ATTRS = {
    "epsilon": [("s", b"0.001"), ("i", 1), ("b", True), ("type", types_pb2.DT_FLOAT)],
    "exponential_avg_factor": [("s", b"1.0"), ("i", 1)],
    "T": [("type", 77), ("type", types_pb2.DT_INT32), ("type", types_pb2.DT_INVALID), ("s", b"float"), ("f", 1.0)],
    "U": [("type", 999), ("type", types_pb2.DT_INT8), ("i", 1)],
    "data_format": [("i", 1), ("b", False), ("s", "NHWC".encode("utf-16"))],
    "is_training": [("s", b"true"), ("i", 1)],
}
ODD_DEVICES = ["/job:worker/task:abc/device:CPU:0", "/replica:x/device:CPU:0", "/task:-1/cpu:0", "/job:/cpu:0",
               "/device:CPU:abc", "/task:\u0661/cpu:0", "/job:w/replica:0/task:0/device:CPU:0", "/cpu:1/cpu:0", "//", ":"]


def _odd_attr(draw, node) -> str:
    key = draw(st.sampled_from(sorted(ODD_ATTRS)))
    field, value = draw(st.sampled_from(ODD_ATTRS[key]))
    node.attr[key].Clear()
    setattr(node.attr[key], field, value)
    return f"{node.name}.{key}.{field}={value!r}"


def _identity_chain(draw, gd) -> str:
    """Identity ops between a forward batch norm's reserve space and its gradient (or any
    node's input), `length` long."""
    readers = [n for n in gd.node if n.op.startswith("FusedBatchNormGrad") and len(n.input) > 3]
    node = _pick(draw, readers) or _pick(draw, [n for n in gd.node if n.input])
    if node is None:
        return "no input to lengthen"
    slot = 3 if node.op.startswith("FusedBatchNormGrad") else draw(st.integers(0, len(node.input) - 1))
    if node.input[slot].startswith("^"):
        return "control input"
    length = draw(st.sampled_from([1, 2, 7, 40, 3000]))
    previous = node.input[slot]
    for i in range(length):
        link = gd.node.add(name=f"fuzz_chain_{len(gd.node)}_{i}", op="Identity", input=[previous])
        link.attr["T"].type = types_pb2.DT_FLOAT
        previous = link.name
    node.input[slot] = previous
    return f"{length} Identity ops before {node.name} input {slot}"


def _mutate_once(draw, gd) -> str:
    kind = draw(st.sampled_from([
        "delete", "dangling", "bad_output", "bn_attr", "bn_attr", "bn_attr", "op", "device", "duplicate",
        "cycle", "drop_input", "swap_inputs", "mark", "rename", "odd_attr", "odd_attr", "odd_device", "big_output",
        "chain", "self_loop", "any_op", "any_attr",
    ]))
    if kind == "chain":
        return _identity_chain(draw, gd)
    nodes = list(gd.node)
    bns = _bn_nodes(gd) + [n for n in gd.node if n.op.startswith("FusedBatchNormGrad")]
    node = _pick(draw, bns) if kind in ("bn_attr", "op", "swap_inputs", "odd_attr", "odd_device") and bns else _pick(draw, nodes)
    if node is None:
        return "empty graph"
    if kind == "delete":
        gd.node.remove(node)
        return f"deleted {node.name}"
    if kind == "dangling":
        spec = draw(st.sampled_from(["missing_node", "^missing_node", "tower_9/x:0"]))
        if node.input and draw(st.booleans()):
            node.input[draw(st.integers(0, len(node.input) - 1))] = spec
        else:
            node.input.append(spec)
        return f"{node.name} reads {spec}"
    if kind == "bad_output":
        if not node.input:
            return "no input"
        slot = draw(st.integers(0, len(node.input) - 1))
        src = node.input[slot].lstrip("^").split(":")[0]
        node.input[slot] = f"{src}:{draw(st.integers(1, 9))}"
        return f"{node.name} input {slot} -> {node.input[slot]}"
    if kind == "bn_attr":
        return _set_attr(draw, node)
    if kind == "odd_attr":
        return _odd_attr(draw, node)
    if kind == "odd_device":
        node.device = draw(st.sampled_from(ODD_DEVICES))
        return f"{node.name}.device={node.device!r}"
    if kind == "big_output":
        if not node.input or node.input[0].startswith("^"):
            return "no data input"
        src = node.input[0].split(":")[0]
        node.input[0] = f"{src}:{draw(st.sampled_from([6, 7, 999, 2**31 - 1, 2**40]))}"
        return f"{node.name} input 0 -> {node.input[0]}"
    if kind == "self_loop":
        node.input.append(f"^{node.name}" if draw(st.booleans()) else node.name)
        return f"{node.name} reads itself"
    if kind == "op":
        op = draw(st.sampled_from([*BN_OPS, "FusedBatchNormGradV3", "Identity", "Relu", "NoSuchOp", "IdentityN"]))
        node.op = op
        return f"{node.name}.op={op}"
    if kind == "any_op":  # a node the rewrite copies as it is
        op = draw(st.sampled_from(["NoSuchOp", "AddN", "Relu", "VarIsInitializedOp", "Const", "ConcatV2"]))
        node.op = op
        return f"{node.name}.op={op}"
    if kind == "any_attr":
        if not node.attr:
            return "no attr"
        key = draw(st.sampled_from(sorted(node.attr)))
        field, value = draw(st.sampled_from([("s", b"x"), ("i", -1), ("f", 1.0), ("type", 77), ("b", True)]))
        node.attr[key].Clear()
        setattr(node.attr[key], field, value)
        return f"{node.name}.{key}.{field}={value!r}"
    if kind == "device":
        device = draw(st.sampled_from(["", "/cpu:0", "/device:GPU:0", "garbage", "/job:w/task:1/cpu:0", "/cpu:*"]))
        node.device = device
        return f"{node.name}.device={device!r}"
    if kind == "duplicate":
        copy = gd.node.add()
        copy.CopyFrom(node)
        return f"duplicated {node.name}"
    if kind == "cycle":
        other = _pick(draw, nodes)
        other.input.append(f"^{node.name}")
        node.input.append(f"^{other.name}")
        return f"cycle {node.name} <-> {other.name}"
    if kind == "drop_input":
        if node.input:
            del node.input[draw(st.integers(0, len(node.input) - 1))]
        return f"{node.name} lost an input"
    if kind == "swap_inputs":
        if len(node.input) >= 2:
            i, j = draw(st.integers(0, len(node.input) - 1)), draw(st.integers(0, len(node.input) - 1))
            node.input[i], node.input[j] = node.input[j], node.input[i]
        return f"{node.name} inputs swapped"
    if kind == "mark":
        node.attr["_bnrewrite"].s = b"net/bn1"
        return f"{node.name} marked"
    if kind == "rename":
        node.name = node.name + "_renamed"
        return f"renamed {node.name}"
    raise AssertionError(kind)


@st.composite
def mutated_graphs(draw, base):
    gd = tf.compat.v1.GraphDef()
    gd.CopyFrom(base)
    log = [_mutate_once(draw, gd) for _ in range(draw(st.integers(1, 3)))]
    return gd, log


# ---------------------------------------------------------------------------
# Outcomes
# ---------------------------------------------------------------------------


def _imports(graph_def) -> str | None:
    """What TensorFlow says importing `graph_def` (None: it imports). Its C++ ImportGraphDef,
    which tf.import_graph_def runs before wrapping every op in Python: the same checks (op
    registry, attrs, inputs, shape inference) in a tenth of the time."""
    graph = tf.Graph()
    options = c_api.TF_NewImportGraphDefOptions()
    try:
        with c_api_util.tf_buffer(graph_def.SerializeToString()) as buffer:
            c_api.TF_ImportGraphDefOptionsSetPrefix(options, "")
            results = c_api.TF_GraphImportGraphDefWithResults(graph._c_graph, buffer, options)
            c_api.TF_DeleteImportGraphDefResults(results)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        c_api.TF_DeleteImportGraphDefOptions(options)
    return None


def _imports_in_python(graph_def) -> str | None:
    """tf.import_graph_def itself (for the command line's outputs)."""
    try:
        with tf.Graph().as_default():
            tf.compat.v1.import_graph_def(graph_def, name="")
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return None


def _runs(graph_def) -> str | None:
    """Run one step of the graph (initializers, then train_op or every sink) fed zeros; the error or None."""
    try:
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.import_graph_def(graph_def, name="")
        ops = graph.get_operations()
        feed = {}
        for op in ops:
            if op.type == "Placeholder":
                shape = [d if d is not None and d >= 0 else 1 for d in (op.outputs[0].shape.as_list() or [])]
                feed[op.outputs[0]] = np.zeros(shape, op.outputs[0].dtype.as_numpy_dtype)
        inits = [op for op in ops if op.name == "init"] or [
            op for op in ops if op.type in ("AssignVariableOp", "Assign") and op.name.endswith("/Assign")]
        consumed = {t.op.name for op in ops for t in op.inputs} | {c.name for op in ops for c in op.control_inputs}
        targets = [op for op in ops if op.name == "train_op"] or [op for op in ops if op.name not in consumed]
        config = tf.compat.v1.ConfigProto(device_count={"CPU": 4}, allow_soft_placement=True)
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            sess.run(inits)
            sess.run(targets, feed_dict=feed)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


#: TensorFlow's message for an op whose shape function rejects its inputs (group 1: the op).
SHAPE_FAILURE = re.compile(r" for '\{\{node [^}]+\}\} = (\w+)\[")


def _graph_of(message):
    return message.graph_def if isinstance(message, tf.compat.v1.MetaGraphDef) else message


def _through_api(graph_def, log, suite: str) -> str:
    try:
        result = rewrite_graph(graph_def)
    except BnRewriteError as exc:
        outcome = type(exc).__name__
    else:
        problem = _imports(result.graph_def)
        if problem is None:
            outcome = "valid rewritten graph"
        elif (own := _imports(_graph_of(graph_def))) is not None:
            # rewrite_graph does not import its input. What TensorFlow rejects in a NodeDef or
            # an edge's dtype (opcheck.check_nodes) and a batch norm's shapes
            # (check_batch_norm_shapes) are errors; only a shape-function failure of another op,
            # one the rewrite copies as it is, may leave an output TensorFlow rejects too
            # (--verify: InputFormatError).
            failing = SHAPE_FAILURE.search(own)
            if failing is not None and not failing.group(1).startswith("FusedBatchNorm"):
                outcome = "input fails shape inference on an op kept as it is, output too"
            else:
                TOTALS[(suite, "INVALID OUTPUT")] += 1
                raise AssertionError(f"rewrite_graph succeeded on an input TensorFlow rejects: {own}\nmutations: {log}")
        elif _runs(_graph_of(graph_def)) is not None:
            # Imports, but cannot run a step (e.g. a gradient op fed the wrong tensor, which
            # import-time shape inference lets through): nothing a rewrite can keep valid.
            outcome = "input not runnable, output not importable"
        else:
            TOTALS[(suite, "INVALID OUTPUT")] += 1
            raise AssertionError(f"rewrite_graph made an importable graph unimportable: {problem}\nmutations: {log}")
    TOTALS[(suite, outcome)] += 1
    return outcome


def _parsed(data: bytes):
    kind, message = io.parse_bytes(data)
    return message.graph_def if hasattr(message, "graph_def") else message


def _through_cli_path(data: bytes, log, suite: str, verify: bool = True) -> str:
    """What `bnrewrite convert [--verify]` does in-process: parse, validate, rewrite (which
    refuses a graph TensorFlow's import rejects), verify, serialize."""
    try:
        if data:
            sniff.sniff_head(data[: sniff.HEAD_BYTES], "fuzz.pb")  # what io.check_input runs before TensorFlow
        kind, message = io.parse_bytes(data, "fuzz.pb")
        model = io.make_model("fuzz.pb", kind, message)
        io.validate(model)
        rewrite = io.rewrite(model, None)
        if verify:
            io.verify(rewrite)
        io.serialize(io.as_format(rewrite.model, model.format))
    except BnRewriteError as exc:
        outcome = type(exc).__name__
    else:
        for outcome_ in rewrite.outcomes if not verify else ():  # --verify imported them already
            problem = _imports(outcome_.result.graph_def)
            if problem is not None:
                TOTALS[(suite, "INVALID OUTPUT")] += 1
                raise AssertionError(f"convert produced a graph TensorFlow cannot import: {problem}\nmutations: {log}")
        outcome = "valid rewritten graph"
    TOTALS[(suite, outcome)] += 1
    return outcome


# ---------------------------------------------------------------------------
# The fuzz tests. Fast (-m "not slow"): 1,000 + 350 + 500 graphs in process, 24 through the
# command line (4 in processes of their own). Slow: 60 + 100 + 80 + 80 in process, 1 through the command line with TensorFlow.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,examples", [
    ("small_nhwc", 600), ("small_nchw", 200), ("small_k3", 200),
    pytest.param("towers", 60, marks=pytest.mark.slow),
])
def test_api_mutated_graphs(bases, name, examples):
    @settings(FUZZ, max_examples=examples)
    @given(data=st.data())
    def run(data):
        graph_def, log = data.draw(mutated_graphs(bases[name]))
        _through_api(graph_def, log, "api")

    run()


def test_cli_path_without_verify_mutated_graphs(bases):
    """Graph-level mutations through the bytes -> io -> rewrite -> serialize path of `convert`
    without --verify: whatever it writes must import, whether or not the input does."""

    @settings(FUZZ, max_examples=350)
    @given(data=st.data())
    def run(data):
        base = data.draw(st.sampled_from(["small_nhwc", "small_nchw", "small_k3"]))
        graph_def, log = data.draw(mutated_graphs(bases[base]))
        # one in 16 as text (protobuf parses text in Python: slow), chosen by the bytes' checksum as
        # hypothesis draws 0 from integers(0, 15) about one time in four
        payload = graph_def.SerializeToString()
        if len(graph_def.node) < 500 and zlib.crc32(payload) % 16 == 0:
            payload = str(graph_def).encode()
        _through_cli_path(payload, log, "cli-noverify", verify=False)

    run()


@pytest.mark.slow
def test_cli_path_mutated_graphs(bases):
    """Graph-level mutations through the bytes -> io -> rewrite -> --verify path."""

    @settings(FUZZ, max_examples=100)
    @given(data=st.data())
    def run(data):
        base = data.draw(st.sampled_from(["small_nhwc", "small_nhwc", "small_nchw", "towers"]))
        graph_def, log = data.draw(mutated_graphs(bases[base]))
        # text of the small graphs only: protobuf parses text in Python, the larger model's in seconds
        text = base != "towers" and len(graph_def.node) < 500 and data.draw(st.booleans())
        payload = str(graph_def).encode() if text else graph_def.SerializeToString()
        _through_cli_path(payload, log, "cli-path")

    run()


def _corrupted(data, serialized: dict[str, bytes]) -> tuple[bytes, list[str]]:
    """A serialized model truncated, with bytes flipped, or with a run of bytes zeroed."""
    names = sorted(serialized)
    name = data.draw(st.sampled_from([*[n for n in names if not n.endswith("txt")] * 3, *names]))  # text is slow to parse
    payload = bytearray(serialized[name])
    how = data.draw(st.sampled_from(["truncate", "flip", "zero"]))
    if how == "truncate":
        cut = data.draw(st.integers(0, len(payload) - 1))
        return bytes(payload[:cut]), [f"{name} truncated to {cut} bytes"]
    if how == "flip":
        flips = data.draw(st.lists(st.tuples(st.integers(0, len(payload) - 1), st.integers(1, 255)), min_size=1, max_size=8))
        for pos, xor in flips:
            payload[pos] ^= xor
        return bytes(payload), [f"{name} bytes flipped at {[p for p, _ in flips]}"]
    start = data.draw(st.integers(0, len(payload) - 1))
    length = data.draw(st.integers(1, 4096))
    payload[start:start + length] = bytes(len(payload[start:start + length]))
    return bytes(payload), [f"{name} {length} bytes zeroed from {start}"]


@pytest.fixture(scope="module")
def serialized(bases):
    return {
        "small.pb": bases["small_nhwc"].SerializeToString(),
        "towers.pb": bases["towers"].SerializeToString(),
        "small.pbtxt": str(bases["small_nhwc"]).encode(),
        "towers.meta": bases["meta"].SerializeToString(),
    }


def test_cli_path_corrupted_bytes(serialized):
    """Truncated, flipped and zeroed bytes of binary and text GraphDefs and MetaGraphDefs."""

    @settings(FUZZ, max_examples=500)
    @given(data=st.data())
    def run(data):
        payload, log = _corrupted(data, serialized)
        try:
            parsed = _parsed(payload)
        except BnRewriteError:
            parsed = None
        # --verify (slow) only where it matters: an input TensorFlow rejects gives an output it rejects
        _through_cli_path(payload, log, "cli-bytes", verify=parsed is None or _imports(parsed) is not None)

    run()


@pytest.mark.slow
def test_api_mutated_meta_graphs(bases):
    """MetaGraphDefs (collections pruned by the API) with a mutated graph_def."""

    @settings(FUZZ, max_examples=80)
    @given(data=st.data())
    def run(data):
        graph_def, log = data.draw(mutated_graphs(bases["meta"].graph_def))
        meta = tf.compat.v1.MetaGraphDef()
        meta.CopyFrom(bases["meta"])
        meta.graph_def.CopyFrom(graph_def)
        _through_api(meta, log, "api-meta")

    run()


@pytest.mark.slow
def test_cli_path_without_verify(bases):
    """Without --verify on the larger model: whatever convert writes must still import."""

    @settings(FUZZ, max_examples=80)
    @given(data=st.data())
    def run(data):
        graph_def, log = data.draw(mutated_graphs(bases["towers"]))
        _through_cli_path(graph_def.SerializeToString(), log, "cli-noverify-towers", verify=False)

    run()


SUBPROCESS_CASES = [
    ("bn_T_int32", lambda gd: setattr(_bn_nodes(gd)[0].attr["T"], "type", types_pb2.DT_INT32)),
]


def _run_cli(jobs) -> list:
    """`bnrewrite convert IN OUT --verify -q` for every (case, IN, OUT), two at a time."""
    from concurrent.futures import ThreadPoolExecutor

    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def run(job):
        case, path, out = job
        return subprocess.run([sys.executable, "-m", "bnrewrite", "convert", str(path), str(out), "--verify", "-q"],
                              capture_output=True, text=True, env=env, timeout=180)

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(run, jobs))


def _check_cli_results(jobs, results) -> None:
    for (case, path, out), proc in zip(jobs, results):
        assert "Traceback" not in proc.stderr, (case, proc.stderr)
        if proc.returncode == 0:
            assert out.exists() and _imports_in_python(io.load(str(out)).entries[0].graph_def) is None, case
            TOTALS[("subprocess", "valid rewritten graph")] += 1
        else:
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("bnrewrite: error: "), (case, proc.stderr)
            assert proc.returncode not in (1, 70), (case, proc.stderr)
            assert not out.exists(), case
            TOTALS[("subprocess", f"exit {proc.returncode}")] += 1


def test_cli_subprocess_corrupted_files(serialized, tmp_path):
    """24 corrupted files through the command line (no TensorFlow needed to reject them): one
    error line each, the right exit code, nothing written. The first 4 in real processes, the
    others through its main() in this process (the same code after the process starts)."""
    from test_cli import bnrewrite as in_process

    import random

    rng = random.Random(27)
    jobs = []
    while len(jobs) < 24:
        name = rng.choice(sorted(serialized))
        payload = bytearray(serialized[name])
        if rng.random() < 0.5:
            payload = payload[: rng.randrange(1, len(payload))]
        else:
            start = rng.randrange(len(payload))
            payload[start:start + rng.randrange(1, 64)] = bytes(rng.randrange(256) for _ in range(64))[: len(payload) - start]
        path = tmp_path / f"case{len(jobs)}_{name}"
        path.write_bytes(bytes(payload))
        try:
            io.check_input(str(path))
        except BnRewriteError:
            jobs.append((f"{name} #{len(jobs)}", path, tmp_path / f"out{len(jobs)}_{name}"))
    results = _run_cli(jobs[:4]) + [in_process("convert", str(path), str(out), "--verify", "-q")
                                    for _, path, out in jobs[4:]]
    _check_cli_results(jobs, results)


@pytest.mark.slow
def test_cli_subprocess_mutants(bases, tmp_path):
    """Mutants that need TensorFlow through the real command line: one error line or a valid output."""
    jobs = []
    for case, mutate in SUBPROCESS_CASES:
        gd = tf.compat.v1.GraphDef()
        gd.CopyFrom(bases["small_nhwc"])
        mutate(gd)
        path = tmp_path / f"{case}.pb"
        path.write_bytes(gd.SerializeToString())
        jobs.append((case, path, tmp_path / f"{case}.out.pb"))
    results = _run_cli(jobs)
    _check_cli_results(jobs, results)
    assert [p.returncode for p in results] == [11], [p.stderr for p in results]


def test_batch_norm_missing_an_input_is_a_clear_error(bases):
    """A training batch norm with 4 data inputs is skipped with its reason, never a crash."""
    gd = tf.compat.v1.GraphDef()
    gd.CopyFrom(bases["small_nhwc"])
    del _bn_nodes(gd)[0].input[4]
    with pytest.raises(BnRewriteError, match="has 4 data inputs; FusedBatchNormV3 takes 5"):
        rewrite_graph(gd)


def test_gradient_fed_the_wrong_tensors_is_skipped(bases):
    """A gradient op whose dy reads the forward op's reserve space (TensorFlow imports and runs
    that) is not the gradient tf.gradients builds: its layer is left alone, with the reason."""
    gd = tf.compat.v1.GraphDef()
    gd.CopyFrom(bases["small_nhwc"])
    grad = next(n for n in gd.node if n.op.startswith("FusedBatchNormGrad"))
    grad.input[0], grad.input[5] = grad.input[5], grad.input[0]
    with pytest.raises(BnRewriteError, match="does not read the op's input x"):
        rewrite_graph(gd)


def test_fuzz_totals():
    """At least 2,000 mutated graphs went through in a whole run, and none ended in an invalid
    output."""
    total = sum(c for (_, o), c in TOTALS.items() if "skipped" not in o)
    suites = {"api", "cli-bytes", "cli-noverify", "subprocess", "api-meta", "cli-path"}
    if not suites <= {s for s, _ in TOTALS}:
        pytest.skip("only meaningful after every fuzz test of this module ran")
    lines = [f"fuzz totals: {total} graphs rewritten or rejected ({sum(TOTALS.values()) - total} skipped)"]
    for suite in sorted({s for s, _ in TOTALS}):
        row = {o: c for (s, o), c in TOTALS.items() if s == suite}
        lines.append(f"  {suite}: " + ", ".join(f"{o} {c}" for o, c in sorted(row.items(), key=lambda kv: -kv[1])))
    print("\n".join(lines))
    assert not any(o == "INVALID OUTPUT" for _, o in TOTALS)
    assert total >= 2000
