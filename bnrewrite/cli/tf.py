"""TensorFlow imported quietly and once: its native and Python logging kept off the terminal
unless -v is given, and Keras left unloaded, which the command line never uses. Commands call
import_tensorflow() only after every check that needs no TensorFlow.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def quiet_tensorflow() -> None:
    """Keep TensorFlow's native logging (written straight to file descriptor 2, also at import
    time) off the terminal: fd 2 goes to /dev/null and Python's sys.stderr to a copy of the
    real one, so bnrewrite's own messages still arrive."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import warnings

    warnings.filterwarnings("ignore")
    if "tensorflow" in sys.modules:  # imported in-process (tests): leave the process alone
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        sys.stderr = os.fdopen(saved, "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    except (OSError, ValueError, AttributeError):
        pass


class _SkipKeras:
    """A meta-path finder under which `import keras` / `import tf_keras` fail (their spec is
    still found). TensorFlow's own import tries to load Keras and carries on without it; the
    command line never uses Keras, and not loading it (and what it pulls in: scikit-learn,
    IPython, ... when installed) makes every command start about 1.5 s sooner.
    BNREWRITE_IMPORT_KERAS=1 turns this off."""

    NAMES = ("keras", "tf_keras")

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.NAMES:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = self
        return spec

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        raise ImportError(f"{module.__name__} is not loaded by the bnrewrite command line")


def import_tensorflow() -> None:
    """Import TensorFlow without Keras and with its Python logging at ERROR."""
    import logging

    skip = None
    if "tensorflow" not in sys.modules and not os.environ.get("BNREWRITE_IMPORT_KERAS"):
        skip = _SkipKeras()
        sys.meta_path.insert(0, skip)
    try:
        import tensorflow as tf  # noqa: F401 - the slow import, in one place
    finally:
        if skip is not None:
            sys.meta_path.remove(skip)
            for name in [m for m in sys.modules if m.split(".")[0] in _SkipKeras.NAMES]:
                del sys.modules[name]

    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # pragma: no cover
        pass
