"""The step check (bnrewrite/session/stepcheck.py) and `bnrewrite verify MODEL` (issue 35).

Every form the README lists passes on one real training step in process (build, the user's own
step with the check's fetches, evaluate), three of them and the checkpoint's model also through
`verify` on a file; rewrites broken on
purpose (one tower's all-reduce bypassed, a wrong epsilon, an update run twice) fail with
PassError naming the layer, tower and figure; inputs from a tf.data iterator or a queue, a
checkpoint, and models verify cannot feed or initialize.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import warnings

import numpy as np
import pytest
import tensorflow as tf
from model_files import cached_models
import trainers
from models import Spec, build_towers, load_graph, make_batches, session_config
from test_cli import assert_one_error_line
from test_cli import bnrewrite as run_cli

from bnrewrite import rewrite_graph
from bnrewrite.errors import PassError
from bnrewrite.graph.edit import Editor
from bnrewrite.graph.nodes import MARK, DType
from bnrewrite.rewrite import api, statistics
from bnrewrite.rewrite.passes import PIPELINE, dedupe_moving_averages, run_passes
from bnrewrite.session import stepcheck

FORMS = {
    "fused legacy": Spec(), "fused op": Spec(layer="fused_op"), "fused NCHW": Spec(data_format="NCHW"),
    "fused float16": Spec(dtype="float16"), "fused bfloat16": Spec(dtype="bfloat16"),
    "moments legacy": Spec(layer="legacy_unfused"), "renorm": Spec(renorm=True),
    "moments cond v1": Spec(layer="moments_cond_v1"), "fused cond v1": Spec(layer="legacy_cond_v1"),
    "fused 4 towers": Spec(towers=4),
}
#: What -v says of the first layer's moving statistics, for some forms.
MOVING = {
    "fused legacy": ["moving_variance once toward the global unbiased variance (factor 0.1)"],
    "moments legacy": ["moving_variance once toward the global variance (factor 0.1)"],
    "renorm": ["renorm_stddev once toward the global standard deviation (factor 0.01)",
               "moving_variance updated once (derived from another update)"],
}
TOWERS = {2: "/device:CPU:0..1", 4: "/device:CPU:0..3"}


@functools.lru_cache(maxsize=None)
def shared_towers(spec: Spec):
    """build_towers(spec), built once per test process for the tests that only read it (rewrite_graph,
    not in place, leaves it as it is)."""
    return build_towers(spec)


def checked_step(spec: Spec, result=None, built=None) -> stepcheck.Verdict:
    """One training step of `result` (default: the rewrite of build_towers(spec)) with the check's
    fetches, as a user's session would run it."""
    built = built or shared_towers(spec)
    result = result or rewrite_graph(built.graph)
    graph = load_graph(result.graph_def)
    check = stepcheck.build(graph, result.graph_def, result.report, python_ops=True)
    images, labels = make_batches(spec, 1)[0]
    feed = {}
    for k, (x, y) in enumerate(built.inputs):
        feed[x], feed[y] = np.array_split(images, spec.towers)[k], np.array_split(labels, spec.towers)[k]
    with tf.compat.v1.Session(graph=graph, config=session_config(spec.towers)) as sess:
        sess.run(built.init)
        before = sess.run(check.before)
        values = sess.run([built.train_op] + check.step, {**feed, **check.feed(before)})[1:]
        after = sess.run(check.after)
    assert not any(op.type.startswith("Assign") for op in graph.get_operations() if op.name.startswith(stepcheck.SCOPE))
    return check.evaluate(before, values, after)


def write_meta(directory, graph: tf.Graph) -> str:
    """`graph` as DIRECTORY/model.meta; the path."""
    path = directory / "model.meta"
    with graph.as_default():
        path.write_bytes(tf.compat.v1.train.export_meta_graph().SerializeToString())
    return str(path)


@pytest.mark.parametrize("form", FORMS)
def test_every_form_verifies_in_process(form):
    spec = FORMS[form]
    verdict = checked_step(spec)
    line = verdict.line()
    print(form, line)
    assert line.startswith(f"verified 2 layers x {spec.towers} towers on {TOWERS[spec.towers]}: worst ")
    assert line.endswith("moving statistics updated once")
    assert {v.towers for v in verdict.layers} == {spec.towers}
    assert all(not v.unchecked for v in verdict.layers), [v.unchecked for v in verdict.layers]
    for phrase in MOVING.get(form, []):
        assert phrase in verdict.layers[0].line()


def test_reference_variables_are_read_as_the_forward_pass_read_them(tmp_path):
    """A reference variable's read aliases the buffer the step's optimizer updates: the check
    takes gamma and beta as read before the step (fed), not whenever its ops run."""
    enabled = tf.compat.v1.resource_variables_enabled()
    tf.compat.v1.disable_resource_variables()
    try:
        built = build_towers(Spec())
    finally:
        if enabled:
            tf.compat.v1.enable_resource_variables()
    assert {op.type for op in built.graph.get_operations() if op.type.startswith("Var")} == {"VariableV2"}
    result = rewrite_graph(built.graph)
    graph = load_graph(result.graph_def)
    snapshots = stepcheck.build(graph, result.graph_def, result.report, python_ops=True).snapshots
    sources = sorted(graph.get_tensor_by_name(read).op.inputs[0].op.name for read in snapshots.values())
    assert sources == sorted(f"net/bn{i}/{v}" for i in (1, 2) for v in ("gamma", "beta") for _ in range(2))
    assert checked_step(Spec(), result=result, built=built).line().startswith("verified 2 layers x 2 towers")
    proc = run_cli("verify", write_meta(tmp_path, built.graph))
    assert proc.returncode == 0 and proc.stdout.startswith("verified 2 layers x 2 towers"), proc.stderr


def test_sync_groups_are_checked_group_by_group():
    spec = Spec(towers=4)
    built = build_towers(spec)
    verdict = checked_step(spec, result=rewrite_graph(built.graph, group_size=2), built=built)
    assert verdict.line().startswith("verified 2 layers x 4 towers on /device:CPU:0..3: worst ")


@pytest.mark.parametrize("form", ["moments cond v1", "fused 4 towers"])
def test_verify_on_a_file(form, tmp_path):
    spec = FORMS[form]
    proc = run_cli("verify", write_meta(tmp_path, build_towers(spec).graph), "-v")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"verified 2 layers x {spec.towers} towers on {TOWERS[spec.towers]}: worst ")
    assert "  net/bn1: " in proc.stdout and "  net/bn2: " in proc.stdout


def test_gpu_towers_run_on_the_cpus_of_their_indices(tmp_path):
    """A graph built for GPUs (NCCL when converted) is verified with the local sum on virtual CPUs."""
    proc = run_cli("verify", write_meta(tmp_path, build_towers(Spec(device="gpu")).graph))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("verified 2 layers x 2 towers on /device:GPU:0..1 (ran on /device:CPU:0..1): worst "), \
        proc.stdout


def test_layers_inside_function_bodies_cannot_be_checked(tmp_path):
    path = tmp_path / "model.pb"
    path.write_bytes(build_towers(Spec(layer="moments_cond_v2")).graph.as_graph_def().SerializeToString())
    assert_one_error_line(run_cli("verify", str(path)), 1, "no synced layer can be checked: all 2 are inside function bodies")


@pytest.mark.parametrize("trainer, phrase", [
    ("inception", "biased once toward the global variance (factor 0.1)"),  # zero-debias: biased, local_step, value
    ("blended", "moving_variance once toward the global unbiased variance (factor 0.1)"),  # exponential_avg_factor
])
def test_the_trainers_update_forms(trainer, phrase):
    built = getattr(trainers, trainer)(2, 4)
    result = rewrite_graph(built.graph)
    graph = load_graph(result.graph_def)
    check = stepcheck.build(graph, result.graph_def, result.report, python_ops=True)
    rng = np.random.default_rng(0)
    feed = {}
    for images, labels in built.inputs:
        feed[images] = rng.standard_normal(graph.get_tensor_by_name(images).shape.as_list()) * 2.0 + 1.0
        feed[labels] = np.zeros(graph.get_tensor_by_name(labels).shape.as_list(), np.int32)
    with tf.compat.v1.Session(graph=graph, config=session_config(2)) as sess:
        sess.run(built.init)
        before = sess.run(check.before)
        values = sess.run(built.fetches + check.step, {**feed, **check.feed(before)})[len(built.fetches):]
        after = sess.run(check.after)
    line = check.evaluate(before, values, after).layers[0].line()
    assert phrase in line, line


def _break_after_passes(monkeypatch, edit=lambda g: g, passes=PIPELINE, meaning=True) -> None:
    """rewrite_graph's passes, then `edit` of their result; without the meaning check unless `meaning`."""
    monkeypatch.setattr(api, "run_passes", lambda graph, plan: (lambda r: (edit(r[0]), r[1]))(run_passes(graph, plan, passes)))
    if not meaning:
        monkeypatch.setattr(api.meaning, "check_meaning", lambda *args: None)


def test_a_tower_whose_all_reduce_is_bypassed_fails_named(monkeypatch):
    """Tower 1 takes its own moments for every tower's rows of the local gather (its Pack still
    gets them, unread)."""
    real = statistics.local_gather

    def bypassed(b, name, vectors, dtype, key):
        gathered = real(b, name, vectors, dtype, key)
        if not b.device.endswith("CPU:1"):
            return gathered
        return b.node("Pack", "own_rows", list(vectors) * key.group_size, T=DType(dtype), N=len(vectors) * key.group_size, axis=0)

    monkeypatch.setattr(statistics, "local_gather", bypassed)
    _break_after_passes(monkeypatch, meaning=False)  # the meaning check sees tower 1's rows unused
    with pytest.raises(PassError, match=r"layer net/bn1, tower /device:CPU:1: the global mean, relative to \|mean\| \+ "
                                        r"the standard deviation is off by \d"):
        checked_step(Spec())


def test_a_wrong_epsilon_fails_named(monkeypatch):
    def epsilon_times_100(graph):
        editor = Editor(graph)
        for node in graph:
            if MARK in node.attr and node.op == "Const" and node.name.endswith("/epsilon"):
                tensor = editor.mutable(node.name).attr["value"].tensor
                tensor.CopyFrom(tf.make_tensor_proto(np.float32(0.1)))
            elif MARK in node.attr and node.op.startswith("FusedBatchNorm") and not node.attr["is_training"].b:
                editor.mutable(node.name).attr["epsilon"].f *= 100  # the inference-mode kernels: epsilon is their attribute
        return editor.finish()

    _break_after_passes(monkeypatch, epsilon_times_100)
    with pytest.raises(PassError, match=r"layer net/bn1, tower /device:CPU:0: the output y against gamma \* \(x - mean\)"):
        checked_step(Spec())


def test_an_update_run_twice_fails_named(monkeypatch):
    _break_after_passes(monkeypatch, passes=tuple(p for p in PIPELINE if p is not dedupe_moving_averages), meaning=False)
    with pytest.raises(PassError, match=r"layer net/bn1: net/bn1/moving_mean is not what one run of its update "
                                        r"tower_0/\S+ writes: off by .* updated more than once per step"):
        checked_step(Spec())


def test_verify_fails_with_12_on_a_broken_rewrite(monkeypatch):
    _break_after_passes(monkeypatch, passes=tuple(p for p in PIPELINE if p is not dedupe_moving_averages), meaning=False)
    assert_one_error_line(run_cli("verify", cached_models().meta), 12, "step check failed: layer net/bn1: ")


def _pipeline_towers(source: str) -> tf.Graph:
    """2 towers on /cpu:k reading their batches from a tf.data iterator or a FIFO queue, a legacy
    batch norm each (shared variables), a momentum optimizer."""
    from tf_keras.src.legacy_tf_layers import normalization

    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.default_rng(1)
        data = rng.standard_normal((4, 3, 3, 2)).astype(np.float32)
        if source == "iterator":
            batches = tf.compat.v1.data.make_one_shot_iterator(tf.data.Dataset.from_tensors(data).repeat())
        else:
            queue = tf.compat.v1.FIFOQueue(8, [tf.float32], shapes=[[3, 3, 2]])
        optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
        grads = []
        for k in range(2):
            with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"), tf.compat.v1.variable_scope("net", reuse=k > 0):
                x = batches.get_next() if source == "iterator" else queue.dequeue_many(4)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    y = normalization.batch_normalization(x, training=True, name="bn")
                loss = tf.reduce_mean(tf.square(y - 1.0))
                grads.append(optimizer.compute_gradients(loss))
        averaged = [(tf.add_n([g for g, _ in pair]) / 2.0, pair[0][1]) for pair in zip(*grads)]
        tf.group(optimizer.apply_gradients(averaged), *tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS),
                 name="train_op")
        tf.compat.v1.global_variables_initializer()
    return graph


@pytest.mark.parametrize("source", ["iterator", "queue"])
def test_inputs_from_an_iterator_or_a_queue_are_fed_directly(source, tmp_path):
    proc = run_cli("verify", write_meta(tmp_path, _pipeline_towers(source)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("verified 1 layers x 2 towers on /device:CPU:0..1: worst "), proc.stdout


def test_a_checkpoint_and_the_json_report(tmp_path):
    files = cached_models()
    report = tmp_path / "verified.json"
    proc = run_cli("verify", files.meta, "--checkpoint", files.ckpt, "--report", str(report))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("verified 2 layers x 2 towers on /device:CPU:0..1: worst ")
    document = json.loads(report.read_text())
    verification = document["graphs"][0]["verification"]
    assert document["command"] == "verify" and verification["worst"] < 1e-5
    assert [v["layer"] for v in verification["layers"]] == ["net/bn1", "net/bn2"]
    tensors = document["graphs"][0]["report"]["layers"][0]["tensors"]
    assert [t["y"] for t in tensors] == ["tower_0/net/bn1/FusedBatchNormV3", "tower_1/net/bn1/FusedBatchNormV3"]
    assert_one_error_line(run_cli("verify", files.meta, "--checkpoint", str(tmp_path / "none")), 1,
                          r"--checkpoint .*none: cannot read it")


def test_models_verify_cannot_feed_or_initialize(tmp_path):
    uneven = tmp_path / "uneven.pb"
    uneven.write_bytes(build_towers(Spec(uneven=True)).graph.as_graph_def().SerializeToString())
    assert_one_error_line(run_cli("verify", str(uneven)), 1, r"input tower_\d/images:0 has shape \(None, 6, 6, 3\): "
                                                             "verify cannot choose its unknown dimensions; give --batch B")
    proc = run_cli("verify", str(uneven), "--batch", "4")
    assert proc.returncode == 0 and proc.stdout.startswith("verified 2 layers x 2 towers"), proc.stderr
    graph = build_towers(Spec()).graph
    with graph.as_default():
        tf.compat.v1.placeholder(tf.string, [2], name="names")
        tf.compat.v1.placeholder(tf.float32, [2], name="extra")
    strings = graph.as_graph_def()
    train = next(n for n in strings.node if n.name == "train_op")
    train.input.extend(["^names", "^extra"])
    path = tmp_path / "strings.pb"
    path.write_bytes(strings.SerializeToString())
    assert_one_error_line(run_cli("verify", str(path)), 1, "input names:0 is of type string, which verify cannot make up")
    bare = graph.as_graph_def()
    kept = [n for n in bare.node if n.name != "net/bn1/gamma/Assign"]
    for node in kept:
        inputs = [i for i in node.input if i != "^net/bn1/gamma/Assign"]
        del node.input[:]
        node.input.extend(inputs)
    del bare.node[:]
    bare.node.extend(kept)
    path = tmp_path / "bare.pb"
    path.write_bytes(bare.SerializeToString())
    assert_one_error_line(run_cli("verify", str(path)), 1, r"variable net/bn1/gamma has no initializer \(1 such\); "
                                                           "give --checkpoint PREFIX")


@pytest.mark.parametrize("means", [(1e-6, 0.5), (300.0, 0.5)], ids=["near zero", "far from zero"])
def test_channels_whose_mean_is_near_zero_or_far_from_it_pass(means):
    """Moments and moving means are judged on the scale of their float32 rounding: the towers'
    local means err by float32 epsilons of |mean| + std, which near a zero mean is far more
    than |mean| (a moving mean: 5.7e-6 relative to it at factor 0.01) and far from zero more
    than std (the mean 1.96e-6 relative to std, the variance 2.35e-6), all against 1.9e-6
    allowed, each seen on a correct rewrite of InceptionV3 at 107x107 (bnrewrite run --verify,
    2026-11-26)."""
    from tf_keras.src.legacy_tf_layers import normalization

    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = tf1.train.GradientDescentOptimizer(0.1)
        inputs, grads = [], []
        for k in range(2):
            with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"):
                x = tf1.placeholder(tf.float32, [8, 4, 4, 2], name="x")
                with tf1.variable_scope("net", reuse=tf1.AUTO_REUSE):
                    y = normalization.batch_normalization(x, training=True, fused=True, momentum=0.99, name="bn")
                loss = tf.reduce_sum(y * tf.constant([1.0, -2.0]))
                inputs.append(x)
                grads.append(opt.compute_gradients(loss))
        averaged = [(tf.add_n([g for g, _ in pair]) / 2.0, pair[0][1]) for pair in zip(*grads)]
        train_op = tf.group(opt.apply_gradients(averaged), *tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))
        init = tf1.global_variables_initializer()
    result = rewrite_graph(graph)
    shadow = load_graph(result.graph_def)
    check = stepcheck.build(shadow, result.graph_def, result.report, python_ops=True)
    x = np.random.default_rng(0).standard_normal([16, 4, 4, 2])
    x = (x - x.mean(axis=(0, 1, 2)) + means).astype(np.float32)  # std 1
    feed = {inputs[k].name: half for k, half in enumerate(np.split(x, 2))}
    with tf1.Session(graph=shadow, config=session_config(2)) as sess:
        sess.run(init.name)
        before = sess.run(check.before)
        values = sess.run([train_op.name] + check.step, {**feed, **check.feed(before)})[1:]
        after = sess.run(check.after)
    verdict = check.evaluate(before, values, after)
    assert "moving_mean once toward the global mean (factor 0.01)" in verdict.layers[0].line()
    assert verdict.worst < 2e-6


def _towers_with_a_layer_built_apart() -> tuple[tf.Graph, list[str]]:
    """2 towers on /cpu:k sharing two legacy batch norms, the second built with another epsilon in
    tower 1 (its copies do not line up: the rewrite skips it), averaged gradients, UPDATE_OPS in
    the train op; the graph and its input placeholders."""
    from tf_keras.src.legacy_tf_layers import normalization

    graph = tf.Graph()
    with graph.as_default(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        inputs, grads = [], []
        for k in range(2):
            with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"), tf.compat.v1.variable_scope("net", reuse=k > 0):
                x = tf.compat.v1.placeholder(tf.float32, [4, 3, 3, 2], name="x")
                y = normalization.batch_normalization(x, training=True, name="bn1")
                y = normalization.batch_normalization(y, training=True, epsilon=1e-3 * 10**k, name="bn2")
                loss = tf.reduce_sum(y * tf.constant([1.0, -2.0]), name="loss")
                grads.append(opt.compute_gradients(loss))
                inputs.append(x.name)
        averaged = [(tf.add_n([g for g, _ in pair]) / 2.0, pair[0][1]) for pair in zip(*grads)]
        tf.group(opt.apply_gradients(averaged), *tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS),
                 name="train_op")
        tf.compat.v1.global_variables_initializer()
    return graph, inputs


UNSYNCED = (r"step check failed: 1 of 2 training batch-norm layers are not synchronized, their towers normalize with "
            r"their own batch statistics: net/bn2 \(epsilon differs between towers .*\); the 1 synced: verified 1 "
            r"layers x 2 towers")


def test_a_layer_left_unsynchronized_fails_the_check_named(capsys, tmp_path):
    """enable(verify=True, allow_unsynced=True, exit_on_refusal=True) (as run --verify --allow-unsynced
    runs it): the line counts the layer the rewrite skipped and fails on it (UnsyncedLayerError,
    exit 7); verify MODEL refuses the model naming the layer, as convert does."""
    import bnrewrite
    from bnrewrite.cli import main
    from bnrewrite.errors import UnsyncedLayerError

    graph, inputs = _towers_with_a_layer_built_apart()
    assert {s["node"] for s in rewrite_graph(graph, allow_unsynced=True).report.skipped} == {
        "tower_0/net/bn2/FusedBatchNormV3",
                                                                         "tower_1/net/bn2/FusedBatchNormV3"}
    feed = {x: np.random.default_rng(k).standard_normal([4, 3, 3, 2]) for k, x in enumerate(inputs)}
    loss = graph.get_tensor_by_name("tower_0/net/loss:0").name
    try:
        bnrewrite.enable(verify=True, allow_unsynced=True, exit_on_refusal=True)
        with tf.compat.v1.Session(graph=graph, config=session_config(2)) as sess:
            sess.run("init")
            sess.run(loss, feed)  # forward only: not the step
            with pytest.raises(SystemExit) as error:
                sess.run("train_op", feed)
    finally:
        bnrewrite.disable()
    assert error.value.code == UnsyncedLayerError.exit_code == 7
    assert re.search(r"bnrewrite: error: graph \d+: the first step failed its check, the script is stopped: " + UNSYNCED,
                     capsys.readouterr().err.splitlines()[-1])
    path = write_meta(tmp_path, _towers_with_a_layer_built_apart()[0])
    assert main(["verify", path]) == 7  # refused as convert refuses it, before any step
    assert_one_error_line(subprocess.CompletedProcess([], 7, "", capsys.readouterr().err), 7,
                          r"tower_0/net/bn2/FusedBatchNormV3: epsilon differs between towers")


def test_a_step_without_updates_and_a_checkpoint_of_another_model(capsys, tmp_path):
    """verify --step of an op that runs no moving-average update: passes, saying so; --checkpoint
    of a model whose variables have the same names but other shapes: exit 1 with the variable and
    both shapes."""
    from bnrewrite.cli import main

    graph = build_towers(Spec()).graph
    path = write_meta(tmp_path, graph)
    assert main(["verify", path, "--step", "apply_gradients"]) == 0  # the optimizer alone: reported, passes
    out = capsys.readouterr().out
    assert out.startswith("verified 2 layers x 2 towers on /device:CPU:0..1: worst ") and \
        "), 4 moving statistic(s) not updated: the script's step does not run their updates" in out, out
    other = build_towers(Spec(channels=2)).graph  # conv1/kernel of 2 input channels, not 3
    with other.as_default(), tf.compat.v1.Session(graph=other, config=session_config(2)) as sess:
        sess.run("init")
        prefix = tf.compat.v1.train.Saver().save(sess, str(tmp_path / "other.ckpt"))
    assert main(["verify", path, "--checkpoint", prefix]) == 1
    assert_one_error_line(subprocess.CompletedProcess([], 1, "", capsys.readouterr().err), 1,
                          r"--checkpoint .*other.ckpt: variable \S*conv1/\S+ is float32 of shape \[3, 3, 2, \d+\] there "
                          r"but float32 of shape \[3, 3, 3, \d+\] in the model; give the checkpoint this model's Saver wrote")
