"""Multi-tower trainers written the way widely used TF1 multi-GPU trainers were (issue 26).

Graph builders for tests/test_trainers.py; each returns a Trainer. Called with towers=1 and
the global batch, a builder gives the one-device reference of the same model: same variable
names, same initial values (constants drawn from numpy, keyed by the variable's name inside
its tower), same optimizer.

* inception(towers, batch, updates): tensorflow/models' inception multi-GPU trainer. Towers
  tower_i on /cpu:i share variables (the variable scope reuses them after tower 0) placed on
  /cpu:0; batch norm written by hand (tf.nn.moments + tf.nn.batch_normalization) with moving
  mean and variance following zero-debiased assign_moving_average (its `biased` and
  `local_step` variables); UPDATE_OPS read for the tower's scope inside the tower loop, so one
  tower's updates are grouped: the last (as inception), the first, the middle one, or the last
  tower's in a separate op fetched beside the train op ("separate"); or none, every tower's
  statistics waiting on its own updates ("in_place", TF-Slim's updates_collections=None).
  Gradients averaged on
  /cpu:0, RMSProp applied once, then an ExponentialMovingAverage of the trainable variables
  (ordered after the apply so every run reads the same weights; inception's own group leaves
  that order to chance).
* independent(towers, batch, fused): tf_cnn_benchmarks' --variable_update=independent: tower i
  on /cpu:i with its own variables (variable scope v<i>), its own optimizer applying its own
  gradients only, tf_keras legacy batch_normalization; every tower's updates in the train op.
  K trainings in one graph.
* coupled(towers, batch, coupling): towers tower_i on /cpu:i, each with its own copy of every
  variable (variable scope v<i>, or v0 shared for "shared"), plain SGD, every tower's updates
  in the train op, coupled per COUPLINGS: gradients averaged per variable (all towers', or
  "mean_pairs": towers 2p and 2p+1 only, two models of two towers each, or "nccl": summed by
  NcclAllReduce, which only a GPU runs); one shared copy;
  each tower's own SGD then every copy assigned the mean of the copies, in the train op or in
  an op run after it; or own SGD with only a scalar shared (a global norm clipping every
  tower's gradients, a learning rate decayed by a shared global_step, the logged loss sum the
  updates wait on): K trainings in one graph.
* blended(towers, batch, updates): Keras's V2 fused batch norm (exponential_avg_factor blends
  the running statistics in the op; assigns store its outputs in the shared moving
  variables), the train op running one tower's assigns, or none beside an op that does.
* clones(towers, batch, fused, placement): TF-Slim model_deploy with clone_on_cpu: clone_i
  name scopes, all on /device:CPU:0 ("cpu0") or with no device at all ("none"), shared
  variables, each clone's loss divided by the number of clones, gradients summed, the first
  clone's UPDATE_OPS grouped with the apply, and the train op a loss tensor that depends on them.
"""

from __future__ import annotations

import contextlib
import warnings
import zlib
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import nccl_ops
from tensorflow.python.ops.control_flow_ops import with_dependencies
from tensorflow.python.training.moving_averages import assign_moving_average

from models import NUM_CLASSES, Result, session_config

tf1 = tf.compat.v1
IMAGE, CHANNELS, FILTERS = 6, 3, 4
DECAY, EPSILON = 0.9, 1e-3
UPDATE_CHOICES = ("last", "first", "middle", "separate", "in_place")
PLACEMENTS = ("cpu0", "none")
#: How coupled() joins its towers' trainings: replicas of one model first, then K models.
REPLICAS = ("mean_grads", "shared", "average_in_step", "average_after")
APART = ("global_norm", "shared_lr", "loss_sum")
COUPLINGS = (*REPLICAS, *APART, "mean_pairs", "nccl")


@dataclass
class Trainer:
    graph: tf.Graph
    fetches: list[str]  # what one training step runs together: the train op (and an op beside it)
    loss: str  # the scalar loss tensor (mean over every example of the step)
    inputs: list[tuple[str, str]]  # (images, labels) placeholders per tower
    init: str
    variables: dict[str, str]  # every global variable's name -> a tensor reading its value
    after: list[str] = field(default_factory=list)  # run in a second sess.run after each step's fetches


def _constant(key: str, shape: list[int], mean: float = 0.0, std: float | None = None) -> tf1.constant_initializer:
    """The same initial value wherever `key` is created (any tower, the reference); std defaults
    to 1/sqrt(fan in)."""
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    std = 1.0 / np.sqrt(np.prod(shape[:-1])) if std is None else std
    return tf1.constant_initializer((mean + std * rng.standard_normal(shape)).astype(np.float32))


def _on(device: str | None) -> contextlib.AbstractContextManager:
    return tf.device(device) if device else contextlib.nullcontext()


def _moments_batch_norm(x: tf.Tensor, name: str, variables_device: str | None, in_place: bool = False) -> tf.Tensor:
    """Inception's hand-written batch norm: batch moments, zero-debiased moving averages in
    UPDATE_OPS; `in_place`: the statistics the layer normalizes with wait on the updates
    instead (TF-Slim's updates_collections=None)."""
    channels = [x.shape[-1]]
    with tf1.variable_scope(name):
        with _on(variables_device):
            beta = tf1.get_variable("beta", channels, initializer=_constant(f"{name}/beta", channels, 0.0, 0.1))
            gamma = tf1.get_variable("gamma", channels, initializer=_constant(f"{name}/gamma", channels, 1.0, 0.1))
            moving_mean = tf1.get_variable("moving_mean", channels, initializer=tf1.zeros_initializer(),
                                           trainable=False)
            moving_variance = tf1.get_variable("moving_variance", channels, initializer=tf1.ones_initializer(),
                                               trainable=False)
        mean, variance = tf.nn.moments(x, [0, 1, 2])
        updates = [assign_moving_average(moving_mean, mean, DECAY, zero_debias=True),
                   assign_moving_average(moving_variance, variance, DECAY, zero_debias=True)]
        if in_place:
            with tf.control_dependencies(updates):
                mean, variance = tf.identity(mean), tf.identity(variance)
        else:
            for update in updates:
                tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)
    return tf.nn.batch_normalization(x, mean, variance, beta, gamma, EPSILON)


def _legacy_batch_norm(x: tf.Tensor, name: str, fused: bool) -> tf.Tensor:
    from tf_keras.src.legacy_tf_layers import normalization

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return normalization.batch_normalization(x, momentum=DECAY, epsilon=EPSILON, training=True, fused=fused,
                                                 name=name)


def _logits(images: tf.Tensor, batch_norm, variables_device: str | None = None) -> tf.Tensor:
    """conv3x3 -> batch_norm -> relu, twice; global mean; dense. batch_norm(x, name) -> y."""
    x = images
    with tf1.variable_scope("net"):
        for i in (1, 2):
            shape = [3, 3, x.shape[-1], FILTERS]
            with _on(variables_device):
                kernel = tf1.get_variable(f"conv{i}/weights", shape, initializer=_constant(f"conv{i}", shape))
            x = tf.nn.relu(batch_norm(tf.nn.conv2d(x, kernel, 1, "SAME"), f"bn{i}"))
        with _on(variables_device):
            weights = tf1.get_variable("logits/weights", [FILTERS, NUM_CLASSES],
                                       initializer=_constant("logits", [FILTERS, NUM_CLASSES]))
            biases = tf1.get_variable("logits/biases", [NUM_CLASSES], initializer=tf1.zeros_initializer())
        return tf.matmul(tf.reduce_mean(x, [1, 2]), weights) + biases


def _placeholders(batch: int) -> tuple[tf.Tensor, tf.Tensor]:
    return (tf1.placeholder(tf.float32, [batch, IMAGE, IMAGE, CHANNELS], name="images"),
            tf1.placeholder(tf.int32, [batch], name="labels"))


def _cross_entropy(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def _readout() -> dict[str, str]:
    with tf.name_scope("readout"):
        return {v.op.name: v.value().name for v in tf1.global_variables()}


def _finish(graph: tf.Graph, fetches: list, loss: tf.Tensor, inputs: list, after: tuple = ()) -> Trainer:
    init = tf1.global_variables_initializer()
    return Trainer(graph=graph, fetches=[f.name for f in fetches], loss=loss.name,
                   inputs=[(x.name, y.name) for x, y in inputs], init=init.name, variables=_readout(),
                   after=[op.name for op in after])


def inception(towers: int, batch: int, updates: str = "last") -> Trainer:
    """The inception multi-GPU trainer; `updates` picks whose batch-norm updates run (UPDATE_CHOICES)."""
    chosen = {"first": 0, "middle": towers // 2, "last": towers - 1, "separate": towers - 1, "in_place": -1}[updates]
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/cpu:0"):
            global_step = tf1.get_variable("global_step", [], tf.int64, initializer=tf1.zeros_initializer(),
                                           trainable=False, use_resource=True)
        opt = tf1.train.RMSPropOptimizer(0.05, decay=0.9, momentum=0.9, epsilon=1.0)
        inputs, losses, tower_grads = [], [], []
        batchnorm_updates: list = []
        with tf1.variable_scope(tf1.get_variable_scope(), use_resource=True):
            for i in range(towers):
                with tf.device(f"/cpu:{i}"), tf.name_scope(f"tower_{i}") as scope:
                    images, labels = _placeholders(batch)
                    loss = _cross_entropy(labels, _logits(
                        images, lambda x, name: _moments_batch_norm(x, name, "/cpu:0", updates == "in_place"),
                        "/cpu:0"))
                    tf1.get_variable_scope().reuse_variables()
                    tower_updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope)
                    if i == chosen:
                        batchnorm_updates = tower_updates
                    tower_grads.append(opt.compute_gradients(loss))
                inputs.append((images, labels))
                losses.append(loss)
        with tf.device("/cpu:0"):
            grads = [(tf.reduce_mean(tf.stack([g for g, _ in pairs]), 0), pairs[0][1]) for pairs in zip(*tower_grads)]
            loss = tf.identity(tf.add_n(losses) / towers, name="loss")
        apply_gradient_op = opt.apply_gradients(grads, global_step=global_step)
        with tf.control_dependencies([apply_gradient_op]):
            variables_averages_op = tf1.train.ExponentialMovingAverage(0.9, global_step).apply(
                tf1.trainable_variables())
        batchnorm_updates_op = tf.group(*batchnorm_updates, name="batchnorm_updates")
        if updates == "separate":
            fetches = [tf.group(apply_gradient_op, variables_averages_op, name="train_op"), batchnorm_updates_op]
        else:
            fetches = [tf.group(apply_gradient_op, variables_averages_op, batchnorm_updates_op, name="train_op")]
        return _finish(graph, fetches, loss, inputs)


def independent(towers: int, batch: int, fused: bool = True) -> Trainer:
    """K models trained apart in one graph (tf_cnn_benchmarks' independent variables)."""
    graph = tf.Graph()
    with graph.as_default():
        inputs, losses, steps = [], [], []
        for i in range(towers):
            with tf.device(f"/cpu:{i}"), tf.name_scope(f"tower_{i}") as scope, \
                    tf1.variable_scope(f"v{i}", use_resource=True):
                images, labels = _placeholders(batch)
                loss = _cross_entropy(labels, _logits(images, lambda x, name: _legacy_batch_norm(x, name, fused)))
                opt = tf1.train.MomentumOptimizer(0.1, 0.9)
                own = tf1.trainable_variables(f"v{i}/")
                steps.append(opt.apply_gradients(opt.compute_gradients(loss, var_list=own)))
                steps += tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope)
            inputs.append((images, labels))
            losses.append(loss)
        with tf.device("/cpu:0"):
            loss = tf.identity(tf.add_n(losses) / towers, name="loss")
        return _finish(graph, [tf.group(*steps, name="train_op")], loss, inputs)


def coupled(towers: int, batch: int, coupling: str) -> Trainer:
    """K towers whose copies of the variables train one model or K models (COUPLINGS)."""
    graph = tf.Graph()
    with graph.as_default():
        global_step = tf1.train.get_or_create_global_step()
        rate = tf1.train.exponential_decay(0.1, global_step, 1, 0.9) if coupling == "shared_lr" else 0.1
        inputs, losses, tower_grads, updates = [], [], [], []
        for i in range(towers):
            scope = "v0" if coupling == "shared" else f"v{i}"
            with tf.device(f"/cpu:{i}"), tf.name_scope(f"tower_{i}") as name_scope, \
                    tf1.variable_scope(scope, reuse=tf1.AUTO_REUSE, use_resource=True):
                images, labels = _placeholders(batch)
                loss = _cross_entropy(labels, _logits(images, lambda x, name: _legacy_batch_norm(x, name, True)))
                own = tf1.trainable_variables(f"{scope}/")
                tower_grads.append(list(zip(tf.gradients(loss, own), own)))
                updates += tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, name_scope)
            inputs.append((images, labels))
            losses.append(loss)
        with tf.device("/cpu:0"):
            loss = tf.identity(tf.add_n(losses) / towers, name="loss")
        opt = tf1.train.GradientDescentOptimizer(rate)
        if coupling in ("mean_grads", "shared", "mean_pairs", "nccl"):
            pairs = []
            for role in zip(*tower_grads):
                grads = [g for g, _ in role]
                if coupling == "nccl":  # tf_cnn_benchmarks' replicated variables (built only: no GPU here)
                    sums = nccl_ops.all_sum(grads)
                else:  # each tower sums every tower's; "mean_pairs": its pair's (towers 2p and 2p+1)
                    sums = [tf.add_n(grads[k - k % 2:k - k % 2 + 2] if coupling == "mean_pairs" else grads)
                            for k in range(towers)]
                divisor = 2 if coupling == "mean_pairs" else towers
                applied = [(total / divisor, v) for total, (_, v) in zip(sums, role)]
                pairs += applied[:1] if coupling == "shared" else applied
            return _finish(graph, [tf.group(opt.apply_gradients(pairs), *updates, name="train_op")], loss, inputs)
        if coupling == "global_norm":
            flat, _ = tf.clip_by_global_norm([g for grads in tower_grads for g, _ in grads], 1e6)
            size = len(tower_grads[0])
            tower_grads = [list(zip(flat[k * size:(k + 1) * size], [v for _, v in grads]))
                           for k, grads in enumerate(tower_grads)]
        with tf.control_dependencies([loss] if coupling == "loss_sum" else []):
            applies = [opt.apply_gradients(grads, global_step=global_step if k == 0 else None)
                       for k, grads in enumerate(tower_grads)]
        if coupling not in ("average_in_step", "average_after"):
            return _finish(graph, [tf.group(*applies, *updates, name="train_op")], loss, inputs)
        with tf.control_dependencies(applies if coupling == "average_in_step" else []):
            averages = []
            for copies in zip(*(tf1.trainable_variables(f"v{k}/") for k in range(towers))):
                mean = tf.add_n([v.read_value() for v in copies]) / towers
                averages += [v.assign(mean, read_value=False) for v in copies]
            average = tf.group(*averages, name="average")
        if coupling == "average_in_step":
            return _finish(graph, [tf.group(average, *updates, name="train_op")], loss, inputs)
        return _finish(graph, [tf.group(*applies, *updates, name="train_op")], loss, inputs, after=(average,))


def clones(towers: int, batch: int, fused: bool, placement: str = "cpu0") -> Trainer:
    """TF-Slim model_deploy's clones on one CPU (placement "cpu0") or on no device ("none")."""
    graph = tf.Graph()
    with graph.as_default(), _on("/device:CPU:0" if placement == "cpu0" else None):
        opt = tf1.train.MomentumOptimizer(0.1, 0.9)
        inputs, clone_losses, clone_grads = [], [], []
        update_ops: list = []
        for i in range(towers):
            with tf.name_scope(f"clone_{i}") as scope, \
                    tf1.variable_scope(tf1.get_variable_scope(), reuse=True if i > 0 else None, use_resource=True):
                images, labels = _placeholders(batch)
                loss = _cross_entropy(labels, _logits(images, lambda x, name: _legacy_batch_norm(x, name, fused)))
                clone_loss = tf.math.truediv(loss, float(towers), name="clone_loss")
                clone_grads.append(opt.compute_gradients(clone_loss))
                if i == 0:
                    update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope)
            inputs.append((images, labels))
            clone_losses.append(clone_loss)
        grads = [(tf.add_n([g for g, _ in pairs], name=f"{pairs[0][1].op.name}/sum_grads"), pairs[0][1])
                 for pairs in zip(*clone_grads)]
        total_loss = tf.add_n(clone_losses, name="total_loss")
        update_op = tf.group(*update_ops, opt.apply_gradients(grads))
        train_tensor = with_dependencies([update_op], total_loss, name="train_op")
        return _finish(graph, [train_tensor], total_loss, inputs)


def blended(towers: int, batch: int, updates: str = "last") -> Trainer:
    """Keras's V2 fused batch norm: FusedBatchNormV3 with exponential_avg_factor blends the
    running statistics in the op, and plain assigns store its outputs 1 and 2 in the shared
    moving variables; the train op runs one tower's assigns (UPDATE_CHOICES but "in_place")."""
    chosen = {"first": 0, "middle": towers // 2, "last": towers - 1, "separate": towers - 1}[updates]
    graph = tf.Graph()
    with graph.as_default():
        opt = tf1.train.GradientDescentOptimizer(0.1)
        inputs, losses, tower_grads, assigns = [], [], [], []

        def batch_norm(x: tf.Tensor, name: str) -> tf.Tensor:
            with tf1.variable_scope(name):
                scale = tf1.get_variable("gamma", [FILTERS], initializer=_constant(f"{name}/gamma", [FILTERS], 1.0, 0.1))
                offset = tf1.get_variable("beta", [FILTERS], initializer=_constant(f"{name}/beta", [FILTERS], 0.0, 0.1))
                mean = tf1.get_variable("moving_mean", [FILTERS], initializer=tf1.zeros_initializer(), trainable=False)
                variance = tf1.get_variable("moving_variance", [FILTERS], initializer=tf1.ones_initializer(),
                                            trainable=False)
            y, new_mean, new_variance, *_ = tf1.raw_ops.FusedBatchNormV3(
                x=x, scale=scale, offset=offset, mean=mean, variance=variance, epsilon=EPSILON,
                exponential_avg_factor=1 - DECAY, is_training=True)
            assigns[-1] += [tf1.assign(mean, new_mean), tf1.assign(variance, new_variance)]
            return y

        with tf1.variable_scope(tf1.get_variable_scope(), use_resource=True):
            for i in range(towers):
                with tf.device(f"/cpu:{i}"), tf.name_scope(f"tower_{i}"):
                    assigns.append([])
                    images, labels = _placeholders(batch)
                    loss = _cross_entropy(labels, _logits(images, batch_norm))
                    tf1.get_variable_scope().reuse_variables()
                    tower_grads.append(opt.compute_gradients(loss))
                inputs.append((images, labels))
                losses.append(loss)
        with tf.device("/cpu:0"):
            grads = [(tf.add_n([g for g, _ in pairs]) / towers, pairs[0][1]) for pairs in zip(*tower_grads)]
            loss = tf.identity(tf.add_n(losses) / towers, name="loss")
        step = opt.apply_gradients(grads)
        if updates == "separate":
            fetches = [tf.group(step, name="train_op"), tf.group(*assigns[chosen], name="updates")]
        else:
            fetches = [tf.group(step, *assigns[chosen], name="train_op")]
        return _finish(graph, fetches, loss, inputs)


def run(graph: tf.Graph, trainer: Trainer, batches: list, num_devices: int, find=None) -> tuple[Result, dict]:
    """Train on `batches` (tower k gets the k-th equal slice), running every fetch together each
    step; returns the result and the variables' values right after initialization. find(names)
    maps the trainer's names into `graph` (a rewrite's result.find); default: the names as they are."""
    names = (trainer.fetches, trainer.loss, trainer.inputs, trainer.init, trainer.variables, trainer.after)
    fetches, loss, inputs, init, variables, after = find(names) if find else names
    losses = []
    with tf1.Session(graph=graph, config=session_config(num_devices)) as sess:
        sess.run(init)
        initial = sess.run(variables)
        for images, labels in batches:
            per = len(images) // len(inputs)
            feed = {}
            for k, (x, y) in enumerate(inputs):
                feed[x], feed[y] = images[k * per:(k + 1) * per], labels[k * per:(k + 1) * per]
            losses.append(sess.run([loss, *fetches], feed)[0])
            if after:
                sess.run(after)
        final = sess.run(variables)
    return Result(np.asarray(losses, np.float64), final), initial
