"""Run the NCCL backend for real: K GPU towers, rewritten, against one device fed the global batch.

    python tools/gpu_check.py [--towers K] [--steps N] [--logical]

Builds the examples' conv+BN model with towers on /gpu:0..K-1, rewrites it with
backend="nccl", trains the synced and the un-synced graphs and the single-device
reference, and prints their errors. With fewer than K GPUs it exits 0 with a message,
unless --logical splits GPU 0 into K logical GPUs (NCCL may refuse several ranks on one
physical GPU; the script reports what happened either way).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(towers: int, logical: bool):
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(allow_soft_placement=False)
    if logical:
        config.gpu_options.experimental.virtual_devices.add(memory_limit_mb=[2048] * towers)
    return config


def _train(graph_like, built, batches, config):
    import numpy as np
    import tensorflow as tf
    from towers_model import Result, load_graph

    graph = load_graph(graph_like)
    n = len(built.inputs)
    losses = []
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        sess.run(built.init)
        start = time.perf_counter()
        for images, labels in batches:
            per = len(images) // n
            feed = {}
            for k, (img, lbl) in enumerate(built.inputs):
                feed[img], feed[lbl] = images[k * per:(k + 1) * per], labels[k * per:(k + 1) * per]
            losses.append(float(sess.run([built.train_op, built.loss], feed)[1]))
        seconds = time.perf_counter() - start
        values = sess.run(dict(built.variables))
    return Result(np.asarray(losses), {k: np.asarray(v) for k, v in values.items()}), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--towers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--logical", action="store_true", help="split GPU 0 into --towers logical GPUs")
    args = parser.parse_args()
    try:
        import tensorflow as tf
    except ImportError as exc:
        print(f"gpu_check: skipped: TensorFlow is not importable here ({exc})")
        return 0
    gpus = tf.config.list_physical_devices("GPU")
    print(f"TensorFlow {tf.__version__}, built with CUDA: {tf.test.is_built_with_cuda()}, physical GPUs: {len(gpus)}")
    if len(gpus) < args.towers and not (args.logical and gpus):
        print(f"gpu_check: skipped: {args.towers} towers need {args.towers} GPUs, found {len(gpus)} (try --logical)")
        return 0

    from bnrewrite import rewrite_graph
    from towers_model import Spec, build_reference, build_towers, make_batches, max_rel_error, session_config

    spec = Spec(towers=args.towers, device="gpu", batch=4, image=16)
    built = build_towers(spec)
    result = rewrite_graph(built.graph, backend="nccl")
    print(result.report)
    batches = make_batches(spec, args.steps)
    ref = build_reference(spec)
    expected, _ = _train(ref.graph, ref, batches, session_config(1))
    config = _config(args.towers, args.logical)
    rows = []
    for label, graph in (("un-synced", built.graph), ("synced (nccl)", result.graph_def)):
        try:
            got, seconds = _train(graph, built, batches, config)
        except tf.errors.OpError as exc:
            print(f"{label}: failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            continue
        rows.append((label, max_rel_error(got, expected), args.steps * spec.towers * spec.batch / seconds))
    for label, error, rate in rows:
        print(f"{label:>14}: max relative error vs one device {error:.2e}, {rate:.0f} images/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
