"""What a synchronized layer costs in nodes stays within its bound (issue 50's node table).

tools/layer_nodes.py measures, per layer form and backend, the nodes the rewrite adds per site
(layer x tower) to the training step as it runs (partition graphs after Grappler), and the
kernel-launching ops among them. The bounds are the figures of 2026-11-29 after the gathered
combine and, for the local backend, its combine built once per layer and its gather by one Pack (TensorFlow 2.21): a change that adds nodes to a synchronized layer fails here and names
the form; one that removes them lowers the bound with it. Issue 50 wants 16 and 2.0 x as built.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

from layer_nodes import FORMS, measure  # noqa: E402

#: (form, backend) -> (step nodes added per site, kernel launches per step x as built), at most.
BOUNDS = {
    ("fused NHWC f32", "local"): (16.75, 1.48),
    ("fused NHWC f32 unknown batch", "collective"): (46.25, 2.57),
    ("fused NCHW f32", "local"): (34.5, 1.82),
    ("fused NHWC f16", "nccl"): (19.75, 1.67),
    ("moments f32", "local"): (20.25, 1.12),
    ("moments unknown batch", "local"): (33.5, 1.33),
}


@pytest.mark.parametrize("form, backend", list(BOUNDS))
def test_nodes_per_synced_site_within_bound(form: str, backend: str):
    row = measure(form, FORMS[form], backend, towers=2)
    nodes, launches = BOUNDS[form, backend]
    print(f"{form}, {backend}: {row['step']:.2f} step nodes per site, {row['launch_ratio']:.3f} x the launches")
    assert row["sites"] == 4 and 0 < row["step"] <= nodes + 1e-9 and 1 < row["launch_ratio"] <= launches + 0.005
