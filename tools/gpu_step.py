"""Step cost on real GPUs: what synchronized batch norm costs per training step, side by side
with the alternatives (the comparison tools/bench_step.py makes on virtual CPU devices).

    python tools/gpu_step.py [--towers N] [--sizes default,large,gpu] [--dtypes float32,float16]
                             [--variants unsynced,bnrewrite,model_sync,keras_sync,floor,floor_gated,
                                         bnrewrite_collective,floor_collective]
                             [--steps 30] [--warmup 5] [--block 2] [--traces 3] [--quick]

One tower per GPU (all of them unless --towers), the tools/deep_net.py model; bnrewrite,
model-code sync BN and the floor all-reduce with NCCL (`NcclAllReduce`; the *_collective
variants with CollectiveReduceV2), tf_keras's
synchronized layer with MirroredStrategy's collective all-reduce over NCCL. Prints, per size and
dtype, the median step time of each variant, its ratio to unsynced, the peak of each GPU's
allocator, the extra op time by op type and the issue's goal lines. On GPUs the traced op
times are the executor's (host) times: a kernel's launch, not its run on the device.
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

from bench_step import arguments, run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, towers=0, towers_help="GPUs to use, one tower each (default: all)",
                       sizes="default,large,gpu")
    args = parser.parse_args(argv)

    gpus = tf.config.list_physical_devices("GPU")
    towers = args.towers or len(gpus)
    if len(gpus) < 2 or towers < 2 or towers > len(gpus):
        print(f"skipped: found {len(gpus)} GPU(s) ({', '.join(g.name for g in gpus) or 'none'}); "
              f"synchronized batch norm over NCCL needs 2 or more GPUs, one per tower "
              f"(asked for {towers or 'all'}); tools/bench_step.py makes the same comparison on virtual CPUs")
        return 0
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    names = sorted({tf.config.experimental.get_device_details(g).get("device_name", "GPU") for g in gpus[:towers]})
    run(args, "gpu", towers, f"{towers} GPUs ({', '.join(names)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
