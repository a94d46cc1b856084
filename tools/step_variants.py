"""The training graphs tools/bench_step.py and tools/gpu_step.py time side by side.

Every variant is the tools/deep_net.py model (conv 3x3 → batch norm → relu, L times, global
pool, dense, softmax cross entropy; one tower per device; gradients averaged, Momentum), fed
the same batches:

- `unsynced`: the graph as built (each tower normalizes with its own batch's statistics);
- `bnrewrite`: that graph after `rewrite_graph` with the backend it picks (NCCL on GPUs, the
  local AddN on virtual CPUs);
- `model_sync`: synchronized batch norm written in model code (tools/model_sync_bn.py), with
  NCCL on GPUs and CollectiveReduceV2 on CPUs: model code builds one tower after the other, so
  no op of its own can take every tower's input; it must meet the others by keys;
- `keras_sync`: tf_keras's `BatchNormalization(synchronized=True)` under MirroredStrategy;
- `floor`: the unsynced graph plus all-reduces of the sizes, dtypes, places and kind of
  bnrewrite's, whose results nothing uses: what the all-reduces themselves cost;
- `floor_gated`: the same, but each batch-norm op and gradient waits for its tower's result of
  its own all-reduce, as a synced layer must: the towers meet at every layer, forward and
  backward, with no arithmetic added: what synchronizing costs at the least;
- `bnrewrite_collective`, `floor_collective`, `floor_gated_collective`: the same with
  CollectiveReduceV2, the all-reduce model code uses on CPUs: the like-for-like comparison of
  the arithmetic;
- `bnrewrite_graphdef`, `bnrewrite_graphdef_collective`: bnrewrite given the graph as a bare
  GraphDef (no recorded shapes, as `bnrewrite convert x.pb` reads it) instead of a tf.Graph.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops

import deep_net
import model_sync_bn

tf1 = tf.compat.v1

VARIANTS = ("unsynced", "bnrewrite", "model_sync", "keras_sync", "floor", "floor_gated", "bnrewrite_collective",
            "floor_collective", "floor_gated_collective", "bnrewrite_graphdef", "bnrewrite_graphdef_collective",
            "bnrewrite_run")
#: Group key of the floor's all-reduces (bnrewrite uses 0x5B00, model code 0x7E00).
FLOOR_GROUP_KEY = 0x7F00


@dataclass(frozen=True)
class Size:
    """The deep_net model's sizes."""

    layers: int
    channels: int
    image: int
    batch: int  # examples per tower

    def __str__(self) -> str:
        return (f"{self.layers} conv+BN layers, {self.channels} channels, {self.image}x{self.image} images, "
                f"{self.batch} per tower")


@dataclass
class Variant:
    """One training graph: `train_op` runs a step; `inputs` are (images, labels) tensor names per
    tower. `error` says why the variant could not be built (then graph_def is None)."""

    name: str
    graph_def: tf1.GraphDef | None
    train_op: str = "train_op"
    inputs: list[tuple[str, str]] = field(default_factory=list)
    error: str = ""
    live: bool = False  # the session is made under bnrewrite.enable(), as `bnrewrite run` makes it


def tower_inputs(towers: int) -> list[tuple[str, str]]:
    """deep_net's placeholders."""
    return [(f"tower_{k}/images:0", f"tower_{k}/labels:0") for k in range(towers)]


def build_variants(names: list[str], towers: int, size: Size, dtype: str, device: str) -> list[Variant]:
    """The variants named, in that order."""
    from bnrewrite import rewrite_graph

    sizes = dict(channels=size.channels, image=size.image, batch=size.batch, device=device, dtype=dtype, shapes=True)
    plain = deep_net.build_graph_def(towers, size.layers, **sizes)
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(plain, name="")
    chosen = rewrite_graph(graph)
    builders = {
        "unsynced": lambda: plain,
        "bnrewrite": lambda: chosen.graph_def,
        "model_sync": lambda: deep_net.build_graph_def(towers, size.layers, bn="model_sync", **sizes),
        "floor": lambda: floor_graph_def(plain, chosen.report.backend),
        "floor_gated": lambda: floor_graph_def(plain, chosen.report.backend, gated=True),
        "bnrewrite_collective": lambda: rewrite_graph(graph, backend="collective").graph_def,
        "floor_collective": lambda: floor_graph_def(plain, "collective"),
        "floor_gated_collective": lambda: floor_graph_def(plain, "collective", gated=True),
        "bnrewrite_graphdef": lambda: rewrite_graph(bare_graph_def(plain)).graph_def,
        "bnrewrite_graphdef_collective": lambda: rewrite_graph(bare_graph_def(plain), backend="collective").graph_def,
    }
    variants = []
    for name in names:
        if name == "keras_sync":
            variants.append(keras_sync_variant(towers, size, dtype, device))
        elif name == "bnrewrite_run":  # the unsynced graph, its session synchronized by enable()
            variants.append(Variant(name, plain, inputs=tower_inputs(towers), live=True))
        else:
            variants.append(Variant(name, builders[name](), inputs=tower_inputs(towers)))
    return variants


def bare_graph_def(graph_def: tf1.GraphDef) -> tf1.GraphDef:
    """`graph_def` without its recorded shapes (`_output_shapes`), as a .pb written from
    `graph.as_graph_def()` holds it."""
    bare = tf1.GraphDef()
    bare.CopyFrom(graph_def)
    for node in bare.node:
        if "_output_shapes" in node.attr:
            del node.attr["_output_shapes"]
    return bare


def comparable(graph_def: tf1.GraphDef) -> bytes:
    """`graph_def` as bytes that are equal for two rewrites of one model whatever form it came
    in: without recorded shapes, and without the devices of colocated nodes (`_class`), which
    importing into a tf.Graph sets to their colocation target's."""
    bare = bare_graph_def(graph_def)
    for node in bare.node:
        if "_class" in node.attr:
            node.device = ""
    return bare.SerializeToString(deterministic=True)


def floor_graph_def(graph_def: tf1.GraphDef, backend: str, gated: bool = False) -> tf1.GraphDef:
    """`graph_def` (deep_net, FusedBatchNormV3) plus, per batch-norm layer and tower, the
    all-reduces bnrewrite adds — one float64 [2C+1] fed by a slice of the layer's input, one
    float32 [2C] fed by a slice of its incoming gradient — that `train_op` waits for, or,
    `gated`, the batch-norm op or gradient each belongs to (through an Identity on its scale
    input, which keeps the op fusable with its ReLU). Their results
    are unused: the step pays for the transfers and the waiting, not for any statistics. NCCL
    and collective all-reduces are chained per tower in one order (forward layers, then
    gradients as autodiff built them) as bnrewrite orders its own; local ones are an AddN on
    the first tower's device and an Identity on each tower's, read by an Assert (stateful, so
    that Grappler keeps them)."""
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
        members: dict[str, list[tuple[tf.Operation, int, tf.DType]]] = {}
        for op in graph.get_operations():
            if op.type in ("FusedBatchNormV3", "FusedBatchNormGradV3"):
                channels = op.inputs[0].shape[-1]
                forward = op.type == "FusedBatchNormV3"
                member = (op, 2 * channels + 1 if forward else 2 * channels, tf.float64 if forward else tf.float32)
                members.setdefault(op.device, []).append(member)
        pieces: dict[str, list[tf.Tensor]] = {}
        for device, tower_members in members.items():
            with tf.device(device), tf.name_scope("floor"):
                pieces[device] = [tf.cast(tf.slice(tf.reshape(op.inputs[0], [-1]), [0], [count]), dtype)
                                  for op, count, dtype in tower_members]
        reduces: dict[str, list[tf.Operation]] = {device: [] for device in pieces}
        if backend == "local":
            for instance in zip(*pieces.values()):
                with tf.device(next(iter(pieces))), tf.name_scope("floor"):
                    total = tf.add_n(list(instance))
                for device in pieces:
                    with tf.device(device), tf.name_scope("floor"):
                        # A stateful reader: Grappler turns pure ops whose results only control
                        # edges wait for into no-ops, and would drop the sum and its copies.
                        reduces[device].append(tf.raw_ops.Assert(condition=tf.constant(True), data=[tf.identity(total)]))
        else:
            for device, tower_pieces in pieces.items():
                previous: list[tf.Operation] = []
                with tf.device(device), tf.name_scope("floor"):
                    for instance, piece in enumerate(tower_pieces):
                        previous = [model_sync_bn.all_reduce(
                            piece, len(members), FLOOR_GROUP_KEY, instance, backend, after=previous).op]
                        reduces[device] += previous
    waiting: dict[str, list[str]] = {}  # node -> the all-reduces it waits for
    for device, tower_members in members.items():
        for (op, _, _), reduce in zip(tower_members, reduces[device]):
            waiting.setdefault(op.name if gated else "train_op", []).append(f"^{reduce.name}")
    floor = graph.as_graph_def()
    for node in list(floor.node):
        if node.name not in waiting:
            continue
        if not gated:
            node.input.extend(waiting[node.name])
            continue
        # The op reads its scale through an Identity that waits: a control edge on the op
        # itself would keep Grappler from fusing it with its ReLU, as bnrewrite's are.
        slot = 1 if node.op == "FusedBatchNormV3" else 2
        gate = floor.node.add(name=f"{node.name}/floor_gate", op="Identity", device=node.device,
                              input=[node.input[slot], *waiting[node.name]])
        gate.attr["T"].type = tf.float32.as_datatype_enum
        node.input[slot] = gate.name
    return floor


def keras_sync_variant(towers: int, size: Size, dtype: str, device: str) -> Variant:
    """deep_net's model in tf_keras layers with `BatchNormalization(synchronized=True)`, built in
    graph mode by `MirroredStrategy.run` with a tf.compat.v1 Momentum optimizer (the replicas'
    gradients summed, each loss scaled by 1/K).

    The strategy's all-reduces are CollectiveAllReduce: with the default cross-device ops the
    build fails ("Unsuccessful at finding variable conv1/kernel/replica_1"): the layer's
    tf.custom_gradient walks back from a sum that takes every replica's input and meets the
    other replicas' variables. float16 runs under the "mixed_float16" policy (float32
    variables, float16 computation), the policy tf_keras has for half precision."""
    import tf_keras

    devices = [f"/{device}:{k}" for k in range(towers)]
    hint = tf.distribute.experimental.CommunicationImplementation.NCCL if device == "gpu" else None
    options = tf.distribute.experimental.CommunicationOptions(**({"implementation": hint} if hint else {}))
    policy = "mixed_float16" if dtype == "float16" else "float32"
    graph = tf.Graph()
    try:
        with graph.as_default(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            strategy = tf.distribute.MirroredStrategy(
                devices, cross_device_ops=cross_device_ops.CollectiveAllReduce(devices, towers, options))
            with strategy.scope():
                opt = tf1.train.MomentumOptimizer(0.1, 0.9)
                layers = []
                for i in range(size.layers):
                    layers += [tf_keras.layers.Conv2D(size.channels, 3, padding="same", use_bias=False,
                                                      name=f"conv{i}", dtype=policy),
                               tf_keras.layers.BatchNormalization(synchronized=True, name=f"bn{i}", dtype=policy),
                               tf_keras.layers.ReLU(dtype=policy)]
                dense = tf_keras.layers.Dense(10, name="dense", dtype=policy)
                norms = layers[1::3]

                def step() -> tuple[tf.Tensor, tf.Tensor, tf.Operation]:
                    images = tf1.placeholder(tf.as_dtype(dtype), [size.batch, size.image, size.image, 3], name="images")
                    labels = tf1.placeholder(tf.int32, [size.batch], name="labels")
                    before = {u for norm in norms for u in norm.updates}
                    x = images
                    for layer in layers:
                        x = layer(x, training=True)
                    logits = tf.cast(dense(tf.reduce_mean(x, axis=[1, 2])), tf.float32)
                    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
                    # This replica's moving-average updates; the other replicas run theirs.
                    with tf.control_dependencies([u for norm in norms for u in norm.updates if u not in before]):
                        minimize = opt.minimize(loss / float(towers))
                    return images, labels, minimize

                images, labels, minimize = (strategy.experimental_local_results(t) for t in strategy.run(step))
            tf.group(*minimize, name="train_op")
            tf1.global_variables_initializer()
    except (ValueError, TypeError, LookupError, tf.errors.OpError) as error:  # what a failed build raises
        return Variant("keras_sync", None, error=f"cannot build: {type(error).__name__}: {str(error).splitlines()[0]}")
    return Variant("keras_sync", graph.as_graph_def(), inputs=[(i.name, l.name) for i, l in zip(images, labels)])
