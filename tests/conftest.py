"""pytest setup: quiet TensorFlow, and make examples/towers_model.py importable.

The model/graph builder lives in examples/towers_model.py (shared with
examples/demo.py); tests import it through tests/models.py.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_EXAMPLES = os.path.join(_ROOT, "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)


def _silence_tf_python_logs():
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")


_silence_tf_python_logs()
