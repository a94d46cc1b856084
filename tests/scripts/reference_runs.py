"""The oracle's two sides for examples/multi_gpu_train.py, in one process (one TensorFlow
import): `python reference_runs.py OUT K B` runs the script unmodified as python would, with
`--num_gpus 1 --batch_size K*B` (one device fed the whole batch, checkpoint in OUT/one_device)
and with `--num_gpus K --batch_size B` (the towers as built, in OUT/towers)."""

import os
import runpy
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "multi_gpu_train.py")


def main() -> None:
    out, k, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for name, towers, batch in (("one_device", 1, k * b), ("towers", k, b)):
        sys.argv = [EXAMPLE, "--num_gpus", str(towers), "--batch_size", str(batch),
                    "--train_dir", os.path.join(out, name)]
        runpy.run_path(EXAMPLE, run_name="__main__")
        import tensorflow as tf

        tf.compat.v1.reset_default_graph()


if __name__ == "__main__":
    main()
