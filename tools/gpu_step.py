"""Training throughput with synchronized batch norm (NCCL) vs without, on real GPUs.

    python tools/gpu_step.py [--towers N] [--layers 20] [--channels 64] [--image 32]
                             [--batch 32] [--steps 50] [--warmup 10]

One tower per GPU (all of them unless --towers), the tools/deep_net.py training graph,
rewritten by bnrewrite with the NCCL backend. Prints images/s for both graphs and the ratio.
Needs 2 or more GPUs (NCCL cannot all-reduce between two towers on one GPU); with fewer it
prints why it skipped and exits 0.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

import deep_net  # noqa: E402
from bench_step import compare, step_arguments  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = step_arguments(__doc__, towers=0, layers=20, channels=64, image=32, batch=32, steps=50, warmup=10,
                            towers_help="GPUs to use (default: all)")
    args = parser.parse_args(argv)

    gpus = tf.config.list_physical_devices("GPU")
    towers = args.towers or len(gpus)
    if len(gpus) < 2 or towers < 2 or towers > len(gpus):
        print(f"skipped: found {len(gpus)} GPU(s) ({', '.join(g.name for g in gpus) or 'none'}); "
              f"synchronized batch norm over NCCL needs 2 or more GPUs, one per tower "
              f"(asked for {towers or 'all'})")
        return 0
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)

    from bnrewrite import rewrite_graph

    graph_def = deep_net.build_graph_def(
        towers, args.layers, channels=args.channels, image=args.image, batch=args.batch, device="gpu")
    synced = rewrite_graph(graph_def, backend="nccl")
    result = compare(graph_def, synced.graph_def, towers, args.steps, args.warmup, device_kind="GPU")
    images = towers * args.batch
    names = sorted({tf.config.experimental.get_device_details(g).get("device_name", "GPU") for g in gpus[:towers]})
    print(f"\n== training throughput on {towers} GPUs ({', '.join(names)}): {args.layers} conv+BN layers, "
          f"{args.channels} channels, {args.image}x{args.image} images, {args.batch} per GPU ==")
    print(f"{'graph':<16} {'median step ms':>15} {'images/s':>10}")
    for key, label in (("unsynced", "unsynced"), ("synced", "synced (NCCL)")):
        print(f"{label:<16} {result[key] * 1e3:>15.2f} {images / result[key]:>10.0f}")
    print(f"synced / unsynced images/s: {result['unsynced'] / result['synced']:.3f} "
          f"(median of {result['steps']} steps each after {args.warmup} warm-up steps; "
          f"{synced.report.collectives} NCCL all-reduces added)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
