"""The rewrite's work grows linearly with the graph, in layers and in towers.

Work is counted, never timed: the Python function calls of one rewrite (cProfile), which
are the same on every machine. A cost that grows faster than the graph (a scan of every
tower per tower, a search of the whole graph per layer) adds more calls from 8 to 16 layers
than twice those from 4 to 8. The counts are exact, so the tolerance is tight: one extra node
lookup per site per layer (or per tower) already fails. The graphs' train op reaches every
tower's moving-average updates through one group per tower, the wiring whose edges to
removed duplicates dedupe re-points (deep_net's updates="per_tower"). Reachability walks
(`Graph.depends_on`, `Graph.ancestors_among`), each of which can cost a walk of the graph,
are counted on their own: their number must not grow with the graph at all.
tools/bench_rewrite.py prints the same count for big graphs.
"""

from __future__ import annotations

import cProfile
import functools
import os
import pstats
import sys

import pytest

_TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
if _TOOLS not in sys.path:
    sys.path.insert(0, _TOOLS)

import deep_net  # noqa: E402
from bench_rewrite import count_walks  # noqa: E402

from bnrewrite import rewrite_graph  # noqa: E402

SERIES = [
    pytest.param([(2, 4), (2, 8), (2, 16)], id="layers"),
    pytest.param([(2, 3), (4, 3), (8, 3)], id="towers"),
]


@functools.cache
def _profile(towers: int, layers: int) -> pstats.Stats:
    graph_def = deep_net.build_graph_def(towers, layers, updates="per_tower")
    rewrite_graph(graph_def)  # imports and caches filled before counting
    profile = cProfile.Profile()
    result = profile.runcall(rewrite_graph, graph_def)
    assert len(result.report.layers) == layers and len(result.report.towers) == towers
    return pstats.Stats(profile)


@pytest.mark.parametrize("series", SERIES)
def test_work_grows_linearly(series):
    small, middle, big = (_profile(*config).total_calls for config in series)  # type: ignore[attr-defined]
    first, second = middle - small, big - middle  # the second step doubles the graph's growth
    assert first > 0
    assert second / (2 * first) == pytest.approx(1.0, abs=1e-3), (small, middle, big)


@pytest.mark.parametrize("series", SERIES)
def test_reachability_walks_do_not_grow(series):
    """One walk shared by every re-pointed edge, not one per edge (issue 33: 1,400 walks on
    the 8 x 100 graph, half the rewrite's time)."""
    walks = [count_walks(_profile(*config)) for config in series]
    assert walks[0] > 0 and len(set(walks)) == 1, walks
