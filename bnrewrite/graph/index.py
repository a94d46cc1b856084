"""The graph model: a thin, read-only index over the nodes of a GraphDef.

A `Graph` maps node names, in graph order, to where their NodeDefs are: in the GraphDef it
was read from (the source) or in the GraphDef its edits append to (the storage). It holds no
per-node Python objects but the names, so indexing a graph of tens of thousands of nodes
costs little memory. Passes never mutate a `Graph`. They make an `Editor(graph)`
(bnrewrite.graph.edit), change it, and `Editor.finish()` returns a new `Graph` over the same source and storage: a
node an edit adds, replaces or changes is appended to the storage and the new graph points
at that copy, so every graph made along the way stays readable and a pass costs what it
changes plus one dict copy. `to_graph_def()` at the end copies the nodes still in the source
into the storage (none when the source is the storage: a GraphDef rewritten in place),
puts the storage in graph order and drops the stale nodes (bnrewrite.graph.assembly). Order,
reachability and validation are in bnrewrite.graph.order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Iterable, Iterator, NamedTuple

from tensorflow.core.framework import graph_pb2, node_def_pb2

from bnrewrite.errors import GraphValidationError, InputFormatError
from bnrewrite.graph.assembly import GraphAssembly, _InPlaceUndo
from bnrewrite.graph.names import parse_input
from bnrewrite.graph.order import GraphOrder

if TYPE_CHECKING:
    from bnrewrite.graph.shapes import Shape, ShapeInference

NodeDef = node_def_pb2.NodeDef

#: A consumer with more inputs than this gets its inputs indexed by producer (see `_edges_of`).
_WIDE = 16
#: A graph of more nodes than this must average at least MIN_NODE_BYTES serialized bytes a
#: node to be indexed: the index costs a roughly fixed amount per node, so a file of millions
#: of near-empty nodes would take many times its size; a real model's nodes (names, op types,
#: inputs, attrs) take several times the floor.
DENSITY_FROM_NODES = 100_000
MIN_NODE_BYTES = 64


class Edge(NamedTuple):
    """One input of `consumer`: slot -1 marks a control edge."""

    consumer: str
    slot: int
    output: int


_DEVICE_RE = re.compile(r"(?:/?device:)?(?P<type>[A-Za-z_]+):(?P<index>\d+|\*)$")


@dataclass(frozen=True, order=True)
class Device:
    """A parsed device string; the parts that tell towers apart."""

    job: str = ""
    replica: int = -1
    task: int = -1
    type: str = ""
    index: int = -1

    @classmethod
    def parse(cls, spec: str) -> "Device":
        fields: dict[str, object] = {}
        for part in spec.strip("/").split("/"):
            if not part:
                continue
            key, _, value = part.partition(":")
            if key in ("job", "replica", "task"):
                if key != "job" and not (value.isascii() and value.isdigit()):
                    raise GraphValidationError(f"device {spec!r} is not a device name: its {key} {value!r} is not a number")
                fields[key] = value if key == "job" else int(value)
                continue
            match = _DEVICE_RE.match(part)
            if match:
                fields["type"] = match["type"].upper()
                index = match["index"]
                fields["index"] = -1 if index == "*" else int(index)
        return cls(**fields)  # type: ignore[arg-type]

    def __str__(self) -> str:
        parts = []
        if self.job:
            parts.append(f"/job:{self.job}")
        if self.replica >= 0:
            parts.append(f"/replica:{self.replica}")
        if self.task >= 0:
            parts.append(f"/task:{self.task}")
        if self.type:
            parts.append(f"/device:{self.type}:{self.index if self.index >= 0 else '*'}")
        return "".join(parts)


def check_density(graph_def: graph_pb2.GraphDef) -> None:
    """Raise InputFormatError for a graph of more than DENSITY_FROM_NODES nodes whose
    serialized size averages less than MIN_NODE_BYTES a node (see there), before any per-node
    Python object is made: what indexing it takes is then bounded by a multiple of its size."""
    count = len(graph_def.node)
    if count <= DENSITY_FROM_NODES:
        return
    size = graph_def.ByteSize()
    if size < count * MIN_NODE_BYTES:
        raise InputFormatError(
            f"the graph has {count:,} nodes in {size:,} bytes ({size / count:.0f} bytes a node); a model's nodes "
            f"(names, op types, inputs, attributes) take at least {MIN_NODE_BYTES} bytes each on average, and "
            "indexing this many near-empty ones would take many times the file's size in memory: "
            "is the file generated or corrupt?")


class Graph(GraphOrder, GraphAssembly):
    """Node names, in GraphDef order, each with where its node is stored, plus lazily built
    indexes.

    A Graph never changes, so its indexes are built at most once; `Editor.finish()` hands the
    new Graph its base's consumer index updated for what the edit touched.
    """

    def __init__(
        self,
        nodes: dict[str, int],
        source: graph_pb2.GraphDef,
        storage: graph_pb2.GraphDef,
        names: dict[str, str],
        library: object = None,
        consumers: dict[str, list[str]] | None = None,
        change: "_Change | None" = None,
        origin: "Graph | None" = None,
    ) -> None:
        self._nodes = nodes  # name -> position: p >= 0 is storage.node[p], p < 0 is source.node[~p]
        self._source = source  # the GraphDef read; never written unless it is the storage
        self._storage = storage  # where edits append the nodes they make
        self._read, self._stored = source.node, storage.node  # the node lists, looked up once
        # Every node name the graphs of this source have had -> one string object for it, which
        # every index uses (a name parsed from an input would be a copy). Not sys.intern: the
        # interpreter's table only grows, and doubles at sizes one cannot choose.
        self._names = names
        self._library = library  # a function library that replaces the source's
        self._consumers = consumers
        self._change = change  # how an edit made this graph, until validate() has used it
        self._numbering: dict[str, int] | None = None  # set by validate(): the graph is valid
        self._wide: dict[str, dict[str, list[tuple[int, int]]]] = {}  # see _edges_of
        self._undo: _InPlaceUndo | None = None  # set by to_graph_def in place
        self._origin = origin or self  # the graph as read, which every graph edited from it shares

    @classmethod
    def from_graph_def(cls, graph_def: graph_pb2.GraphDef, *, storage: graph_pb2.GraphDef | None = None) -> "Graph":
        """The graph of `graph_def`. storage: the GraphDef edits append their nodes to and
        `to_graph_def()` returns (a new one by default); `graph_def` itself to rewrite it in
        place, which saves copying the nodes kept."""
        check_density(graph_def)
        if storage is None:
            storage = graph_pb2.GraphDef()
        in_place = storage is graph_def
        nodes: dict[str, int] = {}
        for i, node in enumerate(graph_def.node):
            name = node.name
            if name in nodes:
                raise GraphValidationError(f"node name {name!r} appears twice")
            nodes[name] = i if in_place else ~i
        return cls(nodes, graph_def, storage, dict(zip(nodes, nodes)))

    @property
    def library(self) -> object:
        """The FunctionDefLibrary, or None."""
        if self._library is not None:
            return self._library
        return self._source.library if self._source.HasField("library") else None

    @cached_property
    def functions(self) -> dict[str, object]:
        """The library's FunctionDefs by name (empty without a library), indexed once."""
        library = self.library
        return {f.signature.name: f for f in library.function} if library is not None else {}

    def _node_at(self, position: int) -> NodeDef:
        return self._stored[position] if position >= 0 else self._read[~position]

    def _all(self, positions: Iterable[int]) -> Iterator[NodeDef]:
        """The nodes at `positions` (`_node_at`, inline: it runs once per node of the graph)."""
        stored, read = self._stored, self._read
        return (stored[p] if p >= 0 else read[~p] for p in positions)

    def drop_indexes(self) -> None:
        """Free the consumer index and the topological numbering (a graph that is done with:
        they take more memory than its nodes' names); they are built again if asked for."""
        self._consumers = self._numbering = None
        self._wide = {}
        self.__dict__.pop("_topological_order", None)

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def __iter__(self) -> Iterator[NodeDef]:
        return self._all(self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)

    def node(self, name: str) -> NodeDef:
        """The node itself, read-only: change a node through `Editor.mutable()`."""
        return self._node_at(self._nodes[name])

    def names(self) -> Iterable[str]:
        return self._nodes.keys()

    @property
    def consumers(self) -> dict[str, list[str]]:
        """Producer name -> the nodes that read it (data or control), each once, in graph order.

        Names only (`consumers_of` gives the edges): an index of every edge as an object would
        take more memory than the rest of the graph model. Shared with the graphs edited from
        this one: never change it.
        """
        if self._consumers is None:
            nodes = self._nodes
            self._consumers = _consumer_index(
                ((name, map(parse_input, node.input)) for name, node in zip(nodes, self._all(nodes.values()))),
                self._names,
            )
        return self._consumers

    def consumers_of(self, name: str, output: int | None = None, ops: frozenset[str] | None = None) -> list[Edge]:
        """Edges reading `name` (any output, or only `output`; -1 selects control edges), from
        readers of `ops` only if given: the others' inputs, which can be thousands (a train_op
        waiting on every update), are then not scanned."""
        edges = []
        for consumer in self.consumers.get(name, ()):
            node = self.node(consumer)
            if ops is not None and node.op not in ops:
                continue
            if len(node.input) > _WIDE:
                pairs: Iterable[tuple[int, int]] = self._edges_of(consumer, node).get(name, ())
            else:
                pairs = ((slot, out) for slot, (src, out) in enumerate(map(parse_input, node.input)) if src == name)
            for slot, out in pairs:
                if output is None or out == output:
                    edges.append(Edge(consumer, -1 if out < 0 else slot, out))
        return edges

    def _edges_of(self, name: str, node: NodeDef) -> dict[str, list[tuple[int, int]]]:
        """The inputs of a node with many of them (a train_op waiting on every update) as
        producer -> [(slot, output)], parsed once per graph: scanning them for every producer
        asked about would cost their number times the number of questions."""
        edges = self._wide.get(name)
        if edges is None:
            edges = self._wide[name] = {}
            for slot, spec in enumerate(node.input):
                src, out = parse_input(spec)
                edges.setdefault(src, []).append((slot, out))
        return edges

    def inputs(self, name: str) -> list[tuple[str, int]]:
        """Data inputs of a node as (producer, output) pairs."""
        out = []
        for spec in self.node(name).input:
            src, output = parse_input(spec)
            if output >= 0:
                out.append((src, output))
        return out

    def producer(self, name: str, slot: int) -> tuple[str, int]:
        """The (producer, output) feeding data input `slot` of node `name`."""
        return parse_input(self.node(name).input[slot])

    def device(self, name: str) -> Device:
        try:
            return _parse_device(self.node(name).device)
        except GraphValidationError as exc:
            raise GraphValidationError(f"node {name!r}: {exc}") from None

    def static_elements(self, spec: str) -> int | None:
        """The number of elements of tensor `spec` when its static shape is fully known (see
        static_shape), else None."""
        from bnrewrite.graph.shape_rules import elements

        return elements(self.static_shape(spec))

    def static_shape(self, spec: str) -> "Shape":
        """The static shape of tensor `spec` where known: recorded (`_output_shapes`, as
        tf.train.export_meta_graph writes) or, for a node still as read, inferred from the graph
        as read (bnrewrite.graph.shapes); else None. The input is not changed."""
        src, output = parse_input(spec)
        if output < 0 or src not in self._nodes:
            return None
        from bnrewrite.graph.shape_rules import from_proto

        attrs = self.node(src).attr
        if "_output_shapes" in attrs:  # (reading a missing key would add it)
            shapes = attrs["_output_shapes"].list.shape
            return from_proto(shapes[output]) if output < len(shapes) else None
        origin = self._origin
        if origin._nodes.get(src) != self._nodes[src]:
            return None  # added or changed by an edit: the graph as read does not tell
        return origin._shape_inference.shape(src, output)

    @cached_property
    def _shape_inference(self) -> "ShapeInference":
        """Shapes inferred over this graph's nodes; used on the graph as read (`_origin`)."""
        from bnrewrite.graph.shapes import ShapeInference

        nodes, node_at = self._nodes, self._node_at
        return ShapeInference(lambda name: node_at(nodes[name]) if name in nodes else None)

def _consumer_index(inputs: Iterable[tuple[str, Iterable[tuple[str, int]]]], names: dict[str, str]) -> dict[str, list[str]]:
    """Producer -> the nodes reading it, each once, from (consumer, its parsed inputs) pairs in
    graph order; keys are the strings of `names` where it has them."""
    index: dict[str, list[str]] = {}
    for name, pairs in inputs:
        for src, _ in pairs:
            readers = index.get(src)
            if readers is None:
                index[names.get(src, src)] = [name]
            elif readers[-1] != name:  # a node's inputs come one after another: repeats are adjacent
                readers.append(name)
    return index


_device_cache: dict[str, Device] = {}


def _parse_device(spec: str) -> Device:
    device = _device_cache.get(spec)
    if device is None:
        device = _device_cache[spec] = Device.parse(spec)
    return device
