"""bnrewrite demo: 4 towers with per-tower batch norm, before and after the rewrite.

Builds a 4-tower conv+BN training graph (examples/towers_model.py), saves its
GraphDef as towers.pb, runs ``python -m bnrewrite convert towers.pb synced.pb``
and trains, for a few steps on 4 virtual CPU devices, the single-device
reference (one device, all 16 examples), the unsynchronized towers graph and
the rewritten one. Prints the max relative error of each against the
reference and the final losses.
"""

import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import tensorflow as tf  # noqa: E402

import towers_model as tm  # noqa: E402

STEPS = 5
TOWERS = 4


def main() -> int:
    tf.get_logger().setLevel("ERROR")
    spec = tm.Spec(towers=TOWERS, batch=4, layer="legacy", data_format="NHWC")
    towers = tm.build_towers(spec)
    reference = tm.build_reference(spec)
    data = tm.make_batches(spec, STEPS)

    with tempfile.TemporaryDirectory(prefix="bnrewrite-demo-") as tmp:
        towers_pb = os.path.join(tmp, "towers.pb")
        synced_pb = os.path.join(tmp, "synced.pb")
        with open(towers_pb, "wb") as f:
            f.write(towers.graph.as_graph_def().SerializeToString())

        cmd = [sys.executable, "-m", "bnrewrite", "convert", towers_pb, synced_pb]
        print("$ bnrewrite convert towers.pb synced.pb", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT)
        if proc.returncode != 0:
            print(f"bnrewrite convert failed with exit code {proc.returncode}", file=sys.stderr)
            return 1
        with open(synced_pb, "rb") as f:
            synced_graph_def = tf.compat.v1.GraphDef.FromString(f.read())

    ref = tm.train(reference.graph, reference, data, num_devices=1)
    unsynced = tm.train(towers.graph.as_graph_def(), towers, data, num_devices=TOWERS)
    synced = tm.train(synced_graph_def, towers, data, num_devices=TOWERS)

    print()
    print(f"{TOWERS} towers x {spec.batch} examples vs 1 device x {TOWERS * spec.batch} examples, "
          f"{STEPS} training steps ({spec.layer} batch norm, {spec.data_format}, {spec.dtype})")
    print()
    print(f"{'graph':<12} {'max rel. error vs reference':>28} {'final loss':>12}")
    print(f"{'reference':<12} {'-':>28} {ref.losses[-1]:>12.6f}")
    for name, result in (("unsynced", unsynced), ("synced", synced)):
        err = tm.max_rel_error(result, ref)
        print(f"{name:<12} {err:>28.3e} {result.losses[-1]:>12.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
