"""The replica rule (bnrewrite/match/replicas.py), both ways, against the one-device oracle.

Towers with their own copies of the variables (tests/trainers.py's coupled(), plain SGD) train
one model when the copies are combined per variable: gradients averaged, one shared copy, or
every copy assigned the mean of the copies after each tower's own step (parameter averaging,
in the train op or in an op run after it). Rewritten, those train like one device fed the K*B
examples, and the graph as built does not. Towers coupled only through a scalar (a global norm
clipping every tower's gradients, a learning rate decayed by a shared global_step, the logged
loss sum their updates wait on) are K models: refused (NoTowersError). Towers averaging in
pairs are two models: refused as one sync group, synchronized pair by pair with group_size=2.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from bnrewrite import rewrite_graph
from bnrewrite.errors import NoTowersError
from models import Result, Spec, assert_synced, make_batches
from trainers import APART, REPLICAS, Trainer, coupled, run

K, BATCH, STEPS = 2, 2, 2
TOLERANCE = 1e-4


@functools.cache
def _data(k: int) -> list:
    return make_batches(Spec(towers=k, batch=BATCH, seed=1), STEPS)


def _copies(reference: Result, towers: range) -> dict:
    """The one-device variables as each of `towers` holds its copy (v<k>/ for the reference's v0/)."""
    return {name.replace("v0/", f"v{k}/", 1): value for name, value in reference.variables.items() for k in towers}


def _rewritten(trainer: Trainer, k: int, **options) -> Result:
    result = rewrite_graph(trainer.graph, **options)
    graph = result.to_graph()
    return run(graph, trainer, _data(k), k, find=lambda names: result.find(graph, names))[0]


@pytest.mark.parametrize("coupling", REPLICAS)
def test_copies_combined_per_variable_train_like_one_device(coupling: str):
    trainer = coupled(K, BATCH, coupling)
    reference = coupled(1, K * BATCH, coupling)
    expected = run(reference.graph, reference, _data(K), 1)[0]
    expected = Result(expected.losses, _copies(expected, range(1 if coupling == "shared" else K)))
    assert set(expected.variables) == set(trainer.variables)
    unsynced = run(trainer.graph, trainer, _data(K), K)[0]
    assert_synced(f"{coupling} K={K}", _rewritten(trainer, K), unsynced, expected, TOLERANCE)


@pytest.mark.parametrize("coupling", APART)
def test_towers_coupled_only_by_a_scalar_are_refused(coupling: str):
    with pytest.raises(NoTowersError, match="train independent models"):
        rewrite_graph(coupled(K, BATCH, coupling).graph.as_graph_def())  # shapes inferred, none recorded


def test_trainer_all_reduce_combines_the_copies():
    """tf_cnn_benchmarks' replicated variables: gradients summed by NcclAllReduce, whose peers
    meet by key, not by edges (built only: NCCL needs GPUs)."""
    report = rewrite_graph(coupled(K, BATCH, "nccl").graph).report
    assert len(report.layers) == 2 and report.layout == "replicated variables: one copy per tower"


def test_towers_averaging_in_pairs_are_two_models():
    """Refused as one sync group (naming the two models); with group_size=2 each pair trains
    like one device fed its pair's examples."""
    k = 4
    trainer = coupled(k, BATCH, "mean_pairs")
    with pytest.raises(NoTowersError, match=r"2 separate models \(.*CPU:0, .*CPU:1; .*CPU:2, .*CPU:3\)"):
        rewrite_graph(trainer.graph)
    reference = coupled(1, 2 * BATCH, "mean_grads")
    size = 2 * BATCH  # pair p: towers 2p and 2p+1, examples [p*size, (p+1)*size) of each step
    pairs = [run(reference.graph, reference, [(x[p * size:(p + 1) * size], y[p * size:(p + 1) * size])
                                              for x, y in _data(k)], 1)[0] for p in (0, 1)]
    expected = Result(np.mean([r.losses for r in pairs], axis=0),
                      {**_copies(pairs[0], range(0, 2)), **_copies(pairs[1], range(2, 4))})
    expected.variables["global_step"] = pairs[0].variables["global_step"]
    unsynced = run(trainer.graph, trainer, _data(k), k)[0]
    assert_synced("mean_pairs K=4 group_size=2", _rewritten(trainer, k, group_size=2), unsynced, expected, TOLERANCE)

