"""Static shapes of bare GraphDefs and MetaGraphDefs (bnrewrite.graph.shapes): inferred from the graph
itself, they give `convert x.pb`, `convert x.meta` and `rewrite_graph(tf.Graph)` the same
rewritten graph. Each rule is checked against TensorFlow's own shape inference, which a
tf.Graph records on every tensor it builds."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework.node_def_pb2 import NodeDef

from bnrewrite import rewrite_graph
from bnrewrite.graph.edit import Editor
from bnrewrite.graph.index import Graph
from bnrewrite.graph.shapes import ShapeInference
from models import (Spec, assert_synced, build_reference, build_towers, kernel_gradients, kernel_moments, make_batches,
                    train, use_passes)

tf1 = tf.compat.v1


def _ph(shape, dtype=tf.float32, name="x"):
    return tf1.placeholder(dtype, shape, name=name)


def _image(fmt: str, batch=2, h=9, w=7, c=6):
    return _ph((batch, c, h, w) if fmt == "NCHW" else (batch, h, w, c))


def _conv(fmt: str, padding="SAME", strides=1, dilations=1, batch=2):
    x = _image(fmt, batch)
    f = tf.constant(np.zeros((3, 2, 6, 5), np.float32))
    stride = [1, 1, strides, strides] if fmt == "NCHW" else [1, strides, strides, 1]
    dilation = [1, 1, dilations, dilations] if fmt == "NCHW" else [1, dilations, dilations, 1]
    if padding == "EXPLICIT":
        padding = [[0, 0], [0, 0], [1, 2], [0, 3]] if fmt == "NCHW" else [[0, 0], [1, 2], [0, 3], [0, 0]]
    return tf1.nn.conv2d(x, f, stride, padding, data_format=fmt, dilations=dilation)


def _depthwise(fmt: str, padding="VALID", strides=2):
    x = _image(fmt)
    stride = [1, 1, strides, strides] if fmt == "NCHW" else [1, strides, strides, 1]
    return tf.raw_ops.DepthwiseConv2dNative(input=x, filter=tf.zeros((3, 3, 6, 2)), strides=stride, padding=padding,
                                            data_format=fmt)


def _pool(op, fmt: str, padding: str, batch=2):
    x = _image(fmt, batch)
    window = [1, 1, 3, 2] if fmt == "NCHW" else [1, 3, 2, 1]
    stride = [1, 1, 2, 2] if fmt == "NCHW" else [1, 2, 2, 1]
    return op(x, window, stride, padding, data_format=fmt)


def _bias_add(fmt: str, batch=2):
    return tf.nn.bias_add(_image(fmt, batch), tf.zeros((6,)), data_format=fmt)


def _fused_batch_norm(fmt: str, batch=2):
    x = _image(fmt, batch)
    return tf1.nn.fused_batch_norm(x, tf.ones((6,)), tf.zeros((6,)), is_training=True, data_format=fmt)[0]


def _resource_read():
    with tf1.variable_scope("v", use_resource=True):
        return tf1.get_variable("w", (3, 4, 5)).read_value()


def _ref_variable():
    return tf1.Variable(tf.zeros((3, 4)), use_resource=False) + 1.0


def _switch_merge():
    x = _ph((2, 3, 4))
    low, high = tf.raw_ops.Switch(data=x, pred=tf.constant(True))
    return tf.raw_ops.Merge(inputs=[tf.nn.relu(low), high]).output


def _non_constant_axes(keep: bool):
    return tf.reduce_mean(_ph((2, 3, 4)), axis=_ph((1,), tf.int32, "axes"), keepdims=keep)


#: (id, builder of one tensor): every rule of bnrewrite.graph.shapes, NHWC and NCHW where they differ,
#: unknown batch sizes where they propagate.
CASES = [
    ("placeholder", lambda: _ph((2, 3))),
    ("placeholder unknown batch", lambda: _ph((None, 3))),
    ("placeholder unknown rank", lambda: _ph(None)),
    ("placeholder_with_default", lambda: tf1.placeholder_with_default(tf.zeros((4, 2)), (None, 2))),
    ("const", lambda: tf.constant(np.zeros((2, 5), np.float32))),
    ("read resource variable", _resource_read),
    ("ref variable", _ref_variable),
    *[(f"conv2d {fmt} {pad} stride {s} dilation {d}", lambda fmt=fmt, pad=pad, s=s, d=d: _conv(fmt, pad, s, d))
      for fmt in ("NHWC", "NCHW") for pad in ("SAME", "VALID", "EXPLICIT") for s, d in ((1, 1), (2, 1), (1, 2))],
    ("conv2d unknown batch", lambda: _conv("NHWC", batch=None)),
    ("conv2d unknown spatial", lambda: tf1.nn.conv2d(_ph((2, None, 5, 6)), tf.zeros((3, 3, 6, 4)), 1, "SAME")),
    *[(f"depthwise {fmt} {pad}", lambda fmt=fmt, pad=pad: _depthwise(fmt, pad))
      for fmt in ("NHWC", "NCHW") for pad in ("SAME", "VALID")],
    *[(f"{op.__name__} {fmt} {pad}", lambda op=op, fmt=fmt, pad=pad: _pool(op, fmt, pad))
      for op in (tf1.nn.max_pool, tf1.nn.avg_pool) for fmt in ("NHWC", "NCHW") for pad in ("SAME", "VALID")],
    ("max_pool unknown batch", lambda: _pool(tf1.nn.max_pool, "NHWC", "SAME", batch=None)),
    *[(f"bias_add {fmt}", lambda fmt=fmt: _bias_add(fmt)) for fmt in ("NHWC", "NCHW")],
    ("bias_add unknown batch", lambda: _bias_add("NCHW", batch=None)),
    *[(f"fused_batch_norm {fmt}", lambda fmt=fmt: _fused_batch_norm(fmt)) for fmt in ("NHWC", "NCHW")],
    ("fused_batch_norm unknown batch", lambda: _fused_batch_norm("NHWC", batch=None)),
    *[(op.__name__, lambda op=op: op(_ph((2, 3, 4)))) for op in (
        tf.identity, tf.stop_gradient, tf.nn.relu, tf.nn.relu6, tf.nn.elu, tf.nn.selu, tf.nn.leaky_relu, tf.nn.softplus,
        tf.sigmoid, tf.tanh, tf.negative, tf.abs, tf.square, tf.sqrt, tf.math.rsqrt, tf.math.reciprocal, tf.exp,
        tf.math.log, tf.math.log1p, tf.floor, tf.math.ceil, tf.round, tf.sign, tf.math.erf, tf.nn.softmax,
        tf.nn.log_softmax, tf.zeros_like, tf.ones_like)],
    ("cast", lambda: tf.cast(_ph((None, 3)), tf.float16)),
    ("l2_loss", lambda: tf.nn.l2_loss(_ph((None, 3)))),
    ("lrn", lambda: tf.nn.local_response_normalization(_ph((2, 3, 4, 5)))),
    *[(f"{op.__name__} broadcast", lambda op=op: op(_ph((2, 1, 4, 8)), _ph((3, 1, 8), name="y"))) for op in (
        tf.add, tf.subtract, tf.multiply, tf.math.truediv, tf.math.divide_no_nan, tf.maximum, tf.minimum, tf.pow,
        tf.math.squared_difference, tf.math.floordiv, tf.math.floormod)],
    ("add_v2 same shapes", lambda: tf.raw_ops.AddV2(x=_ph((2, 3)), y=_ph((2, 3), name="y"))),
    ("add unknown against 1", lambda: tf.add(_ph((None, 4)), _ph((1, 4), name="y"))),
    ("add unknown against known", lambda: tf.add(_ph((None, 4)), _ph((5, 1), name="y"))),
    ("add unknown against unknown", lambda: tf.add(_ph((None, 4)), _ph((None, 4), name="y"))),
    ("add unknown rank", lambda: tf.add(_ph(None), _ph((3,), name="y"))),
    ("add_n", lambda: tf.add_n([_ph((None, 4)), _ph((3, None), name="y")])),
    ("pad", lambda: tf.pad(_ph((2, 3, 4)), [[0, 0], [1, 2], [3, 0]])),
    ("pad unknown batch", lambda: tf.pad(_ph((None, 3)), [[1, 1], [2, 2]])),
    ("pad_v2", lambda: tf.pad(_ph((2, 3)), [[1, 0], [0, 1]], constant_values=1.0)),
    ("mirror_pad", lambda: tf.pad(_ph((4, 5)), [[1, 2], [2, 1]], mode="REFLECT")),
    ("concat last axis", lambda: tf.concat([_ph((2, 3, 4)), _ph((2, 3, 5), name="y")], -1)),
    ("concat unknown", lambda: tf.concat([_ph((None, 3)), _ph((2, None), name="y")], 0)),
    ("transpose", lambda: tf.transpose(_ph((2, 3, 4, 5)), [0, 3, 1, 2])),
    ("transpose unknown batch", lambda: tf.transpose(_ph((None, 3, 4)), [2, 0, 1])),
    ("reshape", lambda: tf.reshape(_ph((2, 3, 4)), [6, 4])),
    ("reshape -1", lambda: tf.reshape(_ph((2, 3, 4)), [-1, 2])),
    ("reshape -1 unknown batch", lambda: tf.reshape(_ph((None, 3, 4)), [-1, 12])),
    ("reshape non-constant shape", lambda: tf.reshape(_ph((2, 3)), _ph((2,), tf.int32, "shape"))),
    *[(f"{op.__name__} keepdims {keep}", lambda op=op, keep=keep: op(_ph((2, 3, 4, 5)), axis=[1, -2], keepdims=keep))
      for op in (tf.reduce_mean, tf.reduce_sum, tf.reduce_max, tf.reduce_min, tf.reduce_prod, tf.math.reduce_euclidean_norm)
      for keep in (False, True)],
    ("reduce_mean unknown batch", lambda: tf.reduce_mean(_ph((None, 4, 4, 3)), axis=[1, 2])),
    ("reduce_mean scalar axis", lambda: tf.reduce_mean(_ph((2, 3)), axis=0)),
    ("reduce_mean non-constant axes", lambda: _non_constant_axes(False)),
    ("reduce_mean non-constant axes keepdims", lambda: _non_constant_axes(True)),
    *[(f"matmul {ta} {tb}", lambda ta=ta, tb=tb: tf.matmul(_ph((3, 4) if ta else (4, 3)), _ph((5, 3) if tb else (3, 5), name="y"),
                                                         transpose_a=ta, transpose_b=tb))
      for ta in (False, True) for tb in (False, True)],
    ("matmul unknown batch", lambda: tf.matmul(_ph((None, 3)), _ph((3, 5), name="y"))),
    ("expand_dims", lambda: tf.expand_dims(_ph((2, 3)), -1)),
    ("expand_dims front", lambda: tf.expand_dims(_ph((2, 3)), 0)),
    ("squeeze", lambda: tf.squeeze(_ph((2, 1, 3, 1)))),
    ("squeeze axis", lambda: tf.squeeze(_ph((None, 1, 3, 1)), [1])),
    ("squeeze unknown", lambda: tf.squeeze(_ph((None, 1, 3)))),
    ("switch and merge", _switch_merge),
    *[(f"split axis {a} part {i}", lambda a=a, i=i: tf.split(_ph((4, 6, 3)), 2, axis=a)[i]) for a in (0, -2) for i in (0, 1)],
    ("split unknown batch", lambda: tf.split(_ph((None, 6)), 3, axis=0)[2]),
    ("split non-constant axis", lambda: tf.split(_ph((4, 6)), 2, axis=_ph((), tf.int32, "axis"))[0]),
    ("split unknown rank", lambda: tf.split(_ph(None), 2)[1]),
    *[(f"split_v part {i}", lambda i=i: tf.split(_ph((7, 3)), [2, -1, 4], axis=0)[i]) for i in range(3)],
    ("split_v unknown batch", lambda: tf.split(_ph((None, 3)), [2, -1], axis=0)[1]),
    ("split_v non-constant sizes", lambda: tf.split(_ph((5, 3)), _ph((2,), tf.int32, "sizes"), num=2, axis=1)[0]),
    *[(f"unstack axis {a}", lambda a=a: tf.unstack(_ph((2, 3, 4)), axis=a)[1]) for a in (0, 1, -1)],
    ("unstack unknown dimension", lambda: tf.unstack(_ph((2, None, 4)), num=3, axis=1)[0]),
    ("slice", lambda: tf.slice(_ph((4, 5, 6)), [1, 0, 2], [2, -1, 3])),
    ("slice unknown batch", lambda: tf.slice(_ph((None, 5)), [1, 1], [-1, -1])),
    ("slice non-constant begin", lambda: tf.slice(_ph((4, 5)), _ph((2,), tf.int32, "begin"), [2, -1])),
    ("slice non-constant size", lambda: tf.slice(_ph((4, 5)), [0, 0], _ph((2,), tf.int32, "size"))),
    *[(f"strided_slice {label}", lambda index=index: _ph((8, 5, 6, 3)).__getitem__(index())) for label, index in (
        ("half", lambda: slice(0, 4)), ("second half", lambda: slice(4, 8)), ("negative", lambda: slice(-3, None)),
        ("step", lambda: (slice(None), slice(None, None, 2))), ("reverse", lambda: slice(None, None, -3)),
        ("reverse range", lambda: (slice(None), slice(4, 0, -2))), ("clamped", lambda: slice(2, 100)),
        ("empty", lambda: slice(5, 2)), ("index", lambda: 3), ("negative index", lambda: (slice(None), -1)),
        ("ellipsis", lambda: (Ellipsis, 1)), ("new axis", lambda: (slice(1, 3), None, Ellipsis, tf1.newaxis)),
        ("new axis after ellipsis", lambda: (0, Ellipsis, None, slice(1, 2))))],
    ("strided_slice unknown batch", lambda: _ph((None, 5))[1:3, 2:]),
    ("strided_slice unknown batch index", lambda: _ph((None, 5))[0]),
    ("strided_slice non-constant begin", lambda: tf.strided_slice(_ph((6, 5)), _ph((2,), tf.int32, "b"), [4, 3], [1, 1])),
    ("strided_slice non-constant begin masked", lambda: tf.strided_slice(_ph((6, 5)), _ph((2,), tf.int32, "b"), [4, 3],
                                                                         [1, -1], begin_mask=2, end_mask=2)),
    ("strided_slice unknown rank", lambda: _ph(None)[1:3]),
]


@pytest.mark.parametrize("build", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_inferred_shape_is_tensorflows(build):
    graph = tf.Graph()
    with graph.as_default():
        tensor = build()
    graph_def = graph.as_graph_def()
    assert not any("_output_shapes" in n.attr for n in graph_def.node)
    nodes = {n.name: n for n in graph_def.node}
    got = ShapeInference(nodes.get).shape(tensor.op.name, tensor.value_index)
    dims = tensor.shape.as_list() if tensor.shape.rank is not None else None
    assert got == (None if dims is None else tuple(-1 if d is None else d for d in dims))


def test_ops_not_followed_leave_the_shape_unknown():
    """Unique's shape TensorFlow knows to be (-1,); it is not needed for batch norms, so the
    inference stops there, unknown, and so does everything after it."""
    graph = tf.Graph()
    with graph.as_default():
        y = tf.nn.relu(tf.raw_ops.Unique(x=_ph((4,))).y)
    nodes = {n.name: n for n in graph.as_graph_def().node}
    assert y.shape.as_list() == [None] and ShapeInference(nodes.get).shape(y.op.name) is None


def _node(name: str, op: str, *inputs: str) -> NodeDef:
    return NodeDef(name=name, op=op, input=list(inputs))


def test_a_deep_chain_and_a_cycle():
    """Iterative: a chain far deeper than Python's recursion limit; a cycle (which a valid
    graph has only through NextIteration, an op not followed) ends unknown instead of looping."""
    x = _node("x", "Placeholder")
    x.attr["shape"].shape.CopyFrom(tf.TensorShape([2, 3]).as_proto())
    chain = [x] + [_node(f"r{i}", "Relu", "r{}".format(i - 1) if i else "x") for i in range(20000)]
    nodes = {n.name: n for n in chain}
    assert ShapeInference(nodes.get).shape("r19999") == (2, 3)
    loop = {n.name: n for n in (x, _node("merge", "Merge", "x", "relu"), _node("relu", "Relu", "merge"))}
    inference = ShapeInference(loop.get)
    assert inference.shape("relu") is None and inference.shape("merge") is None and inference.shape("x") == (2, 3)


def test_elements_known_only_when_every_dimension_is():
    graph = tf.Graph()
    with graph.as_default():
        known = tf.nn.relu(_ph((2, 3)), name="known")
        unknown = tf.nn.relu(_ph((None, 3), name="y"), name="unknown")
    model = Graph.from_graph_def(graph.as_graph_def())
    assert model.static_elements(known.op.name) == 6
    assert model.static_elements(unknown.op.name) is None
    assert model.static_elements("missing") is None


def test_edited_node_is_not_inferred_from_the_graph_as_read():
    """A node an edit changed may not have the shape it had: no inferred shape for it."""
    graph = tf.Graph()
    with graph.as_default():
        y = tf.nn.relu(_ph((2, 3)), name="y")
    model = Graph.from_graph_def(graph.as_graph_def())
    editor = Editor(model)
    editor.mutable(y.op.name).op = "Relu6"
    edited = editor.finish()
    assert model.static_elements("y") == 6 and edited.static_elements("y") is None and edited.static_elements("x") == 6


def _forms(built) -> dict:
    """The model as a tf.Graph, a bare GraphDef and a MetaGraphDef without `_output_shapes`."""
    graph_def = built.graph.as_graph_def()
    with built.graph.as_default():
        meta = tf1.train.export_meta_graph(graph_def=graph_def, clear_devices=False)
    assert not any("_output_shapes" in n.attr for n in (*graph_def.node, *meta.graph_def.node))
    return {"tf.Graph": built.graph, "GraphDef": graph_def, "MetaGraphDef": meta}


def _nodes(graph_def) -> list:
    return [(n.name, n.op, list(n.input), n.device) for n in graph_def.node]


@pytest.mark.parametrize("spec", [Spec(towers=2), Spec(towers=2, image=64), Spec(towers=2, image=64, layer="fused_op"),
                                  Spec(towers=2, image=64, data_format="NCHW")],
                         ids=["small", "kernel-size legacy", "kernel-size fused_op", "kernel-size NCHW"])
def test_graph_graph_def_and_meta_graph_def_give_the_same_graph(spec):
    """Channels-last activations, small or large (4 x 64 x 64 x 8), take the fused kernels,
    channels-first ones the passes, whichever form the model comes in."""
    forms = _forms(build_towers(spec))
    before = forms["GraphDef"].SerializeToString(deterministic=True)
    results = {form: rewrite_graph(graph) for form, graph in forms.items()}
    assert forms["GraphDef"].SerializeToString(deterministic=True) == before
    expected = _nodes(results["tf.Graph"].graph_def)
    kernels = len(kernel_moments(results["tf.Graph"].graph_def))
    assert kernels == (2 * spec.towers if spec.data_format == "NHWC" else 0)
    for form, result in results.items():
        assert _nodes(result.graph_def) == expected, form
        assert not [note for note in result.report.notes if "static shapes" in note], form


@pytest.mark.parametrize("kernels", [False, True], ids=["passes", "kernels"])
def test_bare_graph_def_trains_like_one_device(kernels, monkeypatch):
    """Rewritten from a bare GraphDef (shapes inferred): by the fused kernels, or, sent down
    them, by the elementwise passes; either way like one device fed K*B."""
    if not kernels:
        use_passes(monkeypatch)
    spec = Spec(towers=2)
    built = build_towers(spec)
    result = rewrite_graph(built.graph.as_graph_def())
    assert len(kernel_moments(result.graph_def)) == len(kernel_gradients(result.graph_def)) == (4 if kernels else 0)
    data, ref = make_batches(spec, 3), build_reference(spec)
    assert_synced(f"bare GraphDef, {'kernels' if kernels else 'passes'}",
                  train(result.graph_def, built, data, num_devices=spec.towers),
                  train(built.graph, built, data, num_devices=spec.towers),
                  train(ref.graph, ref, data, num_devices=1), 2e-4)


@pytest.mark.parametrize("split", ["split", "split_v", "slice", "strided_slice"])
def test_towers_cut_from_one_placeholder_take_the_kernels(split):
    """One fully defined placeholder of K*B examples cut per tower (tf.split, by sizes,
    tf.slice, x[k*B:(k+1)*B]): the cut's shape is inferred, so the bare GraphDef `run` sees
    and a GraphDef with TensorFlow's own shapes recorded give the same graph, fused kernels
    at kernel size (4 x 64 x 64 x 8 a tower) and no "static shapes are unknown" note."""
    built = build_towers(Spec(towers=2, image=64, split_input=split))
    bare, recorded = built.graph.as_graph_def(), built.graph.as_graph_def(add_shapes=True)
    results = [rewrite_graph(graph_def) for graph_def in (bare, recorded)]
    assert _nodes(results[0].graph_def) == _nodes(results[1].graph_def)
    assert len(kernel_moments(results[0].graph_def)) == 4
    assert not [note for result in results for note in result.report.notes if "static shapes" in note]


@pytest.mark.parametrize("split", ["split", "strided_slice"])
def test_towers_cut_from_one_placeholder_train_like_one_device(split):
    """The same towers, small, on the kernels: one device fed K*B."""
    spec = Spec(towers=2, split_input=split)
    built = build_towers(spec)
    result = rewrite_graph(built.graph.as_graph_def())
    assert len(kernel_moments(result.graph_def)) == 4
    data, ref = make_batches(spec, 3), build_reference(spec)
    assert_synced(f"towers cut by {split}", train(result.graph_def, built, data, num_devices=spec.towers),
                  train(built.graph, built, data, num_devices=spec.towers), train(ref.graph, ref, data, num_devices=1),
                  2e-4)
