"""The worst error against one device fed the whole batch, per layer form and backend.

    python tools/error_table.py [--steps 5] [--backends local,collective] [--forms all|NAME,...]

For each form (examples/towers_model.py's layers, data formats, dtypes, tower counts, uneven
towers, renorm), builds the K-tower graph, rewrites it with each backend, trains it on K
virtual CPUs and compares every loss, weight and moving statistic with the one-device run
(`max_rel_error`, the oracle tests' measure); the towers as built, not rewritten, are the
column that must miss. Why: issue 50 asks for the worst error before and after a change of the
synchronized wiring. `bnrewrite` is imported from the path Python finds it on, so
`PYTHONPATH=<checkout> python tools/error_table.py` measures another checkout's rewrite on the
same graphs and data.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from towers_model import Spec, build_reference, build_towers, make_batches, max_rel_error, train  # noqa: E402

from bnrewrite import BackendError, rewrite_graph  # noqa: E402

FORMS = {
    "fused NHWC f32": Spec(layer="fused_op"),
    "fused NCHW f32": Spec(layer="fused_op", data_format="NCHW"),
    "fused NHWC f16": Spec(layer="fused_op", dtype="float16"),
    "fused NHWC bf16": Spec(layer="fused_op", dtype="bfloat16"),
    "fused uneven K3": Spec(towers=3, layer="fused_op", uneven=True),
    "legacy NHWC f32": Spec(layer="legacy"),
    "legacy NCHW f32": Spec(layer="legacy", data_format="NCHW"),
    "legacy NHWC f16 K4": Spec(towers=4, layer="legacy", dtype="float16"),
    "legacy renorm": Spec(layer="legacy", renorm=True),
    "legacy unfused K3": Spec(towers=3, layer="legacy_unfused"),
    "legacy cond v1": Spec(layer="legacy_cond_v1"),
    "legacy cond v2": Spec(layer="legacy_cond_v2"),
    "moments cond v1": Spec(layer="moments_cond_v1"),
    "moments cond v2 uneven K3": Spec(towers=3, layer="moments_cond_v2", uneven=True),
}


def errors(spec: Spec, steps: int, backends: list[str]) -> tuple[list[str], str]:
    """Each backend's worst relative error against one device ("refused" where the backend
    cannot serve the form: local towers inside a cond v2 branch), and the towers' as built."""
    batches = make_batches(spec, steps)
    reference = build_reference(spec)
    expected = train(reference.graph, reference, batches, num_devices=1)
    built = build_towers(spec)
    graph_def = built.graph.as_graph_def()
    synced = []
    for backend in backends:
        try:
            rewritten = rewrite_graph(graph_def, backend=backend).graph_def
        except BackendError:
            synced.append("refused")
            continue
        synced.append(f"{max_rel_error(train(rewritten, built, batches, num_devices=spec.towers), expected):.2e}")
    return synced, f"{max_rel_error(train(graph_def, built, batches, num_devices=spec.towers), expected):.2e}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backends", default="local,collective")
    parser.add_argument("--forms", default="all", help="comma-separated: " + ", ".join(FORMS))
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    names = list(FORMS) if args.forms == "all" else args.forms.split(",")
    print(f"| form | {' | '.join(backends)} | as built |\n|---|{'---:|' * (len(backends) + 1)}", flush=True)
    for name in names:
        synced, unsynced = errors(FORMS[name], args.steps, backends)
        print(f"| {name} | {' | '.join(synced)} | {unsynced} |", flush=True)


if __name__ == "__main__":
    main()
