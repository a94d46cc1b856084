"""The rewrite's work grows linearly with the graph, in layers and in towers.

Work is counted, never timed: the Python function calls of one rewrite (cProfile), which
are the same on every machine. A cost that grows faster than the graph (a scan of every
tower per tower, a search of the whole graph per layer) adds more calls from 8 to 16 layers
than twice those from 4 to 8. The counts are exact, so the tolerance is tight: one extra node
lookup per site per layer (or per tower) already fails. tools/bench_rewrite.py prints the
same count for big graphs.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys

import pytest

_TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
if _TOOLS not in sys.path:
    sys.path.insert(0, _TOOLS)

import deep_net  # noqa: E402

from bnrewrite import rewrite_graph  # noqa: E402


def _calls(towers: int, layers: int) -> int:
    graph_def = deep_net.build_graph_def(towers, layers)
    rewrite_graph(graph_def)  # imports and caches filled before counting
    profile = cProfile.Profile()
    result = profile.runcall(rewrite_graph, graph_def)
    assert len(result.report.layers) == layers and len(result.report.towers) == towers
    return pstats.Stats(profile).total_calls  # type: ignore[attr-defined]


@pytest.mark.parametrize("series", [
    pytest.param([(2, 4), (2, 8), (2, 16)], id="layers"),
    pytest.param([(2, 3), (4, 3), (8, 3)], id="towers"),
])
def test_work_grows_linearly(series):
    small, middle, big = (_calls(*config) for config in series)
    first, second = middle - small, big - middle  # the second step doubles the graph's growth
    assert first > 0
    assert second / (2 * first) == pytest.approx(1.0, abs=1e-3), (small, middle, big)
