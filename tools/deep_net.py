"""Deep conv+BN multi-tower training graphs for the benchmarks, cached as .pb files.

    build_graph_def(towers, layers, channels=8, image=4, batch=2, dtype="float32", bn="fused") -> GraphDef
    build_graph(towers, layers, ...) -> tf.Graph   (the same, with its collections)
    cached_graph_def(towers, layers, ...) -> GraphDef   (built once, kept in a temp dir)

Each tower: images -> L x [conv2d 3x3 -> batch_normalization(training=True, fused=True)
-> relu] -> global pool -> dense -> softmax cross entropy, built with tf_keras's legacy
TF1 layers on `/cpu:k` in name scope `tower_k`, sharing variables through
`variable_scope("net", reuse=AUTO_REUSE)` (or one copy per tower: VARIABLES). Gradients are averaged across towers and applied
once with MomentumOptimizer; the train op runs every tower's moving-average updates:
`tf.group(apply, *UPDATE_OPS)` (`updates="train_op"`), or `tf.group(apply, *groups)` where each
tower groups its own UPDATE_OPS under its scope (`updates="per_tower"`, as trainers that collect
UPDATE_OPS tower by tower do: the train op reaches the updates through those groups). `device="gpu"` places towers on `/gpu:k` (building needs no GPU). Spatial sizes are tiny: building is quick and the graph structure
(what the rewrite sees) is that of a real deep net.

`shapes=True` records every tensor's static shape (`_output_shapes`), as
tf.train.export_meta_graph does and as `rewrite_graph` sees a tf.Graph.

`dtype="float16"` feeds float16 images, so convolutions and activations are float16 (the
fused op keeps its statistics in float32); the loss is taken on float32 logits.
`bn="model_sync"` replaces the legacy layer by tools/model_sync_bn.py's synchronized batch
norm written in model code (tensorpack's way), whose moving averages tower 0 alone updates:
the reference the step benchmark sets bnrewrite against.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

CACHE_DIR = os.path.join(tempfile.gettempdir(), "bnrewrite_bench_graphs")


#: How the towers hold their variables: one shared copy (towers `tower_k`, variables `net/...`);
#: one copy per tower, as the TF benchmarks' --variable_update=replicated lays it out (towers
#: `tower_k`, variables `v<k>/net/...`); or one copy per tower under names that follow no
#: convention (towers `part<letter>`, variables `w_part<letter>/net/...`): lined up by structure.
VARIABLES = ("shared", "replicated", "unnamed")
#: Batch norm as the legacy layer builds it (fused), or synchronized in model code.
BATCH_NORMS = ("fused", "model_sync")
#: How the train op runs the moving-average updates: UPDATE_OPS grouped in it directly, or
#: one group per tower (`tower_k/updates`) that it groups.
UPDATES = ("train_op", "per_tower")


def build_graph_def(towers: int, layers: int, shapes: bool = False, **kwargs: int | str) -> tf.compat.v1.GraphDef:
    return build_graph(towers, layers, **kwargs).as_graph_def(add_shapes=shapes)


def build_graph(
    towers: int, layers: int, channels: int = 8, image: int = 4, batch: int = 2, device: str = "cpu",
    variables: str = "shared", dtype: str = "float32", bn: str = "fused", updates: str = "train_op",
) -> tf.Graph:
    """The graph `build_graph_def` exports, with its collections (variables, UPDATE_OPS)."""
    from tf_keras.src.legacy_tf_layers import convolutional, core, normalization

    if bn not in BATCH_NORMS:
        raise ValueError(f"bn {bn!r}: choose one of {', '.join(BATCH_NORMS)}")
    if updates not in UPDATES:
        raise ValueError(f"updates {updates!r}: choose one of {', '.join(UPDATES)}")
    if bn == "model_sync":
        import model_sync_bn  # beside this file, on sys.path as deep_net is

    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = tf1.train.MomentumOptimizer(0.1, 0.9)
        tower_grads, losses, groups = [], [], []
        for k in range(towers):
            scope = f"part{chr(97 + k)}" if variables == "unnamed" else f"tower_{k}"
            own = {"shared": "", "replicated": f"v{k}", "unnamed": f"w_{scope}"}[variables]
            owned = tf1.variable_scope(own, auxiliary_name_scope=False) if own else contextlib.nullcontext()
            with tf.device(f"/{device}:{k}"), tf.name_scope(scope), owned:
                images = tf1.placeholder(tf.as_dtype(dtype), [batch, image, image, 3], name="images")
                labels = tf1.placeholder(tf.int32, [batch], name="labels")
                with tf1.variable_scope("net", reuse=tf1.AUTO_REUSE):
                    x = images
                    for i in range(layers):
                        x = convolutional.conv2d(x, channels, 3, padding="same", use_bias=False, name=f"conv{i}")
                        if bn == "model_sync":
                            backend = "nccl" if device == "gpu" else "collective"
                            x = model_sync_bn.sync_batch_norm(x, towers, k, i, f"bn{i}", backend)
                        else:
                            x = normalization.batch_normalization(x, training=True, fused=True, name=f"bn{i}")
                        x = tf.nn.relu(x)
                    x = tf.reduce_mean(x, axis=[1, 2])
                    logits = core.dense(x, 10, name="dense")
                    if logits.dtype != tf.float32:
                        logits = tf.cast(logits, tf.float32)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
                losses.append(loss)
                tower_grads.append(opt.compute_gradients(loss, var_list=tf1.trainable_variables(own or None)))
                if updates == "per_tower":
                    groups.append(tf.group(*tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, f"{scope}/"), name="updates"))
        with tf.device(f"/{device}:0"), tf.name_scope("average"):
            averaged = [tf.add_n([g for g, _ in per_var]) / float(towers) for per_var in zip(*tower_grads)]
            tf.identity(tf.add_n(losses) / float(towers), name="loss")
        # Shared: one update of each variable; replicated: every tower's copy gets the average.
        copies = tower_grads[:1] if variables == "shared" else tower_grads
        apply = opt.apply_gradients([(g, v) for grads in copies for g, (_, v) in zip(averaged, grads)])
        tf.group(apply, *(groups or tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)), name="train_op")
        tf1.global_variables_initializer()
    return graph


def cached_path(towers: int, layers: int, **kwargs: int | str) -> str:
    for key, default in (("variables", "shared"), ("updates", "train_op")):
        if kwargs.get(key) == default:
            del kwargs[key]  # the default: the file name it always had
    extra = "".join(f"_{k}{v}" for k, v in sorted(kwargs.items()))
    path = os.path.join(CACHE_DIR, f"towers{towers}_layers{layers}{extra}.pb")
    if not os.path.exists(path):
        os.makedirs(CACHE_DIR, exist_ok=True)
        data = build_graph_def(towers, layers, **kwargs).SerializeToString()
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return path


def cached_graph_def(towers: int, layers: int, **kwargs: int | str) -> tf.compat.v1.GraphDef:
    graph_def = tf.compat.v1.GraphDef()
    with open(cached_path(towers, layers, **kwargs), "rb") as f:
        graph_def.ParseFromString(f.read())
    return graph_def
