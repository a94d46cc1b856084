"""The C graph under a tf.Graph, reached without Python Operation objects: a serialized GraphDef
imported into it, its operations by name. A session runs the C graph; the Python objects
tf.graph_util.import_graph_def would make cost most of an import's time and are never used here.
"""

from __future__ import annotations

from typing import Any


def import_fragment(graph: Any, graph_def: bytes, inputs: dict[str, tuple[Any, int]], controls: dict[str, Any],
                    returns: list[str] | None = None) -> list[Any]:
    """Import a serialized GraphDef into `graph`'s C graph alone: the session runs that, and the
    Python Operation objects tf.graph_util.import_graph_def would make (most of its time) are
    never used. `inputs` maps tensor names the GraphDef reads from outside it to (TF_Operation,
    output index) of `graph`; `controls`, control inputs from outside to TF_Operations. Returns
    the TF_Operations of the nodes named in `returns`."""
    from tensorflow.python.client import pywrap_tf_session as c_api
    from tensorflow.python.framework import c_api_util

    options = c_api_util.ScopedTFImportGraphDefOptions()
    c_api.TF_ImportGraphDefOptionsSetValidateColocationConstraints(options.options, False)
    for name, (operation, index) in inputs.items():
        source, _, source_index = name.partition(":")
        c_api.TF_ImportGraphDefOptionsAddInputMapping(
            options.options, source, int(source_index or 0), c_api_util.tf_output(operation, index))
    for name, operation in controls.items():
        c_api.TF_ImportGraphDefOptionsRemapControlDependency(options.options, name, operation)
    for name in returns or []:
        c_api.TF_ImportGraphDefOptionsAddReturnOperation(options.options, name)
    buffer = c_api.TF_NewBufferFromString(graph_def)
    try:
        with graph._c_graph.get() as c_graph:
            results = c_api_util.ScopedTFImportGraphDefResults(
                c_api.TF_GraphImportGraphDefWithResults(c_graph, buffer, options.options))
        return list(c_api.TF_ImportGraphDefResultsReturnOperations(results.results)) if returns else []
    finally:
        c_api.TF_DeleteBuffer(buffer)


def operations(graph: Any) -> dict[str, Any]:
    """Name -> TF_Operation of every op in `graph`'s C graph."""
    from tensorflow.python.client import pywrap_tf_session as c_api

    found: dict[str, Any] = {}
    with graph._c_graph.get() as c_graph:
        position = 0
        while True:
            operation, position = c_api.TF_GraphNextOperation(c_graph, position)
            if operation is None:
                return found
            found[c_api.TF_OperationName(operation)] = operation
