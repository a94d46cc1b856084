"""Whether graphs import into TensorFlow.

`loads` is TensorFlow's own graph import in C++ alone (op registrations, attrs, inputs, dtypes,
every op's shape function, without making Python objects): `convert` and `inspect` run it on
every graph they rewrite, before the rewrite (bnrewrite.io.convert.rewrite), so a graph
TensorFlow rejects is an error naming TensorFlow's complaint rather than a rewrite that copies
the bad node into its output. After the rewrite they load each result as TensorFlow's loader
would (`loads_whole`: `import_meta_graph` into a fresh graph for a MetaGraph, whose collections
name nodes too; the C++ import for a GraphDef) and refuse to write one that does not load
(`check_result`). `--verify` (`verify`) also imports a rewritten GraphDef as a user would
(`import_graph_def`).
"""

from __future__ import annotations

from collections.abc import Callable

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


def loads_whole(entry: Entry) -> str | None:
    """What TensorFlow's own loader makes of the entry: `import_check` for a MetaGraph (its
    collections and saver, as import_meta_graph and a SavedModel's loader read them), the C++
    import (`loads`) for a GraphDef; the error, or None."""
    return import_check(entry) if entry.meta_graph is not None else loads(entry)


def check_result(original: Entry, result: Entry, where: str = "", check: Callable[[Entry], str | None] = loads_whole) -> None:
    """Raise when `check` rejects the rewritten `result`: GraphValidationError when `import_check`
    rejects the `original` too (the input's fault), else PassError (the rewrite's)."""
    error = check(result)
    if error is None:
        return
    own = import_check(original)
    if own is not None:
        raise GraphValidationError(
            f"{where}the rewritten graph does not import into TensorFlow, and neither does the input graph "
            f"itself ({own}); fix or re-export the input")
    raise PassError(f"{where}the rewritten graph does not import into TensorFlow ({error}); nothing was written "
                    "(a bnrewrite bug: please report it)")


def verify(rewrite: Rewrite) -> int:
    """--verify: import every rewritten graph into TensorFlow as a user would (`import_check`;
    `check_result` says whose fault a failure is). A MetaGraph's is the import `rewrite`
    already ran on it. Returns how many were checked."""
    checked = 0
    for outcome in rewrite.outcomes:
        if outcome.result is None:
            continue
        if outcome.result.meta_graph is None:
            where = f"MetaGraph {outcome.entry.label}: " if outcome.entry.tags is not None else ""
            check_result(outcome.entry, outcome.result, where, import_check)
        checked += 1
    return checked
