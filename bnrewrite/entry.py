"""`bnrewrite.rewrite_graph` as users call it, above both the API and the session layer.

`rewrite_graph(g, in_place=True)` on a tf.Graph is a promise about sessions (every session
created on `g` afterwards runs the rewritten graph), so it goes to the session layer
(`bnrewrite.session.sessions`); everything else is a rewrite of protobufs (`bnrewrite.rewrite.api`), which knows
nothing of sessions. The arguments and the docstring are the API's.
"""

from __future__ import annotations

import functools
from typing import Any

from bnrewrite.rewrite import api
from bnrewrite.session import sessions


@functools.wraps(api.rewrite_graph)
def rewrite_graph(graph: Any, *args: Any, **kwargs: Any) -> api.RewriteResult:
    if kwargs.get("in_place") and api.is_tf_graph(graph):
        return sessions.rewrite_in_place(graph, *args, **kwargs)
    return api.rewrite_graph(graph, *args, **kwargs)
