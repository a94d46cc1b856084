"""The rewrite passes, in the order they run, and the loop that validates after each.

May import: the rest of bnrewrite.rewrite (plan, statistics, collectives, functions), bnrewrite.match,
bnrewrite.graph, bnrewrite.errors.
"""

from __future__ import annotations

import time
from typing import Callable

from bnrewrite.errors import GraphValidationError, PassError
from bnrewrite.graph.index import Graph
from bnrewrite.rewrite.passes.dedupe_moving_averages import dedupe_moving_averages
from bnrewrite.rewrite.passes.order_collectives import order_collectives
from bnrewrite.rewrite.passes.record import PassRecord
from bnrewrite.rewrite.passes.sync_backward import sync_backward
from bnrewrite.rewrite.passes.sync_forward import sync_forward
from bnrewrite.rewrite.passes.sync_moments_backward import sync_moments_backward
from bnrewrite.rewrite.passes.sync_moments_forward import sync_moments_forward
from bnrewrite.rewrite.plan import Plan

Pass = Callable[[Graph, Plan], tuple[Graph, PassRecord]]

PIPELINE: tuple[Pass, ...] = (
    sync_forward, sync_backward, sync_moments_forward, sync_moments_backward, dedupe_moving_averages, order_collectives,
)


def run_passes(graph: Graph, plan: Plan, passes: tuple[Pass, ...] = PIPELINE) -> tuple[Graph, list[PassRecord]]:
    records = []
    for step in passes:
        start = time.perf_counter()
        result, record = step(graph, plan)
        try:
            result.validate()
        except GraphValidationError as exc:
            raise PassError(f"pass {record.name} produced an invalid graph: {exc} (a bnrewrite bug; please report it)") from exc
        if result is not graph:
            graph.drop_indexes()  # the next pass builds on `result`'s
        graph = result
        record.seconds = time.perf_counter() - start
        records.append(record)
    return graph, records
