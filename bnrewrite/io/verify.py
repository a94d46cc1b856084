"""Whether graphs import into TensorFlow.

`loads` is TensorFlow's own graph import in C++ alone (op registrations, attrs, inputs, dtypes,
every op's shape function, without making Python objects): `convert` and `inspect` run it on
every graph they rewrite, before the rewrite (bnrewrite.io.convert.rewrite), so a graph
TensorFlow rejects is an error naming TensorFlow's complaint rather than a rewrite that copies
the bad node into its output. After the rewrite they check each result before writing it
(`check_result` with `loads_whole`): the C++ import, and for a MetaGraph every name
`import_meta_graph` looks up in its collections and saver (bnrewrite.io.collection_names), found
in that import; TensorFlow's Python loader itself (`import_check`) only where a collection is
rebuilt in a way not known there. `--verify` (`verify`) runs the Python loader on every result:
`import_meta_graph` for a MetaGraph, `import_graph_def` for a GraphDef."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bnrewrite.errors import GraphValidationError, PassError
from bnrewrite.io.collection_names import output_counts, resolver, unresolved
from bnrewrite.io.model import Entry, Rewrite, one_line


def loads(entry: Entry) -> str | None:
    """TensorFlow's C++ graph import of the entry's GraphDef (its function library included)
    into a fresh graph; the error, or None."""
    return _c_import(entry)[1]


def _c_import(entry: Entry) -> tuple[Any, str | None]:
    """The fresh graph `loads` imports the entry into, and the error or None."""
    import tensorflow as tf
    from tensorflow.python.client import pywrap_tf_session as c_api
    from tensorflow.python.framework import c_api_util

    graph = tf.Graph()
    options = c_api.TF_NewImportGraphDefOptions()
    try:
        with c_api_util.tf_buffer(entry.graph_def.SerializeToString()) as buffer:
            c_api.TF_DeleteImportGraphDefResults(c_api.TF_GraphImportGraphDefWithResults(graph._c_graph, buffer, options))
    except Exception as exc:  # noqa: BLE001 - TensorFlow raises many kinds; all mean "does not import"
        return graph, one_line(str(exc)) or type(exc).__name__
    finally:
        c_api.TF_DeleteImportGraphDefOptions(options)
    return graph, None


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
    """Whether TensorFlow's loader loads the entry: the C++ import (`loads`), and for a MetaGraph
    every name import_meta_graph and its Saver look up (collections, saver_def) found in it, or
    `import_check` where a collection is rebuilt in a way bnrewrite.io.collection_names does not
    know; the error, or None."""
    graph, error = _c_import(entry)
    meta = entry.meta_graph
    if error is not None or meta is None:
        return error
    missing = unresolved(meta, entry.graph_def, resolver(output_counts(graph)))
    if missing is None:
        return import_check(entry)
    if not missing:
        return None
    more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
    return f"the MetaGraph names what its graph lacks: {', '.join(missing[:3])}{more}"


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
    """--verify: import every rewritten graph into TensorFlow as a user would, with its Python
    loader (`import_check`; `check_result` says whose fault a failure is). Returns how many
    were checked."""
    checked = 0
    for outcome in rewrite.outcomes:
        if outcome.result is None:
            continue
        where = f"MetaGraph {outcome.entry.label}: " if outcome.entry.tags is not None else ""
        check_result(outcome.entry, outcome.result, where, import_check)
        checked += 1
    return checked
