"""An independent structural oracle for rewritten graphs, on networkx.

Written apart from bnrewrite's own graph code (bnrewrite/graph/index.py): it reads a GraphDef's
NodeDefs itself, builds a networkx DiGraph of data and control edges, and answers questions
about the graph's shape that the numeric oracle (tests/models.py) cannot see, such as the
order in which towers launch their all-reduces or which updates a fetch runs:

    load(graph_def) -> nx.DiGraph            nodes carry "op", "device", "attrs" (names only), "inputs"
    assert_acyclic(graph_def)
    collective_order(graph_def) -> {device: [instance keys in launch order]}
    assert_scale_read_before_its_gradient(graph_def, gradient_ops)
    updates_reached(graph_def, target) -> {variable name: number of updates target runs}

Only the top-level graph is read: nodes inside function bodies (v2 branches) are not seen.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import networkx as nx

#: The attr bnrewrite puts on every all-reduce it adds (bnrewrite.rewrite.collectives.INSTANCE_ATTR),
#: restated here so that this module shares no code with the package.
INSTANCE_ATTR = "_bnrewrite_instance"
#: All-reduces that meet by keys across devices: the ones whose launch order matters.
KEYED_COLLECTIVES = frozenset({"CollectiveReduceV2", "NcclAllReduce"})
#: Ops that pass a variable (handle or reference) through unchanged, on the way to an update.
_PASS_THROUGH = frozenset({"Identity", "Switch", "RefSwitch", "Enter", "RefEnter", "Merge", "RefMerge"})
_VARIABLE_OPS = frozenset({"VarHandleOp", "VariableV2", "Variable", "_VarHandlesOp"})


def _source(spec: str) -> tuple[str, bool]:
    """("node", is_control) of one NodeDef input string ("^node", "node:1", "node")."""
    control = spec.startswith("^")
    name = spec[1:] if control else spec
    if ":" in name:
        name = name.rsplit(":", 1)[0]
    return name, control


def load(graph_def) -> nx.DiGraph:
    """The graph's nodes and edges (src -> dst, "control" True for ^inputs) as a DiGraph."""
    graph = nx.DiGraph()
    for node in graph_def.node:
        graph.add_node(node.name, op=node.op, device=node.device, attrs=frozenset(node.attr),
                       inputs=list(node.input), instance=node.attr[INSTANCE_ATTR].i if INSTANCE_ATTR in node.attr else None)
    for node in graph_def.node:
        for spec in node.input:
            src, control = _source(spec)
            assert src in graph, f"{node.name} reads {spec}, which is not in the graph"
            if graph.has_edge(src, node.name):
                graph.edges[src, node.name]["control"] &= control
            else:
                graph.add_edge(src, node.name, control=control)
    return graph


def _as_graph(graph_or_def) -> nx.DiGraph:
    return graph_or_def if isinstance(graph_or_def, nx.DiGraph) else load(graph_or_def)


def assert_acyclic(graph_def) -> None:
    graph = _as_graph(graph_def)
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        raise AssertionError(f"the graph has a cycle: {' -> '.join(src for src, _ in cycle)}")


def collective_order(graph_def, ops: Iterable[str] = KEYED_COLLECTIVES) -> dict[str, list[int]]:
    """Each device's keyed all-reduces (instance keys) in the one order its edges impose.

    Fails unless, on every device, each all-reduce is an ancestor of the next: the executor
    is then not free to launch them in another order. The caller compares the lists across
    devices."""
    graph = _as_graph(graph_def)
    ops = frozenset(ops)
    by_device: dict[str, list[str]] = {}
    for name in nx.topological_sort(graph):
        data = graph.nodes[name]
        if data["op"] in ops and data["instance"] is not None:
            by_device.setdefault(data["device"], []).append(name)
    order = {}
    for device, names in by_device.items():
        for before, after in zip(names, names[1:]):
            assert nx.has_path(graph, before, after), (
                f"on {device}, {after} does not wait for {before}: the executor may launch them in either order")
        order[device] = [graph.nodes[n]["instance"] for n in names]
    return order


def assert_scale_read_before_its_gradient(graph_def, gradient_ops: Iterable[str]) -> int:
    """Each rewritten fused gradient op (an IdentityN of dx, d(scale), d(offset), ...): every node
    in its scope that reads a variable reaches d(scale) by data edges alone, as the fused kernel
    read the scale and gave d(scale) in one op. A reference variable's read aliases the buffer that
    the update fed by d(scale) writes in place, and Grappler keeps no order that only control edges
    give. Returns how many gradient ops were checked."""
    graph = _as_graph(graph_def)
    data = nx.DiGraph((src, dst) for src, dst, edge in graph.edges(data=True) if not edge["control"])
    checked = 0
    for name in gradient_ops:
        node = graph.nodes[name]
        assert node["op"] == "IdentityN", f"{name} is a {node['op']}, not the rewrite's IdentityN"
        dscale, scope = _source(node["inputs"][1])[0], name.rsplit("/", 1)[0] + "/"
        readers = [n for n in graph if n.startswith(scope) and any(
            _reads_variable(graph, spec) for spec in graph.nodes[n]["inputs"] if not spec.startswith("^"))]
        assert readers, f"{name}: nothing in {scope} reads a variable"
        for reader in readers:
            assert reader == dscale or (reader in data and dscale in data and nx.has_path(data, reader, dscale)), \
                f"{name}: {reader} reads a variable after d(scale) ({dscale}) may have updated it"
        checked += 1
    return checked


def _reads_variable(graph: nx.DiGraph, spec: str) -> bool:
    """Whether input `spec` is a variable's value: a ReadVariableOp's, or a reference variable's
    through pass-through ops."""
    source = _source(spec)[0]
    return graph.nodes[source]["op"] == "ReadVariableOp" or graph.nodes[_variable(graph, source)]["op"] in _VARIABLE_OPS


def _variable(graph: nx.DiGraph, name: str) -> str:
    """The variable node an update's input 0 leads to, through pass-through ops."""
    seen = set()
    while graph.nodes[name]["op"] not in _VARIABLE_OPS:
        if graph.nodes[name]["op"] not in _PASS_THROUGH or name in seen:
            return name  # a handle from something else (e.g. a function output): name it as it is
        seen.add(name)
        name = _source(graph.nodes[name]["inputs"][0])[0]
    return name


def is_update(op: str) -> bool:
    """Ops that write a variable: Assign, AssignSub, AssignAddVariableOp, ..., and optimizers'
    Apply*/ResourceApply* (which write input 0)."""
    return op.startswith(("Assign", "Apply", "ResourceApply"))


def updates_reached(graph_def, target: str) -> dict[str, int]:
    """Variable name -> how many update ops of it run when `target` (a node name, or a tensor
    name "node:0") is fetched: the updates among target's ancestors (data and control edges),
    target included."""
    graph = _as_graph(graph_def)
    node = _source(target)[0]
    reached = nx.ancestors(graph, node) | {node}
    counts = Counter(_variable(graph, _source(graph.nodes[n]["inputs"][0])[0])
                     for n in reached if is_update(graph.nodes[n]["op"]))
    return dict(counts)
