"""Collectives per training step and bytes each tower puts into them, for ONE batch-norm layer.

    python tools/bench_collectives.py [--channels 64,256,1024] [--activation 32x14x14]

Rows, per channel count C (K = 2 towers; figures are per tower and per step):

  bnrewrite (collective)   counted from a real rewritten graph (CollectiveReduceV2 nodes)
  bnrewrite (nccl)         counted from a real rewritten graph (NcclAllReduce nodes, GPU towers)
  keras3 synchronized      counted from the concrete functions of a Keras 3
                           BatchNormalization(synchronized=True) step under MirroredStrategy over
                           2 virtual CPUs (collective all-reduce): forward = a step without
                           gradients, backward = what the GradientTape step adds
  tf_keras synchronized    the same with tf_keras's BatchNormalization(synchronized=True)
  tensorpack nccl          counted from a graph built with tensorpack 0.11's own
                           get_sync_bn_mean_var (sync_statistics='nccl') and tf.gradients,
                           when tensorpack imports; else computed from its definition
  gather to one device     computed from the definition: each tower ships its activations to
                           one device and gets back the statistics; backward the reverse

"elements" is the payload of one tower's all-reduces (or transfers) and "bytes" that times
the dtype size. An all-reduce over K towers moves about 2(K-1)/K times its payload per tower
on a ring; the gather rows move the payload itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from tensorflow.core.framework import types_pb2  # noqa: E402

ALL_REDUCE_OPS = ("CollectiveReduceV2", "CollectiveReduce", "NcclAllReduce", "CollectiveAllReduceV2")
TOWERS = 2


class Row:
    def __init__(self, method: str, source: str) -> None:
        self.method, self.source = method, source
        self.fwd: list[tuple[int, int]] = []  # (elements, bytes per element) per all-reduce
        self.bwd: list[tuple[int, int]] = []

    def cells(self, channels: int) -> tuple:
        def size(items):
            return sum(n for n, _ in items), sum(n * b for n, b in items)

        (fe, fb), (be, bb) = size(self.fwd), size(self.bwd)
        return (self.method, channels, len(self.fwd), len(self.bwd), fe, fb, be, bb, fb + bb, self.source)


def _dtype_size(dtype: int) -> int:
    return tf.dtypes.as_dtype(dtype).size


def _static_elements(op: tf.Operation) -> int:
    shape = op.inputs[0].shape
    if not shape.is_fully_defined():
        raise RuntimeError(f"{op.name}: input shape {shape} is not static")
    return int(shape.num_elements())


# -- bnrewrite ---------------------------------------------------------------------------

def bnrewrite_row(channels: int, backend: str) -> Row:
    import deep_net

    from bnrewrite import rewrite_graph
    from bnrewrite.rewrite.collectives import INSTANCE_ATTR
    from bnrewrite.rewrite.plan import KEYS_PER_LAYER

    device = "gpu" if backend == "nccl" else "cpu"
    graph_def = deep_net.build_graph_def(TOWERS, 1, channels=channels, image=4, batch=2, device=device)
    out = rewrite_graph(graph_def, backend=backend).graph_def
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(out, name="")
    row = Row(f"bnrewrite ({backend})", "real graph")
    tower0 = [op for op in graph.get_operations()
              if op.type in ALL_REDUCE_OPS and op.name.startswith("tower_0/")]
    for op in tower0:
        phase = op.node_def.attr[INSTANCE_ATTR].i % KEYS_PER_LAYER
        item = (_static_elements(op), _dtype_size(op.get_attr("T")))
        (row.fwd if phase == 0 else row.bwd).append(item)
    return row


# -- Keras synchronized batch norm under MirroredStrategy ----------------------------------

def _mirrored_on_cpus():
    from tensorflow.python.distribute import cross_device_ops as cdo

    devices = [f"/cpu:{k}" for k in range(TOWERS)]
    all_reduce = cdo.CollectiveAllReduce(devices=devices, group_size=TOWERS, options=tf.distribute.experimental.CommunicationOptions())
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=all_reduce)


def keras_row(channels: int, flavour: str, activation: tuple[int, int, int]) -> Row:
    """Forward: the all-reduces of a step without gradients; backward: what autodiff adds."""
    if flavour == "keras3":
        import keras

        layer_cls = keras.layers.BatchNormalization
    else:
        import tf_keras

        layer_cls = tf_keras.layers.BatchNormalization
    batch, h, w = activation
    strategy = _mirrored_on_cpus()
    with strategy.scope():
        layer = layer_cls(synchronized=True)
        layer.build((batch, h, w, channels))

    def replica_forward(x):
        return tf.reduce_sum(layer(x, training=True))

    def replica_train(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, *layer.trainable_variables])

    spec = tf.TensorSpec((batch, h, w, channels), tf.float32)
    forward = _replica_all_reduces(strategy, replica_forward, spec)
    train = _replica_all_reduces(strategy, replica_train, spec)
    row = Row(f"{flavour} synchronized", "real graph (MirroredStrategy, 2 CPUs)")
    row.fwd = forward
    row.bwd = list(train)
    for item in forward:
        row.bwd.remove(item)
    return row


def _replica_all_reduces(strategy, replica_fn, spec) -> list[tuple[int, int]]:
    """(elements, bytes per element) of each all-reduce replica 0 runs in one step."""
    step = tf.function(tf.autograph.experimental.do_not_convert(lambda x: strategy.run(replica_fn, args=(x,))))
    graph = step.get_concrete_function(spec).graph
    found = [op for op in _all_ops(graph) if op.type in ALL_REDUCE_OPS]
    first = min(op.device for op in found)  # MirroredStrategy puts replica k's ops on device k
    return sorted((_static_elements(op), _dtype_size(op.get_attr("T"))) for op in found if op.device == first)


def _all_ops(graph):
    """Ops of a FuncGraph and of the functions it calls."""
    yield from graph.get_operations()
    for func in getattr(graph, "_functions", {}).values():
        inner = getattr(func, "graph", None)
        if inner is not None:
            yield from _all_ops(inner)


# -- tensorpack --------------------------------------------------------------------------

def tensorpack_row(channels: int, activation: tuple[int, int, int]) -> Row:
    """tensorpack's BatchNorm(sync_statistics='nccl') in 2 GPU towers (building needs no GPU),
    gradients as its trainers take them (colocated with the ops)."""
    batch, h, w = activation
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from tensorpack.models import BatchNorm
            from tensorpack.tfutils.tower import TrainTowerContext
    except Exception as exc:  # noqa: BLE001 - any import failure means: describe it instead
        row = Row("tensorpack nccl", f"definition (tensorpack not importable: {type(exc).__name__})")
        row.fwd = [(channels, 4), (channels, 4)]  # nccl_all_reduce of the mean and of the mean of squares
        row.bwd = [(channels, 4), (channels, 4)]  # NcclAllReduce's gradient is an NcclAllReduce
        return row
    graph = tf.Graph()
    with graph.as_default():
        xs, losses = [], []
        for k in range(TOWERS):
            with tf.device(f"/gpu:{k}"), TrainTowerContext(f"tower{k}", index=k, total=TOWERS), \
                    tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), reuse=k > 0):
                x = tf.compat.v1.placeholder(tf.float32, (batch, h, w, channels))
                y = BatchNorm("bn", x, sync_statistics="nccl")
                xs.append(x)
                losses.append(tf.reduce_sum(y * y))
        forward = {op.name for op in graph.get_operations() if op.type in ALL_REDUCE_OPS}
        tf.compat.v1.gradients(tf.add_n(losses), xs, colocate_gradients_with_ops=True)
    row = Row("tensorpack nccl", "real graph (tensorpack 0.11 BatchNorm, 2 GPU towers)")
    for op in graph.get_operations():
        if op.type in ALL_REDUCE_OPS and op.device.endswith("GPU:0"):
            item = (_static_elements(op), _dtype_size(op.get_attr("T")))
            (row.fwd if op.name in forward else row.bwd).append(item)
    return row


# -- gathering activations -----------------------------------------------------------------

def gather_row(channels: int, activation: tuple[int, int, int]) -> Row:
    batch, h, w = activation
    act = batch * h * w * channels
    row = Row("gather to one device", f"definition (activation {batch}x{h}x{w}xC float32)")
    row.fwd = [(act, 4), (2 * channels, 4)]  # activations out, mean and variance back
    row.bwd = [(2 * channels, 4), (act, 4)]  # d(mean), d(variance) out, d(activations) back
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--channels", type=lambda s: [int(v) for v in s.split(",")], default=[64, 256, 1024])
    parser.add_argument("--activation", default="32x14x14", help="per-tower batch x H x W for the rows that need it")
    parser.add_argument("--tensorpack-path", help="a directory holding tensorpack (pip install --target DIR tensorpack)")
    args = parser.parse_args(argv)
    if args.tensorpack_path:
        sys.path.append(args.tensorpack_path)
    activation = tuple(int(v) for v in args.activation.split("x"))
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * TOWERS)

    header = ("method", "C", "fwd ops", "bwd ops", "fwd elems", "fwd bytes", "bwd elems", "bwd bytes",
              "total bytes", "counted from")
    rows = []
    for c in args.channels:
        makers = [
            lambda: bnrewrite_row(c, "collective"),
            lambda: bnrewrite_row(c, "nccl"),
            lambda: keras_row(c, "keras3", activation),
            lambda: keras_row(c, "tf_keras", activation),
            lambda: tensorpack_row(c, activation),
            lambda: gather_row(c, activation),
        ]
        for make in makers:
            rows.append(make().cells(c))
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    print(f"\n== collectives per step for one batch-norm layer, per tower ({TOWERS} towers) ==")
    for row in (header, *rows):
        print("  ".join(str(cell).ljust(w) if i in (0, 9) else str(cell).rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))).rstrip())
    print("fwd/bwd ops: all-reduces (or transfers) per tower per step; elems: their payload; "
          "bytes = elems x dtype size.")
    print("bnrewrite forward is 2C+1 float64 (count, sum, sum of squares about local means), "
          "backward 2C float32 (sum dy, sum dy*(x-mean); N comes from the forward pass; "
          "2C+1 with the counts for FusedBatchNorm/V2, whose gradients have no reserve_space_3).")


if __name__ == "__main__":
    main()
