"""Between-graph replication: 2 worker processes x 2 towers, synced over TF's gRPC collectives.

2 workers x 2 towers x B examples, each worker's graph rewritten with
rewrite_graph(num_workers=2, task_index=i, backend="collective"), must train like one
device with 4*B examples; without the rewrite (but with the same cross-worker gradient
averaging) it must not. A missing worker must make the other fail within a bounded time.

Every test starts its own worker processes on loopback ports it picked
(examples/multi_worker.launch), bounds every wait and kills what is left.
"""

import multiprocessing
import time

import pytest

import multi_worker as mw
from models import Spec, build_reference, make_batches, max_rel_error, rel_errors, train

SPEC = Spec(towers=4, batch=4)  # the global job: 2 workers x 2 towers x 4 examples
STEPS = 5
TOLERANCE = 2e-4  # measured: ~8e-7


@pytest.fixture(scope="module")
def runs():
    run = mw.launch(SPEC, STEPS, mw.MODES, num_workers=2, timeout_seconds=20.0, join_timeout=20.0,
                    run_timeout=40.0, deadline=120.0)
    assert not multiprocessing.active_children()
    ref = build_reference(SPEC)
    return run, train(ref.graph, ref, make_batches(SPEC, STEPS), num_devices=1)


def test_synced_workers_match_one_device(runs):
    run, reference = runs
    worker0 = mw.as_result(run.results, "synced")
    worker1 = mw.as_result({0: run.results[1]}, "synced")
    errors = rel_errors(worker0, reference)
    assert any("moving_variance" in name for name in errors) and any("moving_mean" in name for name in errors)
    assert max(errors.values()) < TOLERANCE, errors
    # every worker applies the same update to its own copy of the variables
    assert max_rel_error(worker1, worker0) < 1e-6


def test_unsynced_workers_do_not_match(runs):
    run, reference = runs
    for task in (0, 1):
        got = mw.as_result({0: run.results[task]}, "unsynced")
        assert max_rel_error(got, reference) > 0.1


@pytest.mark.parametrize("layer", ["legacy_cond_v2", "moments_cond_v2"])
def test_workers_with_batch_norm_under_v2_cond(layer):
    """The all-reduces live in branch functions (forward) and their gradient functions
    (backward), with keys that must agree across the two workers' graphs."""
    spec = Spec(towers=4, batch=4, layer=layer)
    run = mw.launch(spec, STEPS, mw.MODES, num_workers=2, timeout_seconds=20.0, join_timeout=20.0,
                    run_timeout=40.0, deadline=120.0)
    ref = build_reference(spec)
    reference = train(ref.graph, ref, make_batches(spec, STEPS), num_devices=1)
    synced, unsynced = mw.as_result(run.results, "synced"), mw.as_result({0: run.results[0]}, "unsynced")
    assert max_rel_error(unsynced, reference) > 0.1
    assert max_rel_error(synced, reference) < TOLERANCE, rel_errors(synced, reference)
    assert max_rel_error(mw.as_result({0: run.results[1]}, "synced"), synced) < 1e-6


@pytest.mark.parametrize(
    "task, says",
    [(0, "timed out"), (1, "leader")],
    ids=["lone leader: its collectives time out", "lone follower: gives up waiting for the group leader"],
)
def test_lone_worker_fails_with_deadline_exceeded(task, says):
    """Only one worker starts: it fails with DeadlineExceeded within the bound, never hangs."""
    start = time.monotonic()
    with pytest.raises(mw.WorkerError) as info:
        mw.launch(SPEC, 2, ("synced",), num_workers=2, tasks=[task], timeout_seconds=3.0, join_timeout=3.0,
                  run_timeout=20.0, deadline=60.0)
    elapsed = time.monotonic() - start
    assert not multiprocessing.active_children()
    name, message, _ = info.value.errors[task]
    assert name == "DeadlineExceededError" and says in message, info.value
    assert elapsed < 60.0


def test_worker_dying_mid_run_fails_the_other():
    """Both workers start; worker 1 dies after 2 steps: worker 0 fails at once, it does not hang."""
    start = time.monotonic()
    with pytest.raises(mw.WorkerError) as info:
        mw.launch(SPEC, 50, ("synced",), num_workers=2, timeout_seconds=10.0, join_timeout=10.0,
                  run_timeout=20.0, deadline=60.0, crash_after={1: 2})
    elapsed = time.monotonic() - start
    assert not multiprocessing.active_children()
    errors = info.value.errors
    assert errors[1][0] == "ProcessDied", info.value
    assert errors[0][0] in ("UnavailableError", "DeadlineExceededError") and "[node " in errors[0][1], info.value
    assert elapsed < 60.0


def _ps_towers_graph():
    """2 towers on worker 0's CPUs with legacy tf.layers batch norm, every variable on /job:ps
    (tf.compat.v1.train.replica_device_setter), averaged gradients: a parameter-server worker."""
    import tensorflow as tf
    from tf_keras.src.legacy_tf_layers import normalization

    tf1 = tf.compat.v1
    graph = tf.Graph()
    cluster = tf.train.ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})
    with graph.as_default():
        optimizer, grads = tf1.train.GradientDescentOptimizer(0.1), []
        for k in range(2):
            worker = f"/job:worker/replica:0/task:0/device:CPU:{k}"
            with tf1.device(tf1.train.replica_device_setter(worker_device=worker, cluster=cluster)), \
                    tf1.variable_scope("net", reuse=k > 0), tf1.name_scope(f"tower_{k}"):
                x = tf1.placeholder(tf.float32, [2, 4, 4, 3])
                kernel = tf1.get_variable("kernel", [3, 3, 3, 4])
                y = normalization.batch_normalization(tf.nn.conv2d(x, kernel, 1, "VALID"), training=True)
                grads.append(optimizer.compute_gradients(tf.reduce_mean(tf.square(y))))
        averaged = [(tf.add_n([g[j][0] for g in grads]) / 2, grads[0][j][1]) for j in range(len(grads[0]))]
        optimizer.apply_gradients(averaged, name="train_op")
    return graph


def test_a_parameter_server_worker_is_refused_across_workers_and_synchronized_within_one():
    from bnrewrite import BackendError, rewrite_graph

    graph = _ps_towers_graph()
    with pytest.raises(BackendError, match=r"worker 1's graph places .* on /job:ps/task:0.* a parameter-server "
                                           r"cluster cannot be synchronized across workers") as caught:
        rewrite_graph(graph.as_graph_def(), backend="collective", num_workers=2, task_index=1)
    assert caught.value.exit_code == 9 and "Cleanup <step id>" in str(caught.value)
    report = rewrite_graph(graph.as_graph_def()).report  # within the worker: its towers' local sum
    assert report.backend == "local" and len(report.layers) == 1
