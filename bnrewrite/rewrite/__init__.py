"""The rewrite on protobufs: the plan every pass follows (groups, backend, keys), the
all-reduce ops, `passes/` and the global statistics they build, control flow v2 bodies, the
check that a rewrite kept what the graph does (`meaning`), and `api.rewrite_graph`, which runs
them as one transaction and reports; the user's handles and collections afterwards; `check`.

It knows nothing of sessions. May import: bnrewrite.match, bnrewrite.graph, bnrewrite.errors.
"""
