"""Towers that apply one batch-norm network several times (a GAN's discriminator on real and on
generated images, a Siamese net on both images of a pair): each application is synchronized
with its counterparts in the other towers, and keeps one moving-average update per statistic.

The oracle: tests/scripts/applied_twice.py (a GAN by tf.gradients and by a persistent
tf.GradientTape; a Siamese net with fused and with tf.nn.moments batch norm; two streams; 2
towers x 4 examples, 3 steps) under `bnrewrite run --verify` against its one-device run, judged
by the noise floor, where the towers as built miss it by far. The moving statistics of a
network applied twice take two updates per step in an order the program leaves open (the
synchronized run and one device may take different orders: 6 % apart on a small moving mean in
one CI run, where the floor was 2e-6), so the first step's check vouches for them instead: each
application's update is exactly one run toward its own global statistic. In process: the
applications are named and paired by names or by structure (and the data they read); when
those disagree or neither tells, the layer is refused, named; the step check still catches a
run too many.
"""

import os
import warnings

import numpy as np
import pytest
import tensorflow as tf

from bnrewrite import TowerMismatchError, UnsyncedLayerError, rewrite_graph
from bnrewrite.errors import PassError
from bnrewrite.rewrite import api
from bnrewrite.rewrite.passes import PIPELINE, dedupe_moving_averages, run_passes
from bnrewrite.session import stepcheck
from models import load_graph
from script_oracle import ROOT, judge, lines_by_case, run_both

SCRIPT = os.path.join(ROOT, "tests", "scripts", "applied_twice.py")
tf1 = tf.compat.v1


def _gan_towers(towers: int = 2, scopes=("on_real", "on_fake"), swap_in: int = -1, generator: bool = True,
                replicated: bool = False, inputs=("real", "noise")) -> tf.Graph:
    """A multi-GPU GAN trainer: in every tower (/cpu:k) a generator and a discriminator applied
    to real and to generated images, per-tower gradients averaged and applied once with every
    update. `scopes`: name scopes of the two applications ("{k}": the tower's index, names that
    pair nothing); `swap_in`: a tower that builds the generated images' application first;
    `generator=False`: the "generated" images are fed like the real ones (one structure), from
    placeholders named `inputs` ("{k}" likewise);
    `replicated`: every tower has its own copy of every variable (variable scope v<k>), each
    copy given the towers' mean gradient, as tf_cnn_benchmarks' replicated mode does."""
    from tf_keras.src.legacy_tf_layers import convolutional, core, normalization

    graph = tf.Graph()
    with graph.as_default(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = tf1.train.AdamOptimizer(1e-3)
        grads = []
        for k in range(towers):
            with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"), \
                    tf1.variable_scope(f"v{k}" if replicated else tf1.get_variable_scope()):
                real, noise = (tf1.placeholder(tf.float32, [2, 6, 6, 3], name=name.format(k)) for name in inputs)
                fake = noise
                if generator:
                    with tf1.variable_scope("generator", reuse=tf1.AUTO_REUSE):
                        fake = convolutional.conv2d(tf.nn.relu(normalization.batch_normalization(
                            convolutional.conv2d(noise, 4, 3, padding="same"), training=True)), 3, 1)
                logits = {}
                order = [("fake", fake), ("real", real)] if k == swap_in else [("real", real), ("fake", fake)]
                for which, x in order:
                    scope = scopes[0 if which == "real" else 1].format(k)
                    with tf.name_scope(scope), tf1.variable_scope("discriminator", reuse=tf1.AUTO_REUSE):
                        h = tf.nn.relu(normalization.batch_normalization(convolutional.conv2d(x, 4, 3), training=True))
                        logits[which] = core.dense(tf.reduce_mean(h, [1, 2]), 1)
                loss = tf.reduce_mean(tf.nn.softplus(-logits["real"])) + tf.reduce_mean(tf.nn.softplus(logits["fake"]))
                grads.append(opt.compute_gradients(loss, tf1.trainable_variables(f"v{k}/") if replicated else None))
        averaged = [(tf.add_n([g for g, _ in per_var]) / towers, per_var[0][1]) for per_var in zip(*grads)]
        if replicated:
            averaged = [(mean, v) for (mean, _), per_var in zip(averaged, zip(*grads)) for _, v in per_var]
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            opt.apply_gradients(averaged, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return graph


def _checked_step(result) -> stepcheck.Verdict:
    """One training step of the rewritten GAN with the step check's fetches, and its verdict."""
    graph = load_graph(result.graph_def)
    check = stepcheck.build(graph, result.graph_def, result.report, python_ops=True)
    rng = np.random.default_rng(0)
    feed = {f"tower_{k}/{name}:0": rng.standard_normal((2, 6, 6, 3)).astype(np.float32)
            for k in (0, 1) for name in ("real", "noise")}
    with tf1.Session(graph=graph, config=tf1.ConfigProto(device_count={"CPU": 2})) as session:
        session.run("init")
        before = session.run(check.before)
        values = session.run(["train_op", *check.step], {**feed, **check.feed(before)})[1:]
        after = session.run(check.after)
    return check.evaluate(before, values, after)


def test_each_application_is_a_layer_named_after_its_scope_keeping_one_update_per_statistic():
    report = rewrite_graph(_gan_towers()).report
    assert [row.layer for row in report.layers] == [
        "generator/batch_normalization", "on_real/discriminator/batch_normalization",
        "on_fake/discriminator/batch_normalization"]
    for row, scope in zip(report.layers[1:], ("on_real", "on_fake")):
        assert row.sites == [f"tower_{k}/{scope}/discriminator/batch_normalization/FusedBatchNormV3" for k in (0, 1)]
        assert row.lined_up_by == "shared variables"
        # one update of each statistic per application, as one device applying it twice runs
        assert sorted(u.variable for u in row.moving) == [
            "discriminator/batch_normalization/moving_mean", "discriminator/batch_normalization/moving_variance"]
        assert all(u.node.startswith(f"tower_0/{scope}/") for u in row.moving)
    removed = [r["node"] for r in report.removed if r["why"].startswith("duplicate update")]
    assert len(removed) == 3 * 2  # three layers, two statistics, tower 1's update of each
    assert not report.skipped


def test_the_step_check_passes_two_updates_of_a_statistic_one_per_application(monkeypatch):
    verdict = _checked_step(rewrite_graph(_gan_towers()))
    assert [v.layer for v in verdict.layers] == [
        "generator/batch_normalization", "on_real/discriminator/batch_normalization",
        "on_fake/discriminator/batch_normalization"]
    assert all(v.updates == ["moving_mean once toward the global mean (factor 0.01)",
                             "moving_variance once toward the global unbiased variance (factor 0.01)"]
               for v in verdict.layers), [v.updates for v in verdict.layers]
    # every tower's update kept (a broken dedupe): a run too many in each application, named
    monkeypatch.setattr(api, "run_passes", lambda graph, plan: run_passes(
        graph, plan, tuple(p for p in PIPELINE if p is not dedupe_moving_averages)))
    monkeypatch.setattr(api.meaning, "check_meaning", lambda *args: None)
    with pytest.raises(PassError, match=r"discriminator/batch_normalization/moving_mean is not what one run of its update "
                                        r"tower_0/on_real/\S+( and one of \S+)+ writes: off by"):
        _checked_step(rewrite_graph(_gan_towers(generator=False)))


def test_applications_of_replicated_variables_are_split_alike():
    """Each tower's own copy of the discriminator, applied twice: the copies pair by their
    variables' roles, then each tower's two applications split as with shared variables."""
    report = rewrite_graph(_gan_towers(replicated=True)).report
    assert [row.layer for row in report.layers] == [
        "generator/batch_normalization", "on_real/discriminator/batch_normalization",
        "on_fake/discriminator/batch_normalization"]
    assert [row.lined_up_by for row in report.layers] == ["variable roles"] * 3
    for row, scope in zip(report.layers[1:], ("on_real", "on_fake")):
        assert row.sites == [f"tower_{k}/v{k}/{scope}/discriminator/batch_normalization/FusedBatchNormV3" for k in (0, 1)]
        # every tower updates its own copies: one update per copy and application
        assert sorted(u.variable for u in row.moving) == sorted(
            f"v{k}/discriminator/batch_normalization/{statistic}" for k in (0, 1)
            for statistic in ("moving_mean", "moving_variance"))
    assert ("1 layer(s) applied several times in each tower, each application synchronized with its counterparts in "
            "the other towers: discriminator/batch_normalization (2: on_real/discriminator/batch_normalization, "
            "on_fake/discriminator/batch_normalization; told apart by names and structure)") in report.notes
    assert not report.skipped


def test_an_optimizers_own_updates_are_no_layers_statistics():
    """Adam applied under control_dependencies(UPDATE_OPS): its beta1_power/beta2_power reads
    wait on every moving-average update, and take no value from them. Counted as the layers'
    statistics before, they were the one variable replicated towers share, so every layer looked
    like one layer applied twice and the graph was refused."""
    graph = _gan_towers(replicated=True, generator=False, scopes=("d", "d"))
    report = rewrite_graph(graph).report
    assert [row.layer for row in report.layers] == ["d/discriminator/batch_normalization",
                                                    "d_1/discriminator/batch_normalization"]
    assert all("beta" not in u.variable for row in report.layers for u in row.moving)


def test_applications_whose_names_pair_nothing_are_paired_by_structure():
    """Scopes named after the tower (r0/f0, r1/f1): what the discriminator reads tells them apart."""
    report = rewrite_graph(_gan_towers(scopes=("r{}", "f{}"))).report
    rows = {tuple(row.sites): row.layer for row in report.layers}
    for scope in ("r", "f"):
        sites = tuple(f"tower_{k}/{scope}{k}/discriminator/batch_normalization/FusedBatchNormV3" for k in (0, 1))
        assert sites in rows
    assert not report.skipped and len(report.layers) == 3


def test_applications_that_names_and_structure_pair_differently_are_refused_named():
    """Tower 1 builds the generated images' application first, in scopes that TensorFlow
    uniquifies in creation order: its names pair real with generated, its structure does not."""
    graph = _gan_towers(scopes=("d", "d"), swap_in=1)
    with pytest.raises(UnsyncedLayerError, match="applied 2 times in each tower .* its names and its structure pair "
                                                 "them differently; left unsynced") as refused:
        rewrite_graph(graph)
    assert "\n" not in str(refused.value)
    partial = rewrite_graph(graph, allow_unsynced=True)
    assert [row.layer for row in partial.report.layers] == ["generator/batch_normalization"]
    assert len(partial.report.skipped) == 4


def test_applications_built_in_another_order_are_told_by_their_data():
    """Both applications read placeholders alike; one tower builds them in the other order, so
    TensorFlow's uniquified names pair its first image with the other tower's second: the
    placeholders the data comes from disagree, and the layer is refused, not mixed up."""
    graph = _gan_towers(scopes=("d", "d"), swap_in=1, generator=False)
    with pytest.raises(TowerMismatchError, match="its names and its structure pair them differently"):
        rewrite_graph(graph)
    rows = rewrite_graph(_gan_towers(scopes=("r{}", "f{}"), swap_in=1, generator=False)).report.layers
    assert [row.sites for row in rows] == [  # names pair nothing here: the data alone does, right
        [f"tower_{k}/{scope}{k}/discriminator/batch_normalization/FusedBatchNormV3" for k in (0, 1)] for scope in "rf"]


def test_applications_that_nothing_tells_apart_are_refused_named():
    """Inputs alike from placeholders named after the tower, scopes likewise: no guess."""
    graph = _gan_towers(scopes=("r{}", "f{}"), generator=False, inputs=("x{}", "z{}"))
    with pytest.raises(TowerMismatchError, match="neither their names, their structure nor their scopes' numbering "
                                                 "tell which goes with which"):
        rewrite_graph(graph)


#: The script's cases of networks applied twice, and of steps keeping one application's statistics.
TWICE = ("gan", "gan_tape", "siamese", "siamese_moments", "two_stream")
KEEPING_ONE = ("gan_real", "siamese_second")
SHARED = pytest.mark.xdist_group("applied_twice_cases")


@pytest.fixture(scope="module")
def applied(tmp_path_factory) -> tuple[str, dict[str, list[str]]]:
    """Where the script's cases ran (one `bnrewrite run --verify -v` and one reference process, one
    TensorFlow import each, each case in a graph of its own), and each case's `bnrewrite:` lines."""
    directory = tmp_path_factory.mktemp("applied_twice")
    err = run_both(SCRIPT, directory, (*TWICE, *KEEPING_ONE), ("--verify", "-v"))
    lines = lines_by_case(err)
    assert list(lines) == [*TWICE, *KEEPING_ONE], list(lines)
    every = [line for line in err.splitlines() if line.startswith("bnrewrite:")]
    assert sum(map(len, lines.values())) == len(every), every  # each line is some case's
    return str(directory), lines


@SHARED
def test_towers_applying_networks_twice_train_like_one_device(applied):
    directory, by_case = applied
    for case in TWICE:  # the statistics of a net applied twice: two updates per step, in either order (the check's)
        print(judge(case, directory, lambda key: "/moving_" in key and key.startswith(("D/", "E/"))))
    lines = [line for case in TWICE for line in by_case[case]]
    synced = [line for line in lines if " synchronized across 2 towers" in line]
    counts = [line.split(" batch-norm layer(s) synchronized across 2 towers")[0].rsplit(" ", 1)[-1] for line in synced]
    assert counts == ["6", "6", "4", "4", "4"], lines
    # the first step checked: every application moved its statistics once (the GAN's first step,
    # the discriminator's, runs none of the generator's updates)
    verified = [line for line in lines if ": verified " in line]
    assert [line.split(": verified ")[1].split(" x ")[0] for line in verified] == ["6 layers"] * 2 + ["4 layers"] * 3, lines
    assert all("4 moving statistic(s) not updated" in line for line in verified[:2]), lines
    assert not any("error" in line for line in lines), lines


@SHARED
def test_towers_keeping_one_applications_statistics_train_like_one_device_and_pass_the_check(applied):
    """A GAN whose discriminator step keeps the statistics of its application to real images only,
    a Siamese net keeping its second application's: `--verify` passes them (it stopped them
    before, "changed in a step that runs none of its kept updates"), each statistic checked as
    exactly one run of the update the step keeps; with one update per step the statistics are
    not left to an order, so every quantity is judged."""
    directory, by_case = applied
    for case in KEEPING_ONE:
        print(judge(case, directory))
    lines = [line for case in KEEPING_ONE for line in by_case[case]]
    verified = [line for line in lines if ": verified " in line]
    assert [line.split(": verified ")[1].split(" x ")[0] for line in verified] == ["6 layers", "4 layers"], lines
    others = [line for line in lines if "updated by another application only" in line]
    assert [line.split(":   ")[1].split(":")[0] for line in others] == ["D_1/d1_bn", "D_1/d2_bn", "E/e1_bn", "E/e2_bn"], lines
    assert all("(tower_0/D/" in line for line in others[:2]) and all("(tower_0/E_1/" in line for line in others[2:]), lines
    assert "4 moving statistic(s) not updated" in verified[0] and "not updated" not in verified[1], lines
    assert not any("error" in line for line in lines), lines


def _numbered_towers(taken: int = 2) -> tf.Graph:
    """Towers as MirroredStrategy names them: replica 0 unscoped on /cpu:0, where `taken` scopes
    `enc` exist already (the calls that built the model), replica 1 under `replica_1/` on /cpu:1;
    in each an encoder (shared variables) applied to two inputs read from placeholders named
    after the replica, so neither names nor structure pair the applications."""
    from tf_keras.src.legacy_tf_layers import convolutional, normalization

    graph = tf.Graph()
    with graph.as_default(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(taken):
            with tf.name_scope("enc"):
                tf.constant(0.0)
        opt = tf1.train.GradientDescentOptimizer(0.1)
        grads = []
        for k in range(2):
            with tf.device(f"/cpu:{k}"), tf1.name_scope("replica_1" if k else None):
                outs = []
                for which in ("a", "b"):
                    x = tf1.placeholder(tf.float32, [2, 6, 6, 3], name=f"{which}{k}")
                    with tf1.variable_scope("enc", reuse=tf1.AUTO_REUSE):
                        outs.append(normalization.batch_normalization(convolutional.conv2d(x, 4, 3), training=True))
                grads.append(opt.compute_gradients(tf.reduce_mean(tf.square(outs[0] - 2 * outs[1]))))
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            opt.apply_gradients([(tf.add_n([g for g, _ in pv]) / 2, pv[0][1]) for pv in zip(*grads)], name="train_op")
    return graph


def test_applications_that_only_their_scopes_numbering_tells_are_paired_by_it():
    """Replica 0's applications are enc_2, enc_3 where replica 1's are enc, enc_1: TensorFlow numbers
    a scope in the order the code enters it, the same in every tower, so k-th goes with k-th."""
    report = rewrite_graph(_numbered_towers()).report
    assert [row.sites for row in report.layers] == [
        ["enc_2/batch_normalization/FusedBatchNormV3", "replica_1/enc/batch_normalization/FusedBatchNormV3"],
        ["enc_3/batch_normalization/FusedBatchNormV3", "replica_1/enc_1/batch_normalization/FusedBatchNormV3"]]
    assert any("told apart by the order of their scopes' numbers" in note for note in report.notes), report.notes
    assert not report.skipped
