"""Trainers as they were written (issue 26), against the one-device oracle.

* inception's multi-GPU trainer, whose train op runs one tower's batch-norm updates (the last,
  the first, a middle one) or runs none and leaves them to an op fetched beside it: rewritten,
  it trains like one device fed the K*B examples: losses and every variable (weights, moving
  statistics, zero-debias `biased`/`local_step`, RMSProp slots, ExponentialMovingAverage
  shadows); each moving statistic is updated once per step.
* independent towers (tf_cnn_benchmarks' independent variables): K models trained apart, so
  the rewrite refuses (NoTowersError) or leaves every tower's training as it was, saying why.
  (Replicated per-tower copies whose gradients are combined are tests/test_replicated.py's.)
* TF-Slim model_deploy clones on one CPU or on no device: synced with the local backend like
  one device; nccl and collective refuse with BackendError.

Every oracle case also trains the un-rewritten graph and requires it to miss (assert_synced).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from bnrewrite import rewrite_graph
from bnrewrite.errors import BackendError, NoTowersError
from models import (
    Result, Spec, assert_synced, build_reference, build_towers, make_batches, max_rel_error, rel_errors, train,
)
from trainers import PLACEMENTS, UPDATE_CHOICES, Trainer, blended, clones, independent, inception, run

STEPS, BATCH = 3, 2
TOLERANCE = 1e-4  # float32, per tensor (norm-wise relative), as the other oracle tests
#: Names of the variables a batch-norm update writes: the moving statistics and zero-debias state.
STATISTICS = ("moving_mean", "moving_variance", "biased", "local_step")


@functools.cache
def _data(k: int) -> list:
    """Each tower's slice scaled and shifted its own way (tests/models.py)."""
    return make_batches(Spec(towers=k, batch=BATCH, seed=1), STEPS)


@functools.cache
def _reference(builder: str, k: int, *args) -> Result:
    """One device fed all K*B examples, the same model (built once per parameter set)."""
    trainer = {"inception": inception, "clones": clones, "blended": blended}[builder](1, k * BATCH, *args)
    return run(trainer.graph, trainer, _data(k), 1)[0]


@functools.cache
def _two_clones(placement: str) -> Trainer:
    """Two fused clones, built once per placement: each backend refuses the same graph (read-only)."""
    return clones(2, BATCH, True, placement)


def _rewritten(trainer: Trainer, k: int, **options) -> tuple[Result, dict, object]:
    """Rewrite, back to a tf.Graph, handles mapped by result.find, train: (result, initial values, report)."""
    result = rewrite_graph(trainer.graph, **options)
    graph = result.to_graph()
    trained, initial = run(graph, trainer, _data(k), k, find=lambda names: result.find(graph, names))
    return trained, initial, result.report


def _assert_statistics_updated(synced: Result, initial: dict, expected: Result) -> None:
    """Every variable a batch-norm update writes moved from its initial value, and local_step
    counts exactly one update per step (a clearer message than the oracle's when they did not)."""
    stale = [name for name in synced.variables
             if name.rsplit("/", 1)[-1] in STATISTICS and np.array_equal(synced.variables[name], initial[name])]
    assert not stale, f"never updated, still at their initial values: {stale}"
    steps = {name: float(value) for name, value in synced.variables.items() if name.endswith("local_step")}
    assert all(value == STEPS == expected.variables[name] for name, value in steps.items()), steps


#: Every update choice on three towers (first, middle and last are three different towers), and
#: inception's own (the last tower's) on two.
INCEPTION = [(3, updates) for updates in UPDATE_CHOICES] + [(2, "last")]


@pytest.mark.parametrize("k, updates", INCEPTION, ids=[f"K{k}-{u}" for k, u in INCEPTION])
def test_inception_trainer_trains_like_one_device(k: int, updates: str):
    trainer = inception(k, BATCH, updates)
    expected = _reference("inception", k)
    synced, initial, report = _rewritten(trainer, k)
    unsynced = run(trainer.graph, trainer, _data(k), k)[0]
    print(report)
    _assert_statistics_updated(synced, initial, expected)
    assert_synced(f"inception K={k} {updates}", synced, unsynced, expected, TOLERANCE)


@pytest.mark.parametrize("updates", ["last", "middle", "separate"])
def test_blending_fused_op_with_one_towers_assigns_trains_like_one_device(updates: str):
    """exponential_avg_factor: the running statistics blended in the op and stored by assigns."""
    k = 3
    trainer = blended(k, BATCH, updates)
    expected = _reference("blended", k)
    synced, initial, report = _rewritten(trainer, k)
    unsynced = run(trainer.graph, trainer, _data(k), k)[0]
    stale = [n for n in synced.variables if "moving_" in n and np.array_equal(synced.variables[n], initial[n])]
    assert not stale, f"never updated: {stale}"
    assert_synced(f"blended K={k} {updates}", synced, unsynced, expected, TOLERANCE)


INDEPENDENT = [(2, True), (3, False)]


@pytest.mark.parametrize("k, fused", INDEPENDENT, ids=[f"K{k}-{'fused' if f else 'unfused'}" for k, f in INDEPENDENT])
def test_independent_towers_are_left_to_train_apart(k: int, fused: bool):
    """Either a refusal naming independent towers, or a graph that trains exactly as before and
    a report that says the towers are independent."""
    trainer = independent(k, BATCH, fused)
    before = run(trainer.graph, trainer, _data(k), k)[0]
    # The towers' data differ, so coupling their batch norms could not go unseen.
    means = [before.variables[f"v{i}/net/bn1/moving_mean"] for i in range(k)]
    assert max(np.max(np.abs(m - means[0])) for m in means[1:]) > 1e-2 * np.max(np.abs(means[0]))
    try:
        after, _, report = _rewritten(trainer, k)
    except NoTowersError as error:
        print("refused:", error)
        assert "independent" in str(error).lower(), str(error)
        return
    print(report)
    assert "independent" in str(report).lower(), str(report)
    error = max_rel_error(after, before)
    assert error <= 1e-6, {name: e for name, e in rel_errors(after, before).items() if e > 1e-6}


#: Every pair of tower count, layer form and placement, each once (the two placements are a
#: device named or none, which no layer form or tower count bears on).
CLONES = [(4, True, "none"), (4, False, "cpu0"), (2, True, "cpu0"), (2, False, "none")]


@pytest.mark.parametrize("k, fused, placement", CLONES,
                         ids=[f"K{k}-{'fused' if f else 'unfused'}-{p}" for k, f, p in CLONES])
def test_clones_on_one_device_train_like_one_device(k: int, fused: bool, placement: str):
    trainer = clones(k, BATCH, fused, placement)
    expected = _reference("clones", k, fused, placement)
    synced, initial, report = _rewritten(trainer, k)
    unsynced = run(trainer.graph, trainer, _data(k), k)[0]
    print(report)
    assert report.backend == "local" and report.tower_by == "scope"
    assert report.towers == [f"clone_{i}" for i in range(k)]
    assert len(report.layers) == 2 and not report.skipped
    assert any("share a device or name none" in note for note in report.notes), report.notes
    _assert_statistics_updated(synced, initial, expected)
    assert_synced(f"clones K={k} {'fused' if fused else 'unfused'} {placement}", synced, unsynced, expected,
                  TOLERANCE)


@pytest.mark.parametrize("backend", ["nccl", "collective"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_clones_on_one_device_refuse_per_device_backends(backend: str, placement: str):
    with pytest.raises(BackendError) as info:
        rewrite_graph(_two_clones(placement).graph, backend=backend)
    message = str(info.value)
    print(message)
    assert "device" in message and "\n" not in message.strip(), message


#: Every update form the matcher knows, with the train op grouping one tower's UPDATE_OPS only:
#: fused (layer and op, exponential_avg_factor), unfused (AssignSubVariableOp after moments),
#: batch renormalization, and each under a v1 and a v2 tf.cond.
FORMS = [
    Spec(towers=3, layer="legacy", updates_tower=-1),
    Spec(towers=3, layer="fused_op", updates_tower=1),
    Spec(towers=3, layer="legacy_unfused", updates_tower=-1),
    Spec(towers=3, layer="legacy_unfused", renorm=True, updates_tower=1),
    Spec(towers=3, layer="legacy_cond_v1", updates_tower=-1),
    Spec(towers=3, layer="legacy_cond_v1", renorm=True, updates_tower=-1),
    Spec(towers=2, layer="legacy_cond_v2", updates_tower=-1),
]


@pytest.mark.parametrize("spec", FORMS, ids=lambda s: f"{s.layer}{'-renorm' if s.renorm else ''}-tower{s.updates_tower}")
def test_train_op_with_one_towers_updates_trains_like_one_device(spec: Spec):
    """Whichever tower's updates the train op runs, the rewritten graph updates every moving
    statistic once per step, fed the global statistics."""
    built = build_towers(spec)
    result = rewrite_graph(built.graph)
    data = make_batches(spec, STEPS)
    ref = build_reference(spec)
    expected = train(ref.graph, ref, data, num_devices=1)
    synced = train(result.graph_def, built, data, num_devices=spec.towers)
    unsynced = train(built.graph, built, data, num_devices=spec.towers)
    assert_synced(f"{spec.layer} updates of tower {spec.updates_tower}", synced, unsynced, expected, TOLERANCE)
    moving = [name for name in synced.variables if "moving_" in name or "renorm_" in name]
    assert moving and all(rel_errors(synced, expected)[name] <= TOLERANCE for name in moving)


def test_inspect_shows_towers_on_one_device_and_refuses_independent_ones(tmp_path, capsys):
    """The command line says which towers share a device and why independent towers are refused."""
    from bnrewrite.cli import main

    shared, apart = tmp_path / "clones.pb", tmp_path / "independent.pb"
    shared.write_bytes(clones(2, BATCH, True, "cpu0").graph.as_graph_def().SerializeToString())
    apart.write_bytes(independent(2, BATCH, True).graph.as_graph_def().SerializeToString())
    assert main(["inspect", str(shared)]) == 0
    out = capsys.readouterr().out
    assert "towers (scope): clone_0, clone_1" in out and "share a device or name none (/device:CPU:0)" in out
    assert main(["inspect", str(apart)]) == NoTowersError.exit_code
    out = capsys.readouterr().out
    assert "train independent models" in out and "v0/" in out
