"""The oracle's two sides for examples/multi_gpu_train.py, in one process (one TensorFlow
import): `python reference_runs.py OUT K B` runs the script unmodified as python would, with
`--num_gpus 1 --batch_size K*B` (one device fed the whole batch, checkpoint in OUT/one_device)
and with `--num_gpus K --batch_size B` (the towers as built, in OUT/towers); then
tests/scripts/summary_threads.py likewise with 1 and K towers (in OUT/plain); then
tests/scripts/in_place_train.py (which calls rewrite_graph itself) with K towers (in OUT/in_place).
Each script runs unmodified, start to end, as `python SCRIPT ARGS` would run it."""

import os
import runpy
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "multi_gpu_train.py")
THREADS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "summary_threads.py")
IN_PLACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "in_place_train.py")


def main() -> None:
    out, k, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for name, towers, batch in (("one_device", 1, k * b), ("towers", k, b)):
        sys.argv = [EXAMPLE, "--num_gpus", str(towers), "--batch_size", str(batch),
                    "--train_dir", os.path.join(out, name)]
        runpy.run_path(EXAMPLE, run_name="__main__")
        import tensorflow as tf

        tf.compat.v1.reset_default_graph()
    sys.argv = [THREADS, os.path.join(out, "plain"), str(k * b), "1", str(k)]
    runpy.run_path(THREADS, run_name="__main__")
    tf.compat.v1.reset_default_graph()
    sys.argv = [IN_PLACE, "--num_gpus", str(k), "--batch_size", str(b), "--train_dir", os.path.join(out, "in_place")]
    runpy.run_path(IN_PLACE, run_name="__main__")


if __name__ == "__main__":
    main()
