"""The oracle for towers shaped the way real graphs are, not only `tower_k/` with equal batches.

* Towers without a name scope (only the variable scope "net" reused, TensorFlow uniquifies
  the op names to net/..., net_1/...), told apart by device; name-scope towers with other
  prefixes (replica_, gpu_, clone_) or inside an outer scope (model/tower_k); and scope
  grouping asked for explicitly.
* Uneven per-tower batches with a dynamic batch dimension, including steps where a tower
  gets no example at all: the all-reduces carry the counts, so nobody hangs and the result
  is one device on the concatenated batch (Spec.uneven weights each tower's loss by K/N).
* Sync groups: K=4 towers synchronized in groups of 2 train like 2 un-rewritten devices
  with 2*B examples each.
* NCCL structure of each pattern on /gpu:k towers (graphs built and imported, never run).

Like tests/test_oracle.py: the rewritten graph must match its reference within 2e-4 per
tensor (losses, weights, moving statistics) and the un-rewritten graph must not (> 1e-2;
NaN counts as not matching).
"""

import functools
import json
import os
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest
import tensorflow as tf

from bnrewrite import rewrite_graph
from models import (Result, Spec, build_towers, make_batches, max_rel_error, one_device_run, rel_errors, towers_once, train,
                    unrewritten_run)

STEPS = 3
TOLERANCE = 2e-4  # float32; measured ~1e-6 (see the report printed by each test)
UNSYNCED_AT_LEAST = 1e-2
BN_LAYERS = ["net/bn1", "net/bn2"]
#: A collective that waits longer than this fails instead of hanging the test run.
TIMEOUT_SECONDS = 60.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def as_built(spec: Spec, splits) -> Result:
    """The un-rewritten towers trained on the spec's batches split by `splits` (a tuple of
    tuples, or None): the must-not-match side, the same for every option, trained once (read-only)."""
    built = towers_once(spec)
    return train(built.graph, built, make_batches(spec, STEPS), num_devices=spec.towers, splits=splits)


def _frozen(splits):
    return None if splits is None else tuple(map(tuple, splits))


def oracle(spec: Spec, splits=None, **options):
    """Per-quantity errors of the rewritten and of the un-rewritten graph against one device
    fed every example of each step, and the report."""
    built = towers_once(spec)
    result = rewrite_graph(built.graph, backend="collective", **options)
    expected = one_device_run(spec, STEPS)
    synced = train(result.graph_def, built, make_batches(spec, STEPS), num_devices=spec.towers, splits=splits)
    unsynced = as_built(spec, _frozen(splits))
    return rel_errors(synced, expected), rel_errors(unsynced, expected), result.report


def check_oracle(name: str, spec: Spec, splits=None, **options):
    detail, unsynced_detail, report = oracle(spec, splits, **options)
    synced, unsynced = max(detail.values()), max(unsynced_detail.values())
    print(f"{name}: synced {synced:.2e} ({max(detail, key=detail.get)}), unsynced {unsynced:.2e}")
    assert unsynced > UNSYNCED_AT_LEAST, "the un-rewritten graph matched: this oracle cannot fail"
    assert synced <= TOLERANCE, detail
    assert not report.skipped, report.skipped
    return report


def check_layers(report, tower_scopes: list[str]):
    """Two layers, named after the shared variables, each with one site per tower in tower
    order; tower_scopes: the name scope each tower's layers sit in."""
    assert [row.layer for row in report.layers] == BN_LAYERS
    for row in report.layers:
        assert len(row.sites) == len(tower_scopes), row.sites
        assert all(site.startswith(f"{scope}/") for site, scope in zip(row.sites, tower_scopes)), row.sites
        assert len(row.gradients) == len(tower_scopes) and row.collectives == 2 * len(tower_scopes)


# ---------------------------------------------------------------------------
# 1. Towers with no name prefix, other prefixes, scope grouping
# ---------------------------------------------------------------------------


def _uniquified(k: int) -> list[str]:
    return ["net"] + [f"net_{i}" for i in range(1, k)]


@pytest.mark.parametrize("layer, k", [("legacy", 2), ("fused_op", 3)])
def test_towers_without_name_scope(layer, k):
    """Only the variable scope is reused: op names net/..., net_1/..., towers differ by device."""
    report = check_oracle(f"no-prefix-{layer}-K{k}", Spec(towers=k, layer=layer, tower_prefix=""))
    assert report.tower_by == "device"
    assert report.towers == [f"/device:CPU:{i}" for i in range(k)]
    check_layers(report, _uniquified(k))


@pytest.mark.parametrize("prefix, layer", [("replica_", "legacy"), ("gpu_", "fused_op")])
def test_other_name_scope_prefixes(prefix, layer):
    """Name-scope towers that are not tower_k (clone_k: see test_scope_grouping_asked_for)."""
    report = check_oracle(f"{prefix}-{layer}", Spec(towers=2, layer=layer, tower_prefix=prefix))
    assert report.tower_by == "device" and report.towers == ["/device:CPU:0", "/device:CPU:1"]
    check_layers(report, [f"{prefix}0/net", f"{prefix}1/net"])


@pytest.mark.parametrize("layer", ["moments_cond_v1", "moments_cond_v2", "legacy"])
def test_towers_inside_an_outer_scope(layer):
    """model/tower_k/...: the tower's scope is not the top one, so names alone do not line the
    layers up; the scale and offset variables they share do, for tf.nn.moments layers too
    (those of the tf.nn.batch_normalization their statistics feed)."""
    report = check_oracle(f"outer-scope-{layer}", Spec(towers=2, layer=layer, tower_prefix="model/tower_"))
    assert report.tower_by == "device"
    assert [row.layer for row in report.layers] == BN_LAYERS
    for row in report.layers:
        assert [site.split("/")[:2] for site in row.sites] == [["model", "tower_0"], ["model", "tower_1"]]


@pytest.mark.parametrize("layer", ["legacy", "legacy_unfused"])
def test_towers_inside_an_outer_scope_without_gamma_or_beta(layer):
    """center=False, scale=False: the layer reads no variable; the moving statistics that every
    tower updates are what lines its copies up."""
    spec = Spec(towers=3, layer=layer, tower_prefix="model/tower_", affine=False)
    report = check_oracle(f"outer-scope-no-affine-{layer}", spec)
    assert [row.layer for row in report.layers] == BN_LAYERS
    assert all(len(row.sites) == 3 and len(row.updates_kept) == 2 for row in report.layers)


@pytest.mark.parametrize("prefix, k", [("clone_", 3), ("", 2)], ids=["clone", "no-prefix"])
def test_scope_grouping_asked_for(prefix, k):
    """tower_by="scope" on a graph whose towers also sit on devices: the top name scope decides,
    even when that scope is only TensorFlow's uniquified variable-scope name (net, net_1)."""
    report = check_oracle(f"scope-{prefix or 'none'}-K{k}", Spec(towers=k, tower_prefix=prefix), tower_by="scope")
    scopes = [f"{prefix}{i}" for i in range(k)] if prefix else _uniquified(k)
    assert report.tower_by == "scope" and report.towers == scopes
    check_layers(report, [f"{s}/net" for s in scopes] if prefix else scopes)


# ---------------------------------------------------------------------------
# 2. Uneven batches, dynamic batch dimension, empty towers
# ---------------------------------------------------------------------------

#: Per-step tower sizes; the global batch of K*B=12 examples is the same as for equal slices.
UNEVEN_SPLITS = [[1, 4, 7], [6, 2, 4], [3, 5, 4]]


#: The moments layers too: on a batch of unknown size TensorFlow's Mean gradient takes the
#: incoming gradient in by a BroadcastTo, not a Reshape (their backward was left local).
@pytest.mark.parametrize("layer, data_format", [("legacy", "NHWC"), ("fused_op", "NCHW"), ("legacy_unfused", "NHWC"),
                                                ("moments_cond_v1", "NCHW"), ("moments_cond_v2", "NHWC")])
def test_uneven_batches(layer, data_format):
    spec = Spec(towers=3, batch=4, layer=layer, data_format=data_format, uneven=True)
    report = check_oracle(f"uneven-{layer}-{data_format}", spec, UNEVEN_SPLITS, timeout_seconds=TIMEOUT_SECONDS)
    check_layers(report, ["tower_0/net", "tower_1/net", "tower_2/net"])


def test_uneven_moments_under_enable():
    """The sessions of `bnrewrite run` synchronize a moments layer fed batches of unknown size as
    the API does (they ran the graph unchanged: its gradient went unseen, "no gradient yet")."""
    import bnrewrite
    from bnrewrite.session import live

    spec = Spec(towers=3, batch=4, layer="legacy_unfused", uneven=True)
    built, data = build_towers(spec), make_batches(spec, STEPS)  # its own graph: the sessions may add to it
    expected, unsynced = one_device_run(spec, STEPS), as_built(spec, _frozen(UNEVEN_SPLITS))  # test_uneven_batches' too
    with bnrewrite.enabled(quiet=True):
        synced = train(built.graph, built, data, num_devices=spec.towers, splits=UNEVEN_SPLITS)
    assert live.records()[-1]["outcome"] == "synchronized", live.records()[-1]["why"]
    assert max(rel_errors(unsynced, expected).values()) > UNSYNCED_AT_LEAST
    assert max(rel_errors(synced, expected).values()) <= TOLERANCE


def test_a_moments_gradient_of_an_unknown_form_is_refused():
    """A Mean gradient that takes the incoming gradient in by an op other than Reshape or
    BroadcastTo (as a future TensorFlow might build it) cannot be rewritten: the layer is
    refused, not synchronized in its forward pass alone (which would train it wrongly)."""
    from bnrewrite.errors import UnsyncedLayerError

    graph_def = build_towers(Spec(layer="legacy_unfused", uneven=True)).graph.as_graph_def()
    renamed = {n.name: n.name[: -len("BroadcastTo")] + "Expand" for n in graph_def.node
               if "bn1/moments/" in n.name and n.name.endswith("_grad/BroadcastTo")}
    assert len(renamed) == 4  # mean and variance x 2 towers
    for node in graph_def.node:
        node.name = renamed.get(node.name, node.name)
        node.input[:] = [renamed.get(i.split(":")[0], i.split(":")[0]) + i[len(i.split(":")[0]):] for i in node.input]
    with pytest.raises(UnsyncedLayerError, match="bn1/moments/mean takes the incoming gradient in by ops bnrewrite does not"):
        rewrite_graph(graph_def)


#: (Spec kwargs, per-step splits): every tower is empty in some step, tower 0 included (its
#: moving-average update is the one kept, so it must write the global statistics anyway).
EMPTY_TOWER_CASES = {
    "K2-legacy": (dict(towers=2, batch=2, layer="legacy"), [[4, 0], [2, 2], [0, 4]]),
    "K3-fused_op-NCHW": (dict(towers=3, batch=2, layer="fused_op", data_format="NCHW"), [[0, 6, 0], [2, 0, 4], [1, 2, 3]]),
}


def _empty_tower_runs() -> dict:
    """Runs EMPTY_TOWER_CASES; {case: {synced, unsynced, synced_detail, unsynced_nonfinite, ...}}."""
    out = {}
    for name, (kwargs, splits) in EMPTY_TOWER_CASES.items():
        spec = Spec(uneven=True, **kwargs)
        detail, unsynced_detail, report = oracle(spec, splits, timeout_seconds=TIMEOUT_SECONDS)
        out[name] = {
            "synced": max(detail.values()), "unsynced": max(unsynced_detail.values()), "synced_detail": detail,
            "unsynced_nonfinite": sorted(q for q, e in unsynced_detail.items() if e == float("inf")),
            "unsynced_finite": max(e for e in unsynced_detail.values() if e != float("inf")),
            "skipped": report.skipped, "layers": [row.layer for row in report.layers],
        }
    return out


@pytest.fixture(scope="module")
def empty_tower_runs():
    """The empty-tower oracle, in a subprocess with oneDNN off.

    TensorFlow 2.21's oneDNN Conv2D (_MklNativeConv2D, the default CPU kernel) returns its
    INPUT for an empty batch: conv3x3(8) of a [0, 6, 6, 3] tensor comes back [0, 6, 6, 3],
    not [0, 6, 6, 8]. The un-rewritten graph then fails in FusedBatchNormV3 ("scale must
    have the same number of elements as the channels of x, got 8 and 3"), and the rewritten
    one in its all-reduce (shape [7] on the empty tower, [17] on the others: a clean error,
    not a hang). Neither is about batch norm; with the plain Eigen kernels
    (TF_ENABLE_ONEDNN_OPTS=0, read once when TensorFlow loads) the conv is right.
    """
    path = [ROOT, os.path.join(ROOT, "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--empty-towers"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(EMPTY_TOWER_CASES))
def test_tower_with_no_examples(empty_tower_runs, case):
    run = empty_tower_runs[case]
    print(f"empty-tower-{case}: synced {run['synced']:.2e}, unsynced {run['unsynced']:.2e} "
          f"(non-finite: {', '.join(run['unsynced_nonfinite']) or 'none'}; the rest {run['unsynced_finite']:.2e})")
    assert run["unsynced"] > UNSYNCED_AT_LEAST  # an empty tower's own batch norm: NaN statistics
    assert run["unsynced_finite"] > UNSYNCED_AT_LEAST  # and the other towers' losses and weights are off
    assert run["synced"] <= TOLERANCE, run["synced_detail"]
    assert run["layers"] == BN_LAYERS and not run["skipped"]


def test_nan_counts_as_mismatch():
    ref = Result(losses=np.ones(3), variables={"v": np.ones(4, np.float32)})
    nan = Result(losses=np.ones(3), variables={"v": np.array([1, np.nan, 1, 1], np.float32)})
    assert max_rel_error(nan, ref) == float("inf") > UNSYNCED_AT_LEAST
    assert max_rel_error(Result(np.array([1, 1, np.inf]), ref.variables), ref) == float("inf")


# ---------------------------------------------------------------------------
# 3. Sync groups
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _two_devices(spec: Spec, tower0_updates_only: bool) -> Result:
    """The K=4 group_size=2 spec's 2-device graph (2*B examples each) trained on its batches:
    the same for every backend, so trained once per test process (read-only)."""
    two = build_towers(Spec(towers=2, batch=2 * spec.batch, layer=spec.layer,
                            updates_tower=0 if tower0_updates_only else None))
    return train(two.graph, two, make_batches(spec, STEPS), num_devices=2)


@pytest.mark.parametrize("layer, backend", [
    ("legacy", "collective"), ("fused_op", "collective"), ("legacy_cond_v1", "collective"), ("legacy_cond_v2", "collective"),
    ("legacy", "local"), ("legacy_cond_v1", "local"),
])
def test_sync_groups_train_like_devices_with_the_group_batch(layer, backend):
    """K=4, group_size=2 is 2 un-rewritten devices with 2*B examples each.

    train() gives device d of the reference the d-th half of each global batch, i.e. towers
    {0, 1} and {2, 3}. Losses and weights depend only on each device's batch statistics, so
    the plain 2-device graph is their reference. Moving statistics are not: the rewrite keeps
    one update per statistic per step, tower 0's (the statistics of group 0), while the
    2-device graph applies both devices' updates, one after the other in no fixed order. So
    the reference for everything is the 2-device graph whose train_op groups only device 0's
    UPDATE_OPS (Spec.updates_tower=0).
    """
    b = 2
    spec = Spec(towers=4, batch=b, layer=layer)
    built = towers_once(spec)
    result = rewrite_graph(built.graph, backend=backend, group_size=2)
    data = make_batches(spec, STEPS)
    expected, plain = _two_devices(spec, True), _two_devices(spec, False)
    synced = train(result.graph_def, built, data, num_devices=4)
    unsynced = unrewritten_run(spec, STEPS)
    got, without = max_rel_error(synced, expected), max_rel_error(unsynced, expected)
    print(f"groups-{layer} {backend}: synced {got:.2e}, unsynced {without:.2e}")
    assert without > UNSYNCED_AT_LEAST, "the un-rewritten graph matched: this oracle cannot fail"
    assert got <= TOLERANCE, rel_errors(synced, expected)
    errors = rel_errors(synced, expected)
    assert any("moving_mean" in q for q in errors) and any("moving_variance" in q for q in errors)

    # Against the plain 2-device graph (both devices' updates): the same losses and weights,
    # other moving statistics; which is why the reference keeps device 0's updates only.
    versus_plain = rel_errors(synced, plain)
    moving = {q: e for q, e in versus_plain.items() if "moving_" in q}
    assert max(e for q, e in versus_plain.items() if q not in moving) <= TOLERANCE, versus_plain
    assert max(moving.values()) > UNSYNCED_AT_LEAST, moving

    # The groups really are separate: synchronizing all four towers is another model.
    assert max_rel_error(synced, one_device_run(spec, STEPS)) > UNSYNCED_AT_LEAST

    report = result.report
    groups = [["/device:CPU:0", "/device:CPU:1"], ["/device:CPU:2", "/device:CPU:3"]]
    assert report.sync_groups == groups and all(row.sync_groups == groups for row in report.layers)
    assert "sync groups: [/device:CPU:0, /device:CPU:1]; [/device:CPU:2, /device:CPU:3]" in str(report)
    assert [row.layer for row in report.layers] == BN_LAYERS
    for row in report.layers:
        assert len(row.updates_kept) == 2 and all(u.startswith("tower_0/") for u in row.updates_kept)


# ---------------------------------------------------------------------------
# NCCL structure of each pattern
# ---------------------------------------------------------------------------

NCCL_CASES = {
    "no-prefix": (Spec(towers=2, device="gpu", tower_prefix=""), {}),
    "clone-by-scope": (Spec(towers=3, device="gpu", tower_prefix="clone_", layer="fused_op"), {"tower_by": "scope"}),
    "uneven": (Spec(towers=3, device="gpu", uneven=True, data_format="NCHW"), {}),
    "groups-legacy": (Spec(towers=4, device="gpu"), {"group_size": 2}),
    "groups-fused_op": (Spec(towers=4, device="gpu", layer="fused_op"), {"group_size": 2}),
}


@pytest.mark.parametrize("case", list(NCCL_CASES))
def test_nccl_structure(case):
    spec, options = NCCL_CASES[case]
    k, g = spec.towers, options.get("group_size", spec.towers)
    result = rewrite_graph(build_towers(spec).graph, **options)  # default backend: NCCL on GPUs
    assert result.report.backend == "nccl" and not result.report.skipped
    assert [row.layer for row in result.report.layers] == BN_LAYERS
    nodes = [n for n in result.graph_def.node if n.op == "NcclAllReduce"]
    assert not [n for n in result.graph_def.node if n.op == "CollectiveReduceV2"]
    assert len(nodes) == 2 * len(BN_LAYERS) * k  # forward + backward, per layer, per tower
    members = defaultdict(list)
    for node in nodes:
        assert node.attr["num_devices"].i == g and node.attr["reduction"].s == b"sum"
        members[node.attr["shared_name"].s].append(node.device)
    assert len(members) == 2 * len(BN_LAYERS) * (k // g)
    groups = [sorted(f"/device:GPU:{i}" for i in range(s, s + g)) for s in range(0, k, g)]
    for devices in members.values():
        assert sorted(devices) in groups, devices
    with tf.Graph().as_default():
        tf.compat.v1.import_graph_def(result.graph_def, name="")


if __name__ == "__main__" and sys.argv[1:] == ["--empty-towers"]:
    print(json.dumps(_empty_tower_runs()))
