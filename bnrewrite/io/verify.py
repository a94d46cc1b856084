"""Whether graphs import into TensorFlow.

`loads` is TensorFlow's own graph import in C++ alone (op registrations, attrs, inputs, dtypes,
every op's shape function, without making Python objects): `convert` and `inspect` run it on
every graph they rewrite (bnrewrite.io.convert.rewrite), so a graph TensorFlow rejects is an
error naming TensorFlow's complaint rather than a rewrite that copies the bad node into its
output. `--verify` (`verify`) imports each rewritten graph as a user would
(`tf.compat.v1.import_meta_graph` with its collections, or `import_graph_def`) and tells a
malformed input from a rewrite that broke it.
"""

from __future__ import annotations

from bnrewrite.errors import GraphValidationError, PassError
from bnrewrite.io.model import Entry, Rewrite, one_line


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


def verify(rewrite: Rewrite) -> int:
    """Import every rewritten graph into TensorFlow as a user would (`import_check`). Raises
    GraphValidationError when one does not import and neither does its input, PassError when
    the input does. Returns how many were checked."""
    checked = 0
    for outcome in rewrite.outcomes:
        if outcome.result is None:
            continue
        error = import_check(outcome.result)
        if error is not None:
            where = f"MetaGraph {outcome.entry.label}: " if outcome.entry.tags is not None else ""
            own = import_check(outcome.entry)
            if own is not None:
                raise GraphValidationError(
                    f"{where}the rewritten graph does not import into TensorFlow, and neither does the input graph "
                    f"itself ({own}); fix or re-export the input")
            raise PassError(f"{where}the rewritten graph does not import into TensorFlow ({error}); nothing was written "
                            "(a bnrewrite bug: please report it)")
        checked += 1
    return checked
