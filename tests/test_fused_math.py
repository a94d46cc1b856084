"""The synced fused batch norm's numbers on their own: dx, the batch statistics, and their stability.

Each graph has K towers of one `tf.compat.v1.nn.fused_batch_norm(is_training=True)`; the
reference is the same op on one device fed the concatenated batch, or float64 numpy.
"""

import numpy as np
import pytest
import tensorflow as tf

from bnrewrite import rewrite_graph
from models import kernel_gradients, kernel_moments, session_config, use_passes

tf1 = tf.compat.v1
C = 5


def _batch_norm(op: str, x, scale, offset, running_mean, running_var, data_format: str, avg_factor: float):
    """(y, batch mean, batch variance) of one training-mode fused batch norm op."""
    if op == "FusedBatchNormV3":
        return tf1.nn.fused_batch_norm(
            x, scale, offset, mean=running_mean, variance=running_var, is_training=True,
            data_format=data_format, exponential_avg_factor=avg_factor, epsilon=1e-3)
    empty = tf.constant([], tf.float32)  # the older ops take no running statistics in training
    outputs = getattr(tf.raw_ops, op)(
        x=x, scale=scale.read_value(), offset=offset.read_value(), mean=empty, variance=empty,
        epsilon=1e-3, data_format=data_format, is_training=True)
    return outputs[:3]


def _towers(k: int, shape: tuple, data_format: str = "NHWC", avg_factor: float = 1.0, dtype=tf.float32,
            op: str = "FusedBatchNormV3", batches: tuple[int, ...] = ()):
    """K towers: x_k -> a fused batch norm (training) -> loss_k = sum(y * r_k); dx by tf.gradients.
    `batches`: each tower's static batch size instead of shape[0]."""
    graph = tf.Graph()
    rng = np.random.default_rng(1)
    with graph.as_default():
        with tf.device("/cpu:0"):
            scale = tf1.get_variable("scale", initializer=rng.uniform(0.5, 1.5, C).astype(np.float32))
            offset = tf1.get_variable("offset", initializer=rng.normal(size=C).astype(np.float32))
            running_mean = tf1.get_variable("running_mean", initializer=np.zeros(C, np.float32))
            running_var = tf1.get_variable("running_var", initializer=np.ones(C, np.float32))
        for i in range(k):
            with tf.device(f"/cpu:{i}"), tf.name_scope(f"tower_{i}"):
                own = (batches[i], *shape[1:]) if batches else shape
                x = tf1.placeholder(dtype, own, name="x")
                r = tf1.placeholder(dtype, own, name="r")
                y, mean, var = _batch_norm(op, x, scale, offset, running_mean, running_var, data_format, avg_factor)
                tf.identity(mean, name="batch_mean")
                tf.identity(var, name="batch_variance")
                loss = tf.reduce_sum(tf.cast(y * r, tf.float32), name="loss")
                dx, dscale, doffset = tf.gradients(loss, [x, scale, offset])
                tf.identity(dx, name="dx")
                tf.identity(dscale, name="dscale")
                tf.identity(doffset, name="doffset")
        tf1.variables_initializer(tf1.global_variables(), name="init")
    return graph


def _run(graph_or_def, k: int, feeds: dict, fetches: list):
    graph = graph_or_def if isinstance(graph_or_def, tf.Graph) else tf.Graph()
    if not isinstance(graph_or_def, tf.Graph):
        with graph.as_default():
            tf1.import_graph_def(graph_or_def, name="")
    with tf1.Session(graph=graph, config=session_config(k)) as sess:
        sess.run("init")
        return sess.run(fetches, feeds)


def _split_feeds(k: int, x: np.ndarray, r: np.ndarray, axis: int = 0, batches: tuple[int, ...] = ()) -> dict:
    cuts = np.cumsum(batches)[:-1] if batches else k
    xs, rs = np.split(x, cuts, axis), np.split(r, cuts, axis)
    feeds = {f"tower_{i}/x:0": xs[i] for i in range(k)}
    feeds.update({f"tower_{i}/r:0": rs[i] for i in range(k)})
    return feeds


@pytest.fixture(params=["passes", "kernels"])
def path(request, monkeypatch):
    """The fused kernels (channels last), or the elementwise passes, forward and backward."""
    if request.param == "passes":
        use_passes(monkeypatch)
    return request.param


@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
@pytest.mark.parametrize("k", [2, 4])
def test_dx_matches_reference_gradients(k, data_format, path):
    """dx of every tower equals tf.gradients of the one-device graph at that tower's slice
    (the kernel path takes channels-last data only)."""
    b = 3
    shape = (b, 4, 4, C) if data_format == "NHWC" else (b, C, 4, 4)
    rng = np.random.default_rng(7)
    x = (rng.normal(size=(k * b, *shape[1:])) * rng.uniform(1, 3) + np.repeat(np.arange(k), b)[:, None, None, None]).astype(np.float32)
    r = rng.normal(size=x.shape).astype(np.float32)
    reference = _towers(1, (k * b, *shape[1:]), data_format)
    want_dx, want_dscale, want_doffset = _run(reference, 1, {"tower_0/x:0": x, "tower_0/r:0": r}, ["tower_0/dx:0", "tower_0/dscale:0", "tower_0/doffset:0"])

    graph = _towers(k, shape, data_format)
    fetches = [f"tower_{i}/{n}:0" for i in range(k) for n in ("dx", "dscale", "doffset")]
    result = rewrite_graph(graph, backend="collective")
    kernels = k if path == "kernels" and data_format == "NHWC" else 0
    assert len(kernel_gradients(result.graph_def)) == len(kernel_moments(result.graph_def)) == kernels
    got = _run(result.graph_def, k, _split_feeds(k, x, r), fetches)
    unsynced = _run(graph, k, _split_feeds(k, x, r), fetches)

    def dx_error(values):
        dx = np.concatenate(values[0::3], axis=0)
        return np.max(np.abs(dx - want_dx)) / np.max(np.abs(want_dx))

    # d(scale) and d(offset) stay per tower; their sum over towers is the one-device gradient.
    dscale = np.sum(got[1::3], axis=0)
    doffset = np.sum(got[2::3], axis=0)
    print(f"K={k} {data_format}: dx error {dx_error(got):.2e} (unsynced {dx_error(unsynced):.2e})")
    assert dx_error(unsynced) > 1e-2
    assert dx_error(got) < 1e-5
    np.testing.assert_allclose(dscale, want_dscale, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(doffset, want_doffset, rtol=1e-4, atol=1e-4)


def _global_stats(x: np.ndarray, axes: tuple) -> tuple[np.ndarray, np.ndarray]:
    x64 = x.astype(np.float64)
    n = x64.size / x64.shape[3 if axes == (0, 1, 2) else 1]
    return x64.mean(axis=axes), x64.var(axis=axes) * n / (n - 1)


@pytest.mark.parametrize("centre, tolerance", [(100.0, 1e-5), (1000.0, 3e-5)])
def test_batch_statistics_are_stable_far_from_zero(centre, tolerance, path):
    """|mean|/std = 100 and 1000: the synced batch mean and variance stay within 1e-5 (3e-5) of
    float64.

    The same data combined as E[x^2] - E[x]^2 in float32 misses by far more, so the test
    would catch a naive combine. At 1000 the variance misses by 1.1e-5 (TensorFlow's one-device
    op: 7.8e-7): each tower's mean travels as float32, and its rounding d_i enters the combine
    as 2 n_i d_i (m_i - mean), 128 examples per tower here.
    """
    k, b = 4, 2
    shape = (b, 8, 8, C)
    rng = np.random.default_rng(3)
    x = (centre + rng.normal(size=(k * b, *shape[1:]))).astype(np.float32)
    r = np.zeros_like(x)
    graph = _towers(k, shape)
    result = rewrite_graph(graph, backend="collective")
    assert len(kernel_moments(result.graph_def)) == (k if path == "kernels" else 0)
    fetches = [f"tower_{i}/batch_{s}:0" for i in range(k) for s in ("mean", "variance")]
    got = _run(result.graph_def, k, _split_feeds(k, x, r), fetches)
    want_mean, want_var = _global_stats(x, (0, 1, 2))
    mean_error = max(np.max(np.abs(got[2 * i] - want_mean) / want_mean) for i in range(k))
    var_error = max(np.max(np.abs(got[2 * i + 1] - want_var) / want_var) for i in range(k))
    print(f"|mean|/std={centre:g} {path}: mean error {mean_error:.2e}, variance error {var_error:.2e}")
    assert mean_error < tolerance and var_error < tolerance
    x32 = x.reshape(-1, C)
    naive = (np.mean(x32 * x32, axis=0, dtype=np.float32) - np.mean(x32, axis=0, dtype=np.float32) ** 2) * (x32.shape[0] / (x32.shape[0] - 1))
    assert np.max(np.abs(naive - want_var) / want_var) > 1e-5


def test_exponential_avg_factor_blends_running_statistics(path):
    """FusedBatchNormV3's exponential_avg_factor f: outputs are (1-f)*running + f*global."""
    k, b, f = 2, 3, 0.25
    shape = (b, 4, 4, C)
    rng = np.random.default_rng(5)
    x = (rng.normal(size=(k * b, *shape[1:])) * 2 + 1).astype(np.float32)
    graph = _towers(k, shape, avg_factor=f)
    result = rewrite_graph(graph, backend="collective")
    assert len(kernel_moments(result.graph_def)) == (k if path == "kernels" else 0)
    # Every tower's all-reduce must run in the step: fetch both towers' statistics.
    fetches = [f"tower_{i}/batch_{s}:0" for s in ("mean", "variance") for i in range(k)]
    got = _run(result.graph_def, k, _split_feeds(k, x, np.zeros_like(x)), fetches)[1::2]
    want_mean, want_var = _global_stats(x, (0, 1, 2))
    np.testing.assert_allclose(got[0], f * want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], (1 - f) + f * want_var, rtol=1e-5)


def _dx_float64(x: np.ndarray, dy: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    """Batch norm's dx over the whole batch (NHWC), in float64."""
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    axes = (0, 1, 2)
    rstd = 1.0 / np.sqrt(x64.var(axis=axes) + eps)
    x_hat = (x64 - x64.mean(axis=axes)) * rstd
    return scale * rstd * (dy64 - dy64.mean(axis=axes) - x_hat * (dy64 * x_hat).mean(axis=axes))


def test_dx_is_stable_far_from_zero(path):
    """|mean|/std = 1000: dx stays within 5e-6 of float64, closer than TensorFlow's own
    one-device gradient (~2e-5 here).

    The backward all-reduce carries sums of dy * (x - mean) with x centred on the global mean
    first; summing dy * x and subtracting mean * sum(dy) instead misses by ~1e-5.
    """
    k, b = 4, 2
    shape = (b, 8, 8, C)
    rng = np.random.default_rng(11)
    x = (1000.0 + rng.normal(size=(k * b, *shape[1:]))).astype(np.float32)
    r = rng.normal(size=x.shape).astype(np.float32)
    graph = _towers(k, shape)
    scale = _run(graph, k, {}, ["scale/Read/ReadVariableOp:0"])[0].astype(np.float64)
    want = _dx_float64(x, r, scale, 1e-3)
    result = rewrite_graph(graph, backend="collective")
    assert len(kernel_gradients(result.graph_def)) == len(kernel_moments(result.graph_def)) == (k if path == "kernels" else 0)
    got = np.concatenate(_run(result.graph_def, k, _split_feeds(k, x, r), [f"tower_{i}/dx:0" for i in range(k)]), axis=0)
    one_device = _run(_towers(1, (k * b, *shape[1:])), 1, {"tower_0/x:0": x, "tower_0/r:0": r}, ["tower_0/dx:0"])[0]

    def error(dx: np.ndarray) -> float:
        return float(np.max(np.abs(dx - want)) / np.max(np.abs(want)))

    unsynced = np.concatenate(_run(graph, k, _split_feeds(k, x, r), [f"tower_{i}/dx:0" for i in range(k)]), axis=0)
    print(f"dx vs float64 at |mean|/std=1000: synced {error(got):.2e}, one device {error(one_device):.2e}, "
          f"unsynced {error(unsynced):.2e}")
    assert error(got) < 5e-6
    assert error(got) < error(one_device)
    assert error(unsynced) > 1e-2


@pytest.mark.parametrize("batches, spatial", [((3, 0, 2), 4), ((1, 2), 1)])
def test_static_uneven_towers(batches, spatial, path):
    """Towers of different static sizes, one of them empty (its moments are NaN: it must weigh 0,
    not poison the gathered all-reduce) or of a single element per channel (its variance weighs
    n - 1 = 0): dx and the batch statistics of every tower are those of one device fed all."""
    k, total = len(batches), sum(batches)
    rng = np.random.default_rng(5)
    x = (rng.normal(size=(total, spatial, spatial, C)) * 2 + 3).astype(np.float32)
    r = rng.normal(size=x.shape).astype(np.float32)
    names = ("dx", "batch_mean", "batch_variance")
    want = _run(_towers(1, x.shape), 1, {"tower_0/x:0": x, "tower_0/r:0": r}, [f"tower_0/{n}:0" for n in names])
    graph = _towers(k, x.shape, batches=batches)
    result = rewrite_graph(graph, backend="collective")
    assert len([n for n in result.graph_def.node if n.name.endswith("sync_bn/placed")]) == k  # the gathered combine
    fetches = [f"tower_{i}/{n}:0" for i in range(k) for n in names]
    feeds = _split_feeds(k, x, r, batches=batches)
    got, unsynced = _run(result.graph_def, k, feeds, fetches), _run(graph, k, feeds, fetches)

    def errors(values: list) -> tuple[float, float]:
        dx = np.concatenate(values[0::3], axis=0)
        stats = [v for i, v in enumerate(values) if i % 3 and batches[i // 3]]  # the empty tower's own are NaN
        return (float(np.max(np.abs(dx - want[0])) / np.max(np.abs(want[0]))),
                max(float(np.max(np.abs(s - w))) for s, w in zip(stats, want[1:] * k)))

    print(f"static towers {batches}, {spatial}x{spatial} {path}: dx {errors(got)[0]:.2e}, statistics {errors(got)[1]:.2e}; "
          f"unsynced {errors(unsynced)[0]:.2e}, {errors(unsynced)[1]:.2e}")
    assert max(errors(got)) < 1e-5
    assert errors(unsynced)[0] > 1e-2


@pytest.mark.parametrize("op", ["FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"])
def test_every_fused_op_version(op, path):
    """With static shapes every tower's count is a constant and no all-reduce carries counts.
    dx and the batch statistics match one device, by passes or kernels."""
    _op_version_matches_one_device(op, path, "static")


@pytest.mark.parametrize("op", ["FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"])
def test_every_fused_op_version_of_unknown_batch_size(op, path):
    """With an unknown batch size the all-reduces, forward and backward, carry the counts. dx
    and the batch statistics match one device, by passes or kernels."""
    _op_version_matches_one_device(op, path, "unknown")


def _op_version_matches_one_device(op: str, path: str, batch: str) -> None:
    k, b = 2, 3
    shape = (b if batch == "static" else None, 4, 4, C)
    rng = np.random.default_rng(13)
    x = (rng.normal(size=(k * b, *shape[1:])) * 2 + np.repeat(np.arange(k), b)[:, None, None, None]).astype(np.float32)
    r = rng.normal(size=x.shape).astype(np.float32)
    names = ("dx", "batch_mean", "batch_variance")
    want = _run(_towers(1, (k * b, *shape[1:]), op=op), 1, {"tower_0/x:0": x, "tower_0/r:0": r}, [f"tower_0/{n}:0" for n in names])
    graph = _towers(k, shape, op=op)
    assert sum(n.op == op for n in graph.as_graph_def().node) == k
    result = rewrite_graph(graph, backend="collective")
    fetches = [f"tower_{i}/{n}:0" for i in range(k) for n in names]
    got = _run(result.graph_def, k, _split_feeds(k, x, r), fetches)
    payload = {n.name: len(n.input) - (n.op == "ConcatV2") for n in result.graph_def.node
               if n.op in ("ConcatV2", "Pack") and n.name.endswith("sync_bn_grad/sums")}
    counted = batch == "unknown"
    assert set(payload.values()) == ({3} if counted else {2}), payload  # [n,] sum dy, sum dy*xc
    # unknown: [n, sum, sum of squares] summed; static: each tower's [mean, spread] gathered, no count
    summed = {len(n.input) - 1 for n in result.graph_def.node if n.op == "ConcatV2" and n.name.endswith("sync_bn/moments")}
    gathered = [n for n in result.graph_def.node if n.op == "Pad" and n.name.endswith("sync_bn/placed")]
    assert (summed, len(gathered)) == (({3}, 0) if counted else (set(), k)), (summed, gathered)
    # The kernels serve every op version and batch, forward and backward.
    kernels = k if path == "kernels" else 0
    assert (len(kernel_moments(result.graph_def)), len(kernel_gradients(result.graph_def))) == (kernels, kernels)
    unsynced = _run(graph, k, _split_feeds(k, x, r), fetches)

    def dx_error(values: list) -> float:
        return float(np.max(np.abs(np.concatenate(values[0::3], axis=0) - want[0])) / np.max(np.abs(want[0])))

    print(f"{op} {path}: dx error {dx_error(got):.2e} (unsynced {dx_error(unsynced):.2e})")
    assert dx_error(got) < 1e-5 < 1e-2 < dx_error(unsynced)
    for i in range(k):
        np.testing.assert_allclose(got[3 * i + 1], want[1], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[3 * i + 2], want[2], rtol=1e-5, atol=1e-5)
