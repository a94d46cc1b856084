"""Whether rewritten graphs import into TensorFlow, before anything is written.

Every `convert` (and `inspect`, which says what convert would do) runs TensorFlow's own graph
import on each rewritten graph (`check_imports`: the C++ import alone, which checks op
registrations, attrs, inputs, dtypes and every op's shape function without making Python
objects). `--verify` also imports each one as a user would (`tf.compat.v1.import_meta_graph`
with its collections, or `import_graph_def`). When a rewritten graph does not import, the
input is tried too: if it does not import either, the input is malformed (what the rewrite
copied unchanged); if it does, the rewrite broke it.
"""

from __future__ import annotations

from typing import Callable

from bnrewrite.errors import GraphValidationError, PassError
from bnrewrite.io.model import Entry, Outcome, Rewrite, one_line


def loads(entry: Entry) -> str | None:
    """TensorFlow's C++ graph import of the entry's GraphDef (its function library included)
    into a fresh graph; the error, or None."""
    import tensorflow as tf
    from tensorflow.python.client import pywrap_tf_session as c_api
    from tensorflow.python.framework import c_api_util

    graph = tf.Graph()
    options = c_api.TF_NewImportGraphDefOptions()
    try:
        with c_api_util.tf_buffer(entry.graph_def.SerializeToString()) as buffer:
            c_api.TF_DeleteImportGraphDefResults(c_api.TF_GraphImportGraphDefWithResults(graph._c_graph, buffer, options))
    except Exception as exc:  # noqa: BLE001 - TensorFlow raises many kinds; all mean "does not import"
        return one_line(str(exc)) or type(exc).__name__
    finally:
        c_api.TF_DeleteImportGraphDefOptions(options)
    return None


def import_check(entry: Entry) -> str | None:
    """Import the entry into a fresh tf.Graph (a MetaGraph with its collections); the error or None."""
    import tensorflow as tf

    try:
        with tf.Graph().as_default():
            if entry.meta_graph is not None:
                tf.compat.v1.train.import_meta_graph(entry.meta_graph, clear_devices=False)
            else:
                tf.compat.v1.import_graph_def(entry.graph_def, name="")
    except Exception as exc:  # noqa: BLE001 - TensorFlow raises many kinds; all mean "does not import"
        return one_line(str(exc)) or type(exc).__name__
    return None


def check_imports(rewrite: Rewrite) -> None:
    """Every rewritten graph of `rewrite` passes TensorFlow's C++ import (`loads`); raises
    GraphValidationError when the input does not pass it either, else PassError."""
    for outcome in rewrite.outcomes:
        _check(outcome, loads)


def verify(rewrite: Rewrite) -> int:
    """Import every rewritten graph into TensorFlow as a user would (`import_check`); raises as
    check_imports does. Returns how many were checked."""
    checked = 0
    for outcome in rewrite.outcomes:
        checked += _check(outcome, import_check)
    return checked


def _check(outcome: Outcome, imports: Callable[[Entry], str | None]) -> bool:
    """Whether there was a rewritten graph to check; raises when it does not import."""
    if outcome.result is None:
        return False
    error = imports(outcome.result)
    if error is None:
        return True
    where = f"MetaGraph {outcome.entry.label}: " if outcome.entry.tags is not None else ""
    own = imports(outcome.entry)
    if own is not None:
        raise GraphValidationError(
            f"{where}the input graph does not import into TensorFlow ({own}); the rewrite keeps that node as it is: "
            "fix or re-export the input")
    raise PassError(f"{where}the rewritten graph does not import into TensorFlow ({error}); nothing was written "
                    "(a bnrewrite bug: please report it)")
