"""A MetaGraphDef's collections after a rewrite removed nodes: every name they hold still names
a node, so that `import_meta_graph` (and a SavedModel's loader) rebuilds them.

Two kinds of collection name nodes: lists of names (`node_list`: update_ops, train_op,
summaries...) and the v1 control-flow contexts (`cond_context`, `while_context`: serialized
CondContextDef / WhileContextDef, which TensorFlow's import turns back into the Python context
objects, looking up every tensor they name). The rewrite removes duplicate moving-average
updates whole, a v1 `tf.cond` of theirs included (the legacy layer's momentum under a
`training` tensor), so both kinds may name removed nodes.
"""

from __future__ import annotations

from typing import Any

from tensorflow.core.protobuf import control_flow_pb2, meta_graph_pb2

from bnrewrite.graph.names import parse_input

#: The collections whose items are serialized control-flow contexts, and their proto types.
CONTEXT_COLLECTIONS = {"cond_context": control_flow_pb2.CondContextDef,
                       "while_context": control_flow_pb2.WhileContextDef}
#: What `prune_context` did to a context.
INTACT, PRUNED, DROPPED = "intact", "pruned", "dropped"


def drop_removed(meta: meta_graph_pb2.MetaGraphDef, removed: set[str], log: list[tuple[Any, list[Any]]]) -> None:
    """Take every name of a node in `removed` out of `meta`'s collections (`prune_context`
    for the contexts); `log` gets each changed list and its values before. Items untouched
    keep their bytes."""
    if not removed:
        return
    for key, collection in meta.collection_def.items():
        kind = collection.WhichOneof("kind")
        if kind == "node_list":
            values = collection.node_list.value
            kept = [v for v in values if parse_input(v)[0] not in removed]
        elif kind == "bytes_list" and key in CONTEXT_COLLECTIONS:
            values = collection.bytes_list.value
            kept = []
            for data in values:
                context = CONTEXT_COLLECTIONS[key].FromString(data)
                state = prune_context(context, removed)
                if state != DROPPED:
                    kept.append(data if state == INTACT else context.SerializeToString())
        else:
            continue
        if kept != list(values):
            log.append((values, list(values)))
            del values[:]
            values.extend(kept)


def prune_context(context: Any, removed: set[str]) -> str:
    """Take the names of removed nodes out of a CondContextDef or WhileContextDef, in place:
    INTACT (it named none), PRUNED, or DROPPED (the caller drops it).

    A context whose pred or pivot (a loop's three pivots or its maximum_iterations) was removed
    cannot be rebuilt, and what ran under it went with it (every node of a branch waits on its
    pivot, and a node whose input is removed is removed): it is DROPPED, nested contexts
    included. Otherwise removed names leave its `values`, its `external_values` (an entry goes
    when its outer tensor or the inner tensor standing for it was removed, and then its outer
    name leaves `values` too, or the import would put that outer op inside the context), a
    loop's enters and exits, and its nested contexts (recursively, dropped as above).
    """
    def gone(name: str) -> bool:
        return bool(name) and parse_input(name)[0] in removed

    is_cond = isinstance(context, control_flow_pb2.CondContextDef)
    anchors = ((context.pred_name, context.pivot_name) if is_cond else
               (context.pivot_name, context.pivot_for_pred_name, context.pivot_for_body_name,
                context.maximum_iterations_name))
    if any(gone(name) for name in anchors):
        return DROPPED
    external = context.values_def.external_values
    stale = {k for k, v in external.items() if gone(k) or gone(v)}
    for key in stale:
        del external[key]
    changed = _keep(context.values_def.values, lambda v: v not in stale and not gone(v)) or bool(stale)
    if not is_cond:
        changed = _keep(context.loop_exit_names, lambda n: not gone(n)) | changed
        changed = _keep(context.loop_enter_names, lambda n: not gone(n)) | changed
    states = [prune_context(getattr(w, w.WhichOneof("ctxt")), removed) for w in context.nested_contexts]
    if DROPPED in states:
        kept = [w for w, state in zip(context.nested_contexts, states) if state != DROPPED]
        del context.nested_contexts[:]
        context.nested_contexts.extend(kept)
    return PRUNED if changed or any(state != INTACT for state in states) else INTACT


def _keep(names: Any, wanted: Any) -> bool:
    """Keep the names of a repeated string field that `wanted` accepts; True if any went."""
    kept = [n for n in names if wanted(n)]
    if len(kept) == len(names):
        return False
    del names[:]
    names.extend(kept)
    return True
