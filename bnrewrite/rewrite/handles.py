"""Back to a runnable graph after `rewrite_graph`: a tf.Graph, and the user's handles in it.

The rewrite works on protobufs, so its result is a GraphDef/MetaGraphDef; a user who called
`rewrite_graph(g)` before creating the session holds Operations, Tensors and Variables of
`g`. `to_graph` imports the rewritten MetaGraphDef into a new graph: its nodes, collections
and variables, and nothing else (no default `save/` Saver is added, so one the script builds
afterwards gets the names it would have had). `find` maps the old handles to the new graph's by
name, every node the rewrite kept keeping its name; a `Saver` maps to one over the same save
and restore ops (its SaverDef names them), so existing checkpoints restore.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from bnrewrite.errors import BnRewriteError, ForeignGraphError, RemovedByRewriteError


def to_graph(graph_def: Any, meta_graph_def: Any) -> Any:
    """A new tf.Graph holding the rewritten graph: from the MetaGraphDef when there is one
    (collections, variables), else from the GraphDef alone (nodes only). TensorFlow's
    import_meta_graph would add a default Saver to a MetaGraphDef without a saver_def (what
    a tf.Graph's export has): the lower-level import adds nothing."""
    import tensorflow as tf
    from tensorflow.python.framework import meta_graph

    graph = tf.Graph()
    with graph.as_default():
        if meta_graph_def is not None:
            meta_graph.import_scoped_meta_graph(meta_graph_def, clear_devices=False)
        else:
            tf.graph_util.import_graph_def(graph_def, name="")
    return graph


def find(graph: Any, handles: Any, removed: dict[str, str], built: Container[Any]) -> Any:
    """`handles` (an Operation, Tensor, Variable, Saver or name, or lists, tuples and dicts of them)
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
        if isinstance(handle, tf.compat.v1.train.Saver):
            saver_def = handle.as_saver_def()
            for name in (saver_def.save_tensor_name, saver_def.restore_op_name, saver_def.filename_tensor_name):
                counterpart(name)  # raises if the rewrite removed one
            with graph.as_default():
                return tf.compat.v1.train.Saver(saver_def=saver_def)
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
                                 "pass Operations, Tensors, Variables, Savers or their names")
        node = name.lstrip("^").split(":")[0]
        if node in removed:
            raise RemovedByRewriteError(f"{name} was removed by the rewrite ({removed[node]}); fetch the train op instead")
        try:
            return graph.as_graph_element(name)
        except (KeyError, ValueError) as exc:
            raise BnRewriteError(f"{name} is not in the rewritten graph ({exc})") from None

    return tf.nest.map_structure(counterpart, handles)
