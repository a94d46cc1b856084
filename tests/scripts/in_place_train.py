"""examples/multi_gpu_train.py's trainer with one line added: rewrite_graph(g, in_place=True)
after the graph is built; the script's own tf.Session loop (init op and Saver built after the
session) then trains the synchronized graph."""

import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

import tensorflow as tf  # noqa: E402

import multi_gpu_train as trainer  # noqa: E402
from bnrewrite import rewrite_graph  # noqa: E402


def main() -> None:
    args = trainer.parse_args()
    tf.compat.v1.disable_eager_execution()
    handles = trainer.build(args)
    result = rewrite_graph(tf.compat.v1.get_default_graph(), in_place=True)
    print(f"rewritten: {len(result.report.layers)} layers, backend {result.report.backend}")
    trainer.train_with_session(args, handles)


if __name__ == "__main__":
    main()
