"""Keras models trained on several devices in graph mode, as people wrote it (issue 39), run
unmodified under `bnrewrite run`, train like one device fed the whole batch.

The oracle: tests/scripts/keras_towers.py under `bnrewrite run` (2 towers x 4 examples, 3 steps)
against the same script's one-device run (8 examples), judged by the noise floor: the effect of
scaling the one-device run's images by 1 + 1e-7. Every weight and moving statistic, and the
outputs of `predict`, `evaluate` and a `training=False` call in a new graph restoring the
checkpoint (`save_weights`/`load_weights` and a tf.compat.v1 Saver), must lie within a few floors
of the one-device run, where the towers as built (plain python) miss it by far more. In process:
the rule that only live work is a tower (the call that built a Keras model on its own Input is
no tower), and the cause a real mismatch is refused with.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from bnrewrite import TowerMismatchError, rewrite_graph
from bnrewrite.cli import main
from script_oracle import ROOT, judge, lines_by_case, run_both
import zygote

SCRIPT = os.path.join(ROOT, "tests", "scripts", "keras_towers.py")
SMALL = ("functional", "learning_phase", "cond_v1", "set_learning_phase", "update_ops", "sequential", "unfused",
         "unfused_any_batch", "renorm", "float16", "multi_gpu", "mirrored_fit", "mirrored_fit_unfused")
WORKFLOWS = ("multi_gpu_refit", "mirrored_shared")
#: Issue 49's hangs: towers on /gpu:i that soft placement runs on one CPU (batch norm under the
#: learning-phase cond v2), and the template model fitted on its own after the multi-tower fit.
HUNG = ("multi_gpu_soft", "learning_phase_soft", "multi_gpu_then_template")
#: The module's script cases, trained by one `bnrewrite run` and one reference process (one
#: TensorFlow import each), each case in a graph of its own; the tests judge their own.
CASES = (*SMALL, *WORKFLOWS, *HUNG, "mobilenet")
SHARED = pytest.mark.xdist_group("keras_towers_cases")
tf1 = tf.compat.v1


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[str, dict[str, list[str]]]:
    """Where CASES' runs are, and each case's `bnrewrite:` lines (none of them an error or a warning)."""
    directory = tmp_path_factory.mktemp("keras_towers")
    err = run_both(SCRIPT, directory, CASES)
    every = [line for line in err.splitlines() if line.startswith("bnrewrite:")]
    assert not any("error" in line or "warning" in line for line in every), every
    lines = lines_by_case(err)
    assert list(lines) == list(CASES), list(lines)
    return str(directory), lines


def _synced(lines: list[str], towers: str = "") -> list[str]:
    return [line for line in lines if f"2 batch-norm layer(s) synchronized across 2 towers ({towers}" in line]


@SHARED
def test_keras_tower_trainers_train_like_one_device(trained):
    directory, lines = trained
    for case in SMALL:
        print(judge(case, directory))
        assert len([line for line in _synced(lines[case]) if "CPU:1" in line]) == 1, (case, lines[case])
    assert any("moves to the synchronized graph with the values of its" in line for case in SMALL
               for line in lines[case]), lines


@SHARED
def test_keras_workflows_after_the_first_fit_train_like_one_device(trained):
    """compile, fit, compile again with a new optimizer, fit (it stopped with TensorFlow's "PruneForTargets:
    Some target nodes not found: training_3/group_deps": the second gradient of each learning-phase
    cond went unpaired, so the new train op read an update the rewrite had removed); and fit under
    MirroredStrategy of a model whose encoder each replica applies twice (refused before: "neither
    their names nor their structure tell")."""
    directory, lines = trained
    for case in WORKFLOWS:  # the shared encoder's statistics take two updates per step, in an order the program leaves open
        print(judge(case, directory, lambda key: case == "mirrored_shared" and key.startswith("bn1/moving_")))
    assert len(_synced(lines["multi_gpu_refit"])) == 2, lines  # the refit's graph twice (its second train op)
    [shared] = _synced(lines["mirrored_shared"])
    assert "bn1 (2: encoder_2/bn1, encoder_3/bn1; told apart by the order of their scopes' numbers)" in shared, lines


@SHARED
def test_mobilenet_v2_per_tower_trains_like_one_device(trained):
    directory, lines = trained
    print(judge("mobilenet", directory))
    assert any("52 batch-norm layer(s) synchronized across 2 towers" in line for line in lines["mobilenet"]), lines


def _keras_towers(trained: tuple[int, ...] = (0, 1), later: str = "", learning_phase: bool = False,
                  train_ops: int = 1) -> tf.Graph:
    """A tf_keras functional model built on its own Input, called per tower on /cpu:0 and /cpu:1;
    the gradients of the `trained` towers averaged (none: no gradients, the updates alone).
    `later`: a second train op, of the template's own call ("template") or of tower 0 ("tower_0");
    `learning_phase`: called as `model(x)`, its batch norm under Keras' learning-phase cond (v2);
    `train_ops`: that many train ops, each its own gradients of the same losses (a model compiled
    again)."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tf_keras as keras

    graph = tf.Graph()
    with graph.as_default():
        inputs = keras.Input((6, 6, 3))
        x = keras.layers.Conv2D(4, 3, use_bias=False, name="conv")(inputs)
        x = keras.layers.BatchNormalization(name="bn")(x, training=None if learning_phase else True)
        model = keras.Model(inputs, keras.layers.GlobalAveragePooling2D()(x))
        images = tf1.placeholder(tf.float32, [8, 6, 6, 3], name="images")
        losses, updates = [], []
        for i in range(2):
            with tf.device(f"/cpu:{i}"), tf1.name_scope(f"tower_{i}"):
                part = images[4 * i:4 * i + 4]
                losses.append(tf.reduce_mean(tf.square(model(part) if learning_phase else model(part, training=True))))
                updates += model.get_updates_for(part)
        for k in range(train_ops):
            optimizer = tf1.train.GradientDescentOptimizer(0.1 / (k + 1))
            grads = [optimizer.compute_gradients(losses[i], model.trainable_weights) for i in trained]
            step = list(updates)
            if grads:
                averaged = [(tf.add_n([g[j][0] for g in grads]) / len(grads), grads[0][j][1]) for j in range(len(grads[0]))]
                step.append(optimizer.apply_gradients(averaged))
            tf.group(*step, name="train_op")
        if later:
            out = model.output if later == "template" else losses[0]
            optimizer = tf1.train.GradientDescentOptimizer(0.1)
            tf.group(optimizer.minimize(tf.reduce_mean(tf.square(out)), var_list=model.trainable_weights),
                     *model.get_updates_for(model.input if later == "template" else images[:4]), name="later_op")
    return graph


def test_a_second_train_op_through_learning_phase_conds_is_synchronized():
    """Keras compiled again: each tower's learning-phase cond gets a second gradient cond; both are
    synchronized (the branch functions were left as they are before: "has 2 gradient conditionals")."""
    report = rewrite_graph(_keras_towers(learning_phase=True, train_ops=2).as_graph_def()).report
    assert not report.skipped, report.skipped
    assert [[site.split("/", 1)[0] for site in row.sites] for row in report.layers] == [["tower_0", "tower_1"]]
    assert len(report.layers[0].gradients) == 2 * 2  # two gradient computations in each of two towers


def test_the_call_that_built_a_keras_model_is_no_tower(tmp_path, capsys):
    graph_def = _keras_towers().as_graph_def()
    path = str(tmp_path / "towers.pb")
    with open(path, "wb") as f:
        f.write(graph_def.SerializeToString())
    assert main(["inspect", "-v", path]) == 0
    out = capsys.readouterr().out
    assert "batch-norm ops: 2 in training mode, 0 in inference mode, 1 that no training step runs" in out, out
    assert "bn/FusedBatchNormV3 (no training step runs it: not a tower)" in out, out
    report = rewrite_graph(graph_def).report
    assert report.towers == ["/device:CPU:0", "/device:CPU:1"]
    assert [[site.split("/", 1)[0] for site in row.sites] for row in report.layers] == [["tower_0", "tower_1"]]
    assert report.not_run == ["bn/FusedBatchNormV3"], report.not_run
    assert any("1 training batch-norm op(s) that no training step runs left as they are, not towers" in note
               for note in report.notes), report.notes
    assert report.to_dict()["not_run"] == report.not_run and not report.skipped


def test_a_template_fitted_on_its_own_is_no_tower():
    """Issue 49: the template's own train op (Keras' template.fit after the multi-tower fit) makes
    its construction call live, but that step runs no other tower: set aside, never the third
    member of an all-reduce (which waited forever in either step)."""
    report = rewrite_graph(_keras_towers(later="template").as_graph_def()).report
    assert report.towers == ["/device:CPU:0", "/device:CPU:1"] and report.not_run == ["bn/FusedBatchNormV3"]
    assert [[site.split("/", 1)[0] for site in row.sites] for row in report.layers] == [["tower_0", "tower_1"]]
    assert any("only training step later_op runs it, which runs no batch norm of the other towers" in note
               for note in report.notes), report.notes


def test_a_later_step_running_one_tower_of_an_all_reduce_runs_copies_of_it():
    """Issue 49, 2 i: refused before (its all-reduces would wait forever in it); it now runs copies of
    tower 0's forward pass, as python does (tests/test_partial_steps.py trains it)."""
    report = rewrite_graph(_keras_towers(later="tower_0").as_graph_def()).report
    assert [[site.split("/", 1)[0] for site in row.sites] for row in report.layers] == [["tower_0", "tower_1"]]
    assert list(report.copies) == ["later_op"] and not report.skipped
    assert "bnrewrite_alone/tower_0/model/bn/FusedBatchNormV3" in report.not_run, report.not_run


def test_without_gradients_every_training_batch_norm_counts():
    """No gradient, no evidence of what a step runs: nothing is set aside (under `bnrewrite run`
    such a graph runs as it is until gradients are added)."""
    report = rewrite_graph(_keras_towers(trained=()).as_graph_def()).report
    assert report.not_run == [] and "bn/FusedBatchNormV3" in report.layers[0].sites
    assert any("only their forward pass is synchronized" in note for note in report.notes)


def test_a_layer_trained_in_one_tower_only_is_refused_naming_the_towers():
    with pytest.raises(TowerMismatchError) as caught:  # tower 1 computes its loss, but no gradient of it
        rewrite_graph(_keras_towers(trained=(0,)).as_graph_def())
    message = str(caught.value)
    assert "tower /device:CPU:0" in message and "tower /device:CPU:1 (tower_1/" in message, message
    assert "trained in one tower and not in the other" in message and "check that every tower" not in message


def _checkpoint(prefix: str) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(prefix)
    values = {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
    return {name: value for name, value in values.items() if isinstance(value, np.ndarray) and value.dtype.kind == "f"}


#: Runs the script argv[1] once per later argument (its own argv, split at spaces) in one process
#: (one TensorFlow import), each run in a graph and a Keras session of its own.
_EACH = """import runpy, sys
import tf_keras
script, runs = sys.argv[1], sys.argv[2:]
for run in runs:
    tf_keras.backend.clear_session()
    sys.argv = [script, *run.split()]
    runpy.run_path(script, run_name="__main__")
"""


def test_the_keras_example_trains_like_one_device(tmp_path):
    """examples/keras_multi_gpu_train.py, 2 towers x 4 under `bnrewrite run`, against
    `--num_gpus 1 --batch_size 8` and the towers as built, side by side (those two in one process)."""
    example = os.path.join(ROOT, "examples", "keras_multi_gpu_train.py")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT}
    argv = {name: f"--num_gpus {k} --batch_size {8 // k} --weights {tmp_path / name / 'weights'}"
            for name, k in (("run", 2), ("one", 1), ("towers", 2))}
    runs = {name: zygote.spawn(command, cwd=str(tmp_path), env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
            for name, command in (("run", [sys.executable, "-m", "bnrewrite", "run", example, *argv["run"].split()]),
                                  ("references", [sys.executable, "-c", _EACH, example, argv["one"], argv["towers"]]))}
    for name, process in runs.items():
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, (name, err[-3000:])
        if name == "run":
            assert out.count("step ") == 3 and "2 batch-norm layer(s) synchronized across 2 towers" in err, err[-2000:]
        else:
            assert out.count("step ") == 2 * 3, out
    one = _checkpoint(str(tmp_path / "one" / "weights"))
    assert len(one) == 12  # kernels, dense bias, gamma, beta and both moving statistics of 2 layers

    def error(values: dict[str, np.ndarray]) -> float:
        return max(float(np.abs(values[k] - one[k]).max() / max(np.abs(one[k]).max(), 1e-3)) for k in one)

    synced, apart = error(_checkpoint(str(tmp_path / "run" / "weights"))), error(_checkpoint(str(tmp_path / "towers" / "weights")))
    print(f"keras example: {synced:.1e} from one device, towers as built {apart:.2f}")
    assert synced < 3e-5 and apart > 0.1


def test_verify_says_a_fit_step_through_a_callable_is_not_checked(capsys):
    """Keras' fit trains through a callable, to which --verify cannot add its fetches: it says so."""
    import bnrewrite

    sys.path.insert(0, os.path.dirname(SCRIPT))
    import keras_towers

    bnrewrite.enable(verify=True)
    try:
        with tf.Graph().as_default():  # graph mode, as the script's tf1.disable_eager_execution() gives it
            keras_towers._fit("mirrored_fit", 2, 4, *keras_towers._data("mirrored_fit", 24, 0.0))
    finally:
        bnrewrite.disable()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bnrewrite:")]
    assert any("nothing verified: its training step runs through a callable (make_callable, Keras' fit)" in line
               for line in lines), lines
    from bnrewrite.session import live

    synced = [r for r in live.records() if r["outcome"] == "synchronized"]
    assert synced and synced[-1]["verify"]["passed"] is None


@SHARED
def test_soft_placed_towers_and_a_later_template_fit_train_like_one_device(trained):
    """Each hung forever before (the collective backend with both members on one device; an
    all-reduce spanning the template's own call, which the template's step runs alone)."""
    directory, lines = trained
    for case in HUNG:
        print(judge(case, directory))
    soft = [_synced(lines[case], "/device:GPU:0, /device:GPU:1") for case in HUNG]
    assert [len(found) for found in soft] == [1, 1, 0] and all(
        "backend collective" in line and "all run on /device:CPU:0" in line and "meet on /device:CPU:0..1" in line
        for found in soft for line in found), lines
    assert [len(_synced(lines[case], "/device:CPU:0, /device:CPU:1")) for case in HUNG] == [0, 0, 1], lines


def _evaluate_around_fit(towers: int) -> tuple[float, float, np.ndarray]:
    """keras_towers' multi_gpu model on `towers` devices (1: the model itself, fed the whole batch):
    evaluate, fit, evaluate and predict again through the functions Keras made before fit."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import keras_towers
    import tf_keras as keras

    keras.backend.clear_session()
    with tf.Graph().as_default():  # graph mode, as the script's tf1.disable_eager_execution() gives it
        keras_towers._session(towers)
        images, targets = keras_towers._data("multi_gpu", 24, 0.0)
        model = keras_towers._model("multi_gpu")
        trained = keras_towers._multi_gpu(model, towers) if towers > 1 else model
        trained.compile(keras.optimizers.legacy.SGD(0.1), "mse")
        keras_towers._initial(model)
        before = trained.evaluate(images[:8], targets[:8], batch_size=8, verbose=0)
        trained.predict(images[:8], batch_size=8, verbose=0)
        trained.fit(images, targets, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return before, trained.evaluate(images[:8], targets[:8], batch_size=8, verbose=0), \
            trained.predict(images[:8], batch_size=8, verbose=0)


def test_keras_functions_made_before_fit_follow_the_session_to_the_synchronized_graph(capsys):
    """evaluate and predict before fit, then after it: their callables were made in the TensorFlow
    session that fit's move replaced, and failed there ("No such callable handle: 1", after
    running handle 0, fit's, with the wrong feeds); now they are made again in the new one."""
    import bnrewrite

    one, plain = _evaluate_around_fit(1), _evaluate_around_fit(2)
    with bnrewrite.enabled():
        synced = _evaluate_around_fit(2)
    assert "moves to the synchronized graph" in capsys.readouterr().err
    assert synced[0] == plain[0] == one[0]  # before fit: nothing trains yet, the graph runs as it is
    np.testing.assert_allclose(synced[1], one[1], rtol=1e-5)
    np.testing.assert_allclose(synced[2], one[2], rtol=1e-5, atol=1e-6)
    assert abs(plain[1] - one[1]) > 0.1 * one[1]  # the towers as built end elsewhere
