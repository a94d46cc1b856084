"""Back to a runnable graph after `rewrite_graph`: a tf.Graph, and the user's handles in it.

The rewrite works on protobufs, so its result is a GraphDef/MetaGraphDef; a user who called
`rewrite_graph(g)` before creating the session holds Operations, Tensors and Variables of
`g`. `to_graph` imports the rewritten MetaGraphDef into a new graph (collections, the saver
and variables as the MetaGraphDef records them, so `Saver`, `global_variables_initializer`,
`MonitoredTrainingSession` and existing checkpoints work), and `find` maps the old handles to
the new graph's by name: every node the rewrite kept keeps its name.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from bnrewrite.errors import BnRewriteError, ForeignGraphError, RemovedByRewriteError


def to_graph(graph_def: Any, meta_graph_def: Any) -> Any:
    """A new tf.Graph holding the rewritten graph: from the MetaGraphDef when there is one
    (collections, savers, variables), else from the GraphDef alone (nodes only)."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        if meta_graph_def is not None:
            tf.compat.v1.train.import_meta_graph(meta_graph_def, clear_devices=False)
        else:
            tf.graph_util.import_graph_def(graph_def, name="")
    return graph


def find(graph: Any, handles: Any, removed: dict[str, str], built: Container[Any]) -> Any:
    """`handles` (an Operation, Tensor, Variable or name, or lists, tuples and dicts of them)
    with each replaced by its counterpart in `graph`; `removed`: node -> why the rewrite removed
    it, for the error a handle to such a node raises. `graph` must be one of `built` (the graphs
    the result's `to_graph` made): in any other graph, the input graph above all, every name
    would resolve to itself and the user would go on training the un-synchronized graph."""
    import tensorflow as tf

    if graph not in built:
        raise ForeignGraphError(
            f"find() maps handles into a graph made by this result's to_graph(), not a {type(graph).__name__} "
            "from elsewhere (the input graph would give the un-synchronized ops back); call graph = result.to_graph() "
            "and pass that graph")

    variables = {v.name: v for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
                 for v in graph.get_collection(key)}

    def counterpart(handle: Any) -> Any:
        if isinstance(handle, tf.Variable):
            if handle.name not in variables:
                raise BnRewriteError(f"variable {handle.name} is in no variable collection of the rewritten graph; "
                                     "rewrite a tf.Graph or MetaGraphDef (a GraphDef carries no collections)")
            return variables[handle.name]
        if isinstance(handle, (tf.Operation, tf.Tensor)):
            name = handle.name
        elif isinstance(handle, str):
            name = handle
        else:
            raise BnRewriteError(f"cannot map a {type(handle).__name__} to the rewritten graph; "
                                 "pass Operations, Tensors, Variables or their names")
        node = name.lstrip("^").split(":")[0]
        if node in removed:
            raise RemovedByRewriteError(f"{name} was removed by the rewrite ({removed[node]}); fetch the train op instead")
        try:
            return graph.as_graph_element(name)
        except (KeyError, ValueError) as exc:
            raise BnRewriteError(f"{name} is not in the rewritten graph ({exc})") from None

    return tf.nest.map_structure(counterpart, handles)
