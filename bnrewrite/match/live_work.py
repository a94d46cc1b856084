"""Only live work is a tower: batch norms that no training step runs are not rewritten.

A Keras functional model is built by calling its layers on its own `Input` placeholder; that
call stays in the graph beside the per-tower calls, with no device, no gradient and nothing that
trains reading it (its moving-average updates are never run). Likewise an unused branch or a
dead copy. Taken for a tower, such a copy is one that "does not line up"; synchronized, it would
wait forever for a member that never runs.

A site is live when it runs before something a gradient step runs: the nodes downstream (data
or control edges) of any batch-norm gradient are the step's work (apply ops, the train op's
group), and a live site is upstream of one of them. A graph without gradients gives no such
evidence (forward-only graphs): every site counts as live there.

Invariant: a site with a gradient of its own is always live. Two walks over the graph, linear.
"""

from __future__ import annotations

from bnrewrite.graph import Graph
from bnrewrite.names import parse_input
from bnrewrite.match.census import Site, Skip
from bnrewrite.nodes import outer_node

NOT_RUN = ("no training step runs it (nothing downstream of a gradient depends on it: e.g. the call that built a "
           "Keras model on its own Input, an unused branch or copy); not a tower, left as it is")


def not_run(graph: Graph, sites: list[Site]) -> list[Skip]:
    """The sites no gradient step runs, each with why (empty when the graph has no gradients)."""
    grads = {outer_node(g) for s in sites for g in (*s.grads, *s.variance_grads)}
    if not grads:
        return []
    step = graph.downstream(grads)
    live, stack = set(step), list(step)
    while stack:
        for spec in graph.node(stack.pop()).input:
            src = parse_input(spec)[0]
            if src not in live:
                live.add(src)
                stack.append(src)
    return [Skip(s.name, NOT_RUN) for s in sites if outer_node(s.name) not in live]
