"""Model files on disk, in every format bnrewrite reads, for the CLI, format and fuzz tests.

`write_models(directory)` builds a 2-tower training graph with `models.build_towers` and writes:

    towers.pb / towers.pbtxt      GraphDef, binary and text
    towers.meta / towers.metatxt  MetaGraphDef (Saver export), binary and text
    ckpt/model.*                  the checkpoint taken right after initialization
    saved/                        SavedModel: MetaGraph [train] (the towers graph, with a
                                  signature) and [serve] (a one-device inference graph)
    inference.pb                  inference-only graph (is_training=False)
    one_tower.pb                  the same model on one device
    mismatch.pb                   two towers whose batch norms differ (epsilon)
    no_bn.pb                      a graph without batch norm
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np
import tensorflow as tf
from google.protobuf import text_format
from models import (
    FILTERS,
    Built,
    Result,
    Spec,
    build_towers,
    image_shape,
    initial_values,
    session_config,
)

SPEC = Spec(towers=2, batch=4, layer="legacy", data_format="NHWC")


@dataclass
class ModelFiles:
    root: str
    spec: Spec
    built: Built
    pb: str
    pbtxt: str
    meta: str
    metatxt: str
    ckpt: str
    saved: str
    inference: str
    one_tower: str
    mismatch: str
    no_bn: str


def write_models(directory: str, spec: Spec = SPEC) -> ModelFiles:
    path = lambda name: os.path.join(directory, name)
    formats = write_formats(directory, spec, serve=True)
    built = formats.built
    with open(formats.pb, "rb") as f:
        graph_def = tf.compat.v1.GraphDef.FromString(f.read())  # as built, before the SavedModel's saver
    _write(path("towers.pbtxt"), text_format.MessageToString(graph_def).encode())
    with open(formats.meta, "rb") as f:
        meta = tf.compat.v1.MetaGraphDef.FromString(f.read())
    _write(path("towers.metatxt"), text_format.MessageToString(meta).encode())

    _write(path("inference.pb"), build_inference(spec).as_graph_def().SerializeToString())
    one = build_towers(Spec(**{**spec.__dict__, "towers": 1}))
    _write(path("one_tower.pb"), one.graph.as_graph_def().SerializeToString())
    mismatch = tf.compat.v1.GraphDef()
    mismatch.CopyFrom(graph_def)
    for node in mismatch.node:
        if node.op.startswith("FusedBatchNorm") and node.name.startswith("tower_1/"):
            node.attr["epsilon"].f = 0.5
    _write(path("mismatch.pb"), mismatch.SerializeToString())
    _write(path("no_bn.pb"), build_no_bn().as_graph_def().SerializeToString())
    return ModelFiles(
        directory, spec, built, path("towers.pb"), path("towers.pbtxt"), path("towers.meta"), path("towers.metatxt"),
        formats.ckpt, path("saved"), path("inference.pb"), path("one_tower.pb"), path("mismatch.pb"), path("no_bn.pb"),
    )


@dataclass
class FormFiles:
    """One built graph in the three formats: GraphDef, MetaGraphDef (+ checkpoint), SavedModel."""

    built: Built
    pb: str
    meta: str
    ckpt: str
    saved: str


def write_formats(directory: str, spec: Spec, serve: bool = False) -> FormFiles:
    """build_towers(spec) written as towers.pb, towers.meta with ckpt/model (its initial values)
    and a SavedModel saved/ holding the towers graph, tagged [train] (and `write_saved_model`'s
    [serve] graph when `serve`)."""
    os.makedirs(directory, exist_ok=True)
    path = lambda name: os.path.join(directory, name)
    built = build_towers(spec)
    _write(path("towers.pb"), built.graph.as_graph_def().SerializeToString())
    with built.graph.as_default():
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=built.graph, config=session_config(spec.towers)) as sess:
            sess.run(built.init)
            saver.save(sess, path("ckpt/model"), write_meta_graph=False)
        meta = tf.compat.v1.train.export_meta_graph(graph=built.graph, saver_def=saver.as_saver_def(), clear_devices=False)
    _write(path("towers.meta"), meta.SerializeToString())
    write_saved_model(path("saved"), built, spec, serve)
    return FormFiles(built, path("towers.pb"), path("towers.meta"), path("ckpt/model"), path("saved"))


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _logits_inference(images, spec: Spec):
    """The model of towers_model with batch norm in inference mode (same variable names)."""
    from tf_keras.src.legacy_tf_layers import normalization as legacy_norm

    init = initial_values(spec)
    with tf.compat.v1.variable_scope("net", reuse=tf.compat.v1.AUTO_REUSE):
        x = images
        for idx, cin in ((1, spec.channels), (2, FILTERS)):
            with tf.compat.v1.variable_scope(f"conv{idx}"):
                kernel = tf.compat.v1.get_variable(
                    "kernel", initializer=init[f"conv{idx}/kernel"])
            x = tf.nn.conv2d(x, kernel, strides=1, padding="SAME")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                x = legacy_norm.batch_normalization(x, axis=3, training=False, fused=True, name=f"bn{idx}")
            x = tf.nn.relu(x)
        x = tf.reduce_mean(x, axis=[1, 2])
        with tf.compat.v1.variable_scope("dense"):
            kernel = tf.compat.v1.get_variable("kernel", initializer=init["dense/kernel"])
            bias = tf.compat.v1.get_variable("bias", initializer=init["dense/bias"])
        return tf.nn.bias_add(tf.matmul(x, kernel), bias)


def build_inference(spec: Spec) -> tf.Graph:
    graph = tf.Graph()
    with graph.as_default(), tf.device("/cpu:0"):
        images = tf.compat.v1.placeholder(tf.float32, image_shape(spec, spec.batch), name="images")
        tf.identity(_logits_inference(images, spec), name="logits")
    return graph


def build_no_bn() -> tf.Graph:
    graph = tf.Graph()
    with graph.as_default():
        for k in range(2):
            with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"):
                x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
                w = tf.constant(np.ones((3, 2), np.float32))
                tf.reduce_sum(tf.matmul(x, w), name="loss")
    return graph


def write_saved_model(directory: str, built: Built, spec: Spec, serve: bool = True) -> None:
    """A TF1 SavedModel: [train] is the towers graph, [serve] (unless not `serve`) a one-device
    inference graph."""
    builder = tf.compat.v1.saved_model.Builder(directory)
    graph = built.graph
    with graph.as_default():
        inputs = {}
        for k, (images, labels) in enumerate(built.inputs):
            inputs[f"images_{k}"] = tf.compat.v1.saved_model.build_tensor_info(graph.get_tensor_by_name(images))
            inputs[f"labels_{k}"] = tf.compat.v1.saved_model.build_tensor_info(graph.get_tensor_by_name(labels))
        loss = tf.compat.v1.saved_model.build_tensor_info(graph.get_tensor_by_name(built.loss))
        signature = tf.compat.v1.saved_model.build_signature_def(inputs, {"loss": loss}, method_name="train")
        with tf.compat.v1.Session(graph=graph, config=session_config(spec.towers)) as sess:
            sess.run(built.init)
            builder.add_meta_graph_and_variables(sess, ["train"], signature_def_map={"train": signature},
                                                 clear_devices=False, strip_default_attrs=False)
    if serve:
        inference = build_inference(spec)
        with inference.as_default():
            images = inference.get_tensor_by_name("images:0")
            logits = inference.get_tensor_by_name("logits:0")
            signature = tf.compat.v1.saved_model.predict_signature_def({"images": images}, {"logits": logits})
            builder.add_meta_graph(["serve"], signature_def_map={"serving_default": signature}, clear_devices=False)
    os.makedirs(os.path.join(directory, "assets"), exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        builder.save()
    assets = os.path.join(directory, "assets")
    if not os.listdir(assets):
        _write(os.path.join(assets, "vocab.txt"), b"cat\ndog\n")


# ---------------------------------------------------------------------------
# Training what a rewrite wrote
# ---------------------------------------------------------------------------


def _feed(built: Built, images: np.ndarray, labels: np.ndarray) -> dict:
    n = len(built.inputs)
    per = len(images) // n
    feed = {}
    for k, (img, lbl) in enumerate(built.inputs):
        feed[img] = images[k * per:(k + 1) * per]
        feed[lbl] = labels[k * per:(k + 1) * per]
    return feed


def _steps(sess, graph, built: Built, batches) -> Result:
    train_op = graph.get_operation_by_name(built.train_op)
    loss = graph.get_tensor_by_name(built.loss)
    losses = []
    for images, labels in batches:
        _, value = sess.run([train_op, loss], feed_dict=_feed(built, images, labels))
        losses.append(float(value))
    values = sess.run(dict(built.variables))
    return Result(losses=np.asarray(losses, np.float64), variables={k: np.asarray(v) for k, v in values.items()})


def train_meta(meta_path: str, ckpt: str, built: Built, batches, num_devices: int) -> Result:
    """import_meta_graph + Saver.restore(ckpt), then train on `batches` (nothing initialized by hand)."""
    graph = tf.Graph()
    with graph.as_default():
        saver = tf.compat.v1.train.import_meta_graph(meta_path, clear_devices=False)
        with tf.compat.v1.Session(graph=graph, config=session_config(num_devices)) as sess:
            saver.restore(sess, ckpt)
            return _steps(sess, graph, built, batches)


def train_saved_model(directory: str, tags: list[str], built: Built, batches, num_devices: int) -> Result:
    """tf.compat.v1.saved_model.loader.load, then train on `batches`."""
    graph = tf.Graph()
    with graph.as_default():
        with tf.compat.v1.Session(graph=graph, config=session_config(num_devices)) as sess:
            tf.compat.v1.saved_model.loader.load(sess, tags, directory)
            return _steps(sess, graph, built, batches)


_CACHE: dict[str, ModelFiles] = {}


def cached_models() -> ModelFiles:
    """`write_models` into a temporary directory, once per test process (treat it as read-only)."""
    if "files" not in _CACHE:
        import atexit
        import shutil
        import tempfile

        directory = tempfile.mkdtemp(prefix="bnrewrite-models-")
        atexit.register(shutil.rmtree, directory, True)
        _CACHE["files"] = write_models(directory)
    return _CACHE["files"]


def tree_digest(path: str) -> dict[str, str]:
    """sha256 of every file under `path` (or of `path` itself), by relative name."""
    import hashlib

    if os.path.isfile(path):
        with open(path, "rb") as f:
            return {".": hashlib.sha256(f.read()).hexdigest()}
    digests = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                digests[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return digests


def tree_snapshot(path: str) -> dict[str, str]:
    """Everything at and under `path`, links not followed: relative name -> kind and content
    ("dir", "file <sha256>", "link <target>", "fifo", "other"); {} when nothing is there."""
    import hashlib
    import stat

    def entry(full: str) -> str:
        mode = os.lstat(full).st_mode
        if stat.S_ISLNK(mode):
            return f"link {os.readlink(full)}"
        if stat.S_ISDIR(mode):
            return "dir"
        if stat.S_ISREG(mode):
            with open(full, "rb") as f:
                return f"file {hashlib.sha256(f.read()).hexdigest()}"
        return "fifo" if stat.S_ISFIFO(mode) else "other"

    if not os.path.lexists(path):
        return {}
    snapshot = {".": entry(path)}
    if snapshot["."] == "dir":
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                full = os.path.join(root, name)
                snapshot[os.path.relpath(full, path)] = entry(full)
    return snapshot
