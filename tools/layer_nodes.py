"""Nodes a synchronized layer adds, per batch-norm site (layer x tower), by layer form and backend.

    python tools/layer_nodes.py [--towers 2] [--forms all|NAME,...] [--backends local,collective,nccl]
                                [--deep 8x20] [--inception IMAGE] [--json FILE]

For each form (examples/towers_model.py's two conv+BN layers per tower: the fused op and the
legacy layer, NHWC (the fused kernels) and NCHW (elementwise passes), float32 and float16, a
batch of static or unknown size, `tf.nn.moments` layers, a v2 cond)
and backend, the graph is built with K towers on K virtual CPUs, rewritten, and measured as
the training step sees it:

  graph    nodes the train op needs in the GraphDef (TensorFlow's own pruning of the fetches:
           tf.compat.v1.graph_util.extract_sub_graph), constants counted apart; function bodies
           are not counted (a cond v2 layer's nodes live there: see its step column)
  step     nodes of the partition graphs one traced step ran (after Grappler: pruning,
           constant folding, remapping), and of those the ops that launch a kernel (not Const,
           Identity, IdentityN, NoOp, Send, Recv, Shape, Reshape, ReadVariableOp, _Arg, _Retval:
           the GPU launch proxy of issue 50)

each as the rewritten graph's figure less the as-built one's, divided by the number of sites.
NCCL graphs cannot run on CPU: their step columns come from the same graph with each
NcclAllReduce group run as one CollectiveReduceV2 (tests/nccl_on_cpu.py), a like-for-like count
of everything else (NCHW forms left out: on /gpu:k towers_model convolves NCHW, which has no CPU
kernel). `--deep TxL` adds tools/deep_net.py's T towers x L fused conv+BN layers
(local backend), where constants pooled per device weigh little per site; `--inception 107`
tools/inception_train.py's InceptionV3 trainer (188 sites a tower). The figures are
counts, the same on every machine of one TensorFlow version; issue 50's target is <= 16 net
step nodes per site and <= 2.0 x the as-built kernel launches per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "tests")]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

import towers_model  # noqa: E402
from bnrewrite import BackendError, rewrite_graph  # noqa: E402
from nccl_on_cpu import nccl_to_cpu  # noqa: E402

tf1 = tf.compat.v1
#: Ops that launch no kernel of their own on a GPU (bookkeeping, views, transfers).
NO_KERNEL = frozenset({"Const", "HostConst", "Identity", "IdentityN", "NoOp", "Send", "Recv", "_Send", "_Recv",
                       "_HostSend", "_HostRecv", "Shape", "Reshape", "ReadVariableOp", "_Arg", "_Retval",
                       "VarHandleOp", "Placeholder", "PlaceholderWithDefault"})
Spec = towers_model.Spec
#: name -> how towers_model builds it (towers and device filled in per run).
FORMS = {
    "fused NHWC f32": Spec(layer="fused_op"),
    "fused NHWC f32 unknown batch": Spec(layer="fused_op", uneven=True),
    "fused NCHW f32": Spec(layer="fused_op", data_format="NCHW"),
    "fused NHWC f16": Spec(layer="fused_op", dtype="float16"),
    "legacy NHWC f32": Spec(layer="legacy"),
    "legacy cond v2": Spec(layer="legacy_cond_v2"),
    "moments f32": Spec(layer="legacy_unfused"),
    "moments unknown batch": Spec(layer="legacy_unfused", uneven=True),
}


@dataclass(frozen=True)
class Count:
    graph: int  # nodes the train op needs, constants excluded
    constants: int
    step: int  # partition-graph nodes one step ran
    launches: int  # of those, ops that launch a kernel


def count(graph_def: tf1.GraphDef, fetches: list[str], feeds: dict[str, object], towers: int, init: str) -> Count:
    """What the training step needs and runs of `graph_def` (its NCCL all-reduces run as collectives)."""
    needed = tf1.graph_util.extract_sub_graph(graph_def, [f.split(":")[0] for f in fetches])
    constants = sum(n.op in ("Const", "HostConst") for n in needed.node)
    runnable = nccl_to_cpu(graph_def)  # /gpu:k -> /cpu:k; each NCCL group one CollectiveReduceV2
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(runnable, name="")
    options = tf1.RunOptions(output_partition_graphs=True)
    metadata = tf1.RunMetadata()
    with tf1.Session(graph=graph, config=towers_model.session_config(towers)) as session:
        session.run(init)
        session.run(fetches, feeds, options=options, run_metadata=metadata)
    ran = [n for g in metadata.partition_graphs for n in g.node]
    return Count(len(needed.node) - constants, constants, len(ran), sum(n.op not in NO_KERNEL for n in ran))


def row(form: str, backend: str, sites: int, a: Count, b: Count) -> dict[str, object]:
    """The rewritten graph's counts `b` less the as-built ones `a`, per site; launches as a ratio."""
    return {
        "form": form, "backend": backend, "sites": sites,
        "graph": (b.graph - a.graph) / sites, "constants": (b.constants - a.constants) / sites,
        "step": (b.step - a.step) / sites, "launches": (b.launches - a.launches) / sites,
        "launch_ratio": b.launches / a.launches,
    }


def measure(name: str, spec: Spec, backend: str, towers: int) -> dict[str, object]:
    """One row: the form's as-built and rewritten counts, per site."""
    device = "gpu" if backend == "nccl" else "cpu"
    spec = replace(spec, towers=towers, device=device)
    built = towers_model.build_towers(spec)
    images, labels = towers_model.make_batches(spec, 1)[0]
    per = len(images) // towers
    feeds = {}
    for k, (x, y) in enumerate(built.inputs):
        feeds[x] = images[k * per:(k + 1) * per]
        feeds[y] = labels[k * per:(k + 1) * per]
    if built.global_batch:
        feeds[built.global_batch] = float(len(images))
    fetches = [built.train_op]
    before = built.graph.as_graph_def()
    result = rewrite_graph(built.graph, backend=backend)
    after = result.graph_def
    sites = len(result.report.layers) * towers
    a = count(before, fetches, feeds, towers, built.init)
    b = count(after, fetches, feeds, towers, built.init)
    return row(name, backend, sites, a, b)


def measure_deep(towers: int, layers: int) -> dict[str, object]:
    """tools/deep_net.py's T x L fused graph, local backend."""
    import deep_net
    import numpy as np

    graph = deep_net.build_graph(towers, layers)
    rng = np.random.RandomState(0)
    feeds = {}
    for k in range(towers):
        feeds[f"tower_{k}/images:0"] = rng.normal(size=(2, 4, 4, 3)).astype(np.float32)
        feeds[f"tower_{k}/labels:0"] = rng.randint(0, 10, 2).astype(np.int32)
    before = graph.as_graph_def()
    result = rewrite_graph(graph)
    sites = len(result.report.layers) * towers
    init = next(n.name for n in before.node if n.name.startswith("init") and n.op == "NoOp")
    a = count(before, ["train_op"], feeds, towers, init)
    b = count(result.graph_def, ["train_op"], feeds, towers, init)
    return row(f"deep_net {towers}x{layers} fused", "local", sites, a, b)


def measure_inception(towers: int, image: int) -> dict[str, object]:
    """tools/inception_train.py's InceptionV3 trainer (batch 2 a tower), local backend."""
    import inception_train
    import numpy as np

    graph = tf.Graph()
    with graph.as_default():
        train_op, _, inputs = inception_train.build(towers, 2, image)
        init = tf1.global_variables_initializer().name
    rng = np.random.RandomState(0)
    feeds = {}
    for x, y in inputs:
        feeds[x.name] = rng.standard_normal(x.shape.as_list()).astype(np.float32)
        feeds[y.name] = rng.randint(0, 10, 2).astype(np.int32)
    before = graph.as_graph_def()
    result = rewrite_graph(graph)
    sites = len(result.report.layers) * towers
    a = count(before, [train_op.name], feeds, towers, init)
    b = count(result.graph_def, [train_op.name], feeds, towers, init)
    return row(f"InceptionV3 {towers} towers", "local", sites, a, b)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--towers", type=int, default=2)
    parser.add_argument("--forms", default="all", help=f"all, or some of: {'; '.join(FORMS)} (comma-separated)")
    parser.add_argument("--backends", default="local,collective,nccl")
    parser.add_argument("--deep", default="8x20", help="TxL of tools/deep_net.py, or '' for none")
    parser.add_argument("--inception", type=int, default=0, metavar="IMAGE",
                        help="also tools/inception_train.py's trainer on IMAGExIMAGE images (e.g. 107)")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args(argv)
    tf1.disable_eager_execution()
    names = list(FORMS) if args.forms == "all" else [f.strip() for f in args.forms.split(",")]
    # NCCL towers are built on /gpu:k, where towers_model convolves NCHW data as NCHW: no CPU kernel.
    rows, missing = [], []
    for name in names:
        for backend in args.backends.split(","):
            if backend == "nccl" and FORMS[name].data_format == "NCHW":
                continue
            try:
                rows.append(measure(name, FORMS[name], backend, args.towers))
            except BackendError as e:  # the local sum cannot reach into a cond v2 branch
                missing.append(f"{name}, {backend}: {e}")
    if args.deep:
        towers, layers = map(int, args.deep.split("x"))
        rows.append(measure_deep(towers, layers))
    if args.inception:
        rows.append(measure_inception(args.towers, args.inception))
    print(f"net nodes added per synced site (layer x tower), TensorFlow {tf.__version__}, {args.towers} towers")
    print(f"{'form':28} {'backend':10} {'sites':>5} {'graph':>6} {'consts':>6} {'step':>6} {'launch':>6} "
          f"{'launches x built':>16}")
    for r in rows:
        print(f"{r['form']:28} {r['backend']:10} {r['sites']:5d} {r['graph']:6.1f} {r['constants']:6.1f} "
              f"{r['step']:6.1f} {r['launches']:6.1f} {r['launch_ratio']:16.2f}")
    for line in missing:
        print(f"not measured: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
