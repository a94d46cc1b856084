"""The graph model: a thin, read-only index over the nodes of a GraphDef.

A `Graph` maps node names, in graph order, to where their NodeDefs are: in the GraphDef it
was read from (the source) or in the GraphDef its edits append to (the storage). It holds no
per-node Python objects but the names, so indexing a graph of tens of thousands of nodes
costs little memory. Passes never mutate a `Graph`. They call `graph.edit()`, change the
`Editor`, and `Editor.finish()` returns a new `Graph` over the same source and storage: a
node an edit adds, replaces or changes is appended to the storage and the new graph points
at that copy, so every graph made along the way stays readable and a pass costs what it
changes plus one dict copy. `to_graph_def()` at the end copies the nodes still in the source
into the storage (none when the source is the storage: a GraphDef rewritten in place),
puts the storage in graph order and drops the stale nodes.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterable, Iterator, NamedTuple

from tensorflow.core.framework import graph_pb2, node_def_pb2

from bnrewrite.errors import GraphValidationError, InputFormatError
from bnrewrite.names import parse_input

if TYPE_CHECKING:
    from bnrewrite.shapes import Shape, ShapeInference

NodeDef = node_def_pb2.NodeDef

#: Spacing of topological numbers (see Graph._extended_numbering).
_GAP = 1 << 20
#: A consumer with more inputs than this gets its inputs indexed by producer (see `_edges_of`).
_WIDE = 16
#: Edges out of these ops close v1 while-loops; they are not cycles.
_LOOP_BACK_OPS = frozenset({"NextIteration", "RefNextIteration"})
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


class Graph:
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

    def to_graph_def(self) -> graph_pb2.GraphDef:
        """The graph as a GraphDef: the storage, with copies of the nodes still read from the
        source, put in graph order, stale nodes dropped.

        The storage is shared with every graph this one was edited from: neither this graph
        nor any of them may be used afterwards.
        """
        self.drop_indexes()  # their memory serves the sort
        if self._storage is self._source:
            return self._assemble_in_place()
        storage, source, order = self._storage, self._source, self._nodes
        nodes, read = self._stored, self._read
        stale = bytearray(b"\1") * len(nodes)  # the copies made below are not stale
        in_order = True
        for rank, (name, p) in enumerate(order.items()):
            if p < 0:
                nodes.add().CopyFrom(read[~p])
                p = len(nodes) - 1
            else:
                stale[p] = 0
            in_order = in_order and p == rank
            order[name] = rank  # the graph is used up: its positions make way for ranks
        if not in_order:
            for i in range(len(stale)):
                if stale[i]:
                    nodes[i].name = ""  # a removed node, or the old version of a changed one
            nodes.sort(key=lambda node: order.get(node.name, len(order)))
        del nodes[len(order):]
        if storage is not source:
            copy_fields(source, storage, but="node")
        if self._library is not None:
            storage.library.CopyFrom(self._library)
        return storage

    def _assemble_in_place(self) -> graph_pb2.GraphDef:
        """to_graph_def for a GraphDef rewritten in place, in steps `undo_in_place` takes back
        from any bytecode on, an exception raised there by a signal handler included: each step
        is one protobuf call (it completes or changes nothing) and is recorded before it is
        taken, and the undo reads from the GraphDef itself which steps were taken. The steps:
        one sort, the stale nodes cut off (kept alive), the library."""
        nodes, positions = self._stored, list(self._nodes.values())
        kept, total = len(positions), len(nodes)
        keys = list(range(kept, kept + total))  # stale nodes go after the kept ones, in their order
        for rank, p in enumerate(positions):
            keys[p] = rank
        moved = next((i for i, key in enumerate(keys) if key != i), None)
        undo = self._undo = _InPlaceUndo(keys, total, moved, None if moved is None else nodes[moved])
        if moved is not None:
            ranks = iter(keys)
            nodes.sort(key=lambda _: next(ranks))
        undo.stale = list(nodes[kept:])  # removed from the GraphDef, these stay valid messages
        del nodes[kept:]
        if self._library is not None:
            storage = self._storage
            library = type(storage.library)()
            library.CopyFrom(storage.library)
            undo.had_library = storage.HasField("library")
            undo.library = library
            storage.library.CopyFrom(self._library)
        return self._storage

    def undo_in_place(self) -> None:
        """Put a GraphDef rewritten in place back as it was before `to_graph_def`, wherever
        that stopped (the nodes the edits appended stay, after the original ones: the caller
        drops them). Putting back what was never changed changes nothing."""
        undo = self._undo
        if undo is None:
            return
        nodes = self._stored
        if undo.library is not None:
            if undo.had_library:
                self._storage.library.CopyFrom(undo.library)
            else:
                self._storage.ClearField("library")
        cut = len(nodes) < undo.total  # then `stale` was recorded
        if cut:
            nodes.extend(undo.stale or ())
        # Sorted: the sort moved another node to the first slot it changes (messages keep
        # their Python object while one refers to them); a cut comes after the sort.
        if undo.moved is not None and (cut or nodes[undo.moved] is not undo.first_moved):
            # Slot j now holds the node that was at the j-th smallest key's position.
            back = iter(sorted(range(len(undo.keys)), key=undo.keys.__getitem__))
            nodes.sort(key=lambda _: next(back))
        self._undo = None

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

    def edit(self) -> "Editor":
        return Editor(self)

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
        from bnrewrite.shapes import elements  # shapes reads the graph model's inputs

        return elements(self.static_shape(spec))

    def static_shape(self, spec: str) -> "Shape":
        """The static shape of tensor `spec` where known: recorded (`_output_shapes`, as
        tf.train.export_meta_graph writes) or, for a node still as read, inferred from the graph
        as read (bnrewrite.shapes); else None. The input is not changed."""
        src, output = parse_input(spec)
        if output < 0 or src not in self._nodes:
            return None
        from bnrewrite.shapes import from_proto

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
        from bnrewrite.shapes import ShapeInference

        nodes, node_at = self._nodes, self._node_at
        return ShapeInference(lambda name: node_at(nodes[name]) if name in nodes else None)

    def topological_order(self) -> list[str]:
        """Kahn's order over data and control edges, loop back-edges ignored.

        Raises GraphValidationError naming nodes on a cycle when there is one.
        """
        return list(self._topological_order)

    def sorted_topologically(self, names: Iterable[str]) -> list[str]:
        """`names` in an order that respects every edge between them: by the numbering that
        `validate()` leaves, which for an edited graph costs no sort of the whole graph."""
        self.validate()
        return sorted(names, key=self._numbering.__getitem__)  # type: ignore[union-attr]

    def depends_on(self, name: str, ancestor: str) -> bool:
        """Whether `name` runs after `ancestor` because of a path of data or control edges.

        Searches upstream of `name` only through nodes numbered after `ancestor`."""
        self.validate()
        numbering = self._numbering
        floor = numbering[ancestor]  # type: ignore[index]
        seen, stack = {name}, [name]
        while stack:
            for spec in self.node(stack.pop()).input:
                src = parse_input(spec)[0]
                if src == ancestor:
                    return True
                if src not in seen and numbering[src] > floor:  # type: ignore[index]
                    seen.add(src)
                    stack.append(src)
        return False

    def ancestors_among(self, names: Iterable[str], candidates: Iterable[str]) -> dict[str, set[str]]:
        """For each of `names`, the `candidates` it runs after (`depends_on` for every pair).

        One walk down from all candidates at once, then one sweep of what it reached in
        topological order, each node's candidates as a bit set pushed to its readers: the cost
        of one walk for any number of pairs, where `depends_on` per pair would walk each time.
        Edges against the numbering (loop back-edges) are not followed.
        """
        self.validate()
        numbering, consumers = self._numbering, self.consumers
        order = list(dict.fromkeys(candidates))
        bits = {name: 1 << i for i, name in enumerate(order)}
        below, stack = set(bits), list(bits)
        while stack:
            for reader in consumers.get(stack.pop(), ()):
                if reader not in below:
                    below.add(reader)
                    stack.append(reader)
        upstream: dict[str, int] = {}  # node -> the candidates it runs after, as bits
        for name in sorted(below, key=numbering.__getitem__):  # type: ignore[union-attr]
            reach = upstream.get(name, 0) | bits.get(name, 0)
            number = numbering[name]  # type: ignore[index]
            for reader in consumers.get(name, ()):
                if numbering[reader] > number:  # type: ignore[index]
                    upstream[reader] = upstream.get(reader, 0) | reach
        found: dict[str, set[str]] = {}
        for name in names:
            reach, found[name] = upstream.get(name, 0), set()
            while reach:  # one step per candidate found, not per candidate
                low = reach & -reach
                found[name].add(order[low.bit_length() - 1])
                reach ^= low
        return found

    def _full_numbering(self) -> dict[str, int]:
        """Topological positions, spaced _GAP apart so that nodes added later fit in between."""
        return {name: i * _GAP for i, name in enumerate(self._topological_order)}

    @cached_property
    def _topological_order(self) -> tuple[str, ...]:
        nodes = self._nodes
        consumers = self.consumers
        loop_back = {node.name for node in self if node.op in _LOOP_BACK_OPS}
        indegree = dict.fromkeys(nodes, 0)
        for src, readers in consumers.items():
            if src in nodes and src not in loop_back:
                for consumer in readers:
                    indegree[consumer] += 1
        ready = [name for name, d in indegree.items() if d == 0]
        order: list[str] = []
        while ready:
            name = ready.pop()
            order.append(name)
            if name in loop_back:
                continue
            for consumer in consumers.get(name, ()):
                indegree[consumer] -= 1
                if indegree[consumer] == 0:
                    ready.append(consumer)
        if len(order) != len(nodes):
            cycle = self._a_cycle({n for n, d in indegree.items() if d > 0}, loop_back)
            shown = cycle if len(cycle) <= 9 else [*cycle[:4], "...", *cycle[-3:]]
            size = f" ({len(cycle) - 1} nodes)" if len(cycle) > 9 else ""
            raise GraphValidationError(f"the graph has a cycle{size}: {' -> '.join(shown)}")
        return tuple(order)

    def _a_cycle(self, stuck: set[str], loop_back: set[str]) -> list[str]:
        """One cycle among `stuck` (the nodes Kahn's sort could not order), as names along its
        edges, the first repeated at the end. Every stuck node reads a stuck node (that is why
        it is stuck), so walking to one, then to one of its, ... must come back to a node seen."""
        path: list[str] = []
        at: dict[str, int] = {}
        name = min(stuck)
        while name not in at:
            at[name] = len(path)
            path.append(name)
            name = next(src for src, _ in map(parse_input, self.node(name).input) if src in stuck and src not in loop_back)
        cycle = path[at[name]:]
        return [*reversed(cycle), cycle[-1]]

    def validate(self) -> None:
        """Every input resolves to a node and there is no cycle.

        Names are unique by construction (a dict), so that check lives in `Editor.add`. A graph
        edited from a validated one is checked only where the edit touched it.
        """
        if self._numbering is not None:
            return
        change, nodes = self._change, self._nodes
        if change is not None and change.base._numbering is not None:
            suspects: Iterable[str] = dict.fromkeys([  # each once: a reader of every removed node is one suspect
                *(name for name, pairs in change.inputs.items() if any(src not in nodes for src, _ in pairs)),
                *(reader for name in change.removed for reader in self.consumers.get(name, ())),
            ])
        else:
            suspects = nodes if self.consumers.keys() - nodes.keys() else ()
        for name in suspects:  # name the first dangling input
            for spec in self.node(name).input:
                if parse_input(spec)[0] not in nodes:
                    raise GraphValidationError(f"node {name!r} reads {spec!r}, which does not exist")
        self._numbering = self._extended_numbering() or self._full_numbering()

    def _extended_numbering(self) -> dict[str, int] | None:
        """A topological numbering of this graph, from its validated base's, without a sort.

        Untouched and changed nodes keep their base number; a new node gets the greatest
        number among its inputs plus one, so it comes after them (and, unless a chain of more
        than _GAP new nodes grows from one node, before the next base node), new inputs
        numbered first whatever order they were added in (`_number_new`). A changed node
        that now reads a node numbered after it (dedupe's groups, now waiting on the kept
        updates) is numbered up past its inputs, and what runs after it with it (`_raise`).
        Then every edge goes from a smaller number to a greater one, so there is no cycle.
        None when that cannot be had so (a cycle): a full sort decides and names it.
        """
        change, self._change = self._change, None
        if change is None or change.base._numbering is None:
            return None
        numbering = dict(change.base._numbering)
        for name in change.removed:
            numbering.pop(name, None)
        new = {name: inputs for name, inputs in change.inputs.items() if name not in change.base}
        for name in new:
            if name not in numbering and not _number_new(numbering, name, new):
                return None
        changed = [name for name in change.inputs if name in change.base]
        late = [name for name in changed
                if any(numbering.get(src, -1) >= numbering[name] for src, _ in change.inputs[name])]
        return self._raise(numbering, late, change.inputs) if late else numbering

    def _raise(
        self, numbering: dict[str, int], late: list[str], changed: dict[str, list[tuple[str, int]]],
    ) -> dict[str, int] | None:
        """`numbering` with the `late` nodes, and what reads them, numbered up past their inputs
        where needed: one sweep in numbering order over what the raise reaches, loop back-edges
        left out as the full sort leaves them. None (a full sort decides) when that takes more
        raises than the graph has nodes: a cycle, or a change that reaches so far that a full
        sort costs no more."""
        consumers, budget = self.consumers, len(numbering)
        heap = [(numbering[name], name) for name in late]
        heapq.heapify(heap)
        while heap:
            number, name = heapq.heappop(heap)
            if number != numbering[name]:
                continue  # raised since it was queued: its inputs were in place then
            inputs = changed.get(name) or map(parse_input, self.node(name).input)
            forward = (numbering.get(src, -1) for src, _ in inputs if self.node(src).op not in _LOOP_BACK_OPS)
            least = 1 + max(forward, default=-1)
            if least <= number:
                continue
            budget -= 1
            if budget < 0:
                return None
            numbering[name] = least
            for reader in consumers.get(name, ()) if self.node(name).op not in _LOOP_BACK_OPS else ():
                if numbering[reader] <= least:
                    heapq.heappush(heap, (numbering[reader], reader))
        return numbering


def _number_new(numbering: dict[str, int], root: str, new: dict[str, list[tuple[str, int]]]) -> bool:
    """Number new node `root`, and the new nodes it reads that have no number yet (depth
    first), each one past its inputs; False on a cycle among them or an input not numbered."""
    stack, open_ = [(root, iter(new[root]))], {root}
    while stack:
        name, inputs = stack[-1]
        for src, _ in inputs:
            if src in new and src not in numbering:
                if src in open_:
                    return False
                open_.add(src)
                stack.append((src, iter(new[src])))
                break
        else:
            stack.pop()
            open_.discard(name)
            number = -1
            for src, _ in new[name]:
                src_number = numbering.get(src)
                if src_number is None:
                    return False
                number = max(number, src_number)
            numbering[name] = number + 1
    return True


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


@dataclass(frozen=True)
class _Change:
    """What an edit did to `base`: the names it added, replaced, changed or removed, those of
    them no longer in the graph, and the parsed inputs of the others, in graph order."""

    base: Graph
    touched: set[str]
    removed: set[str]
    inputs: dict[str, list[tuple[str, int]]]

    def updated_consumers(self, nodes: dict[str, int]) -> dict[str, list[str]]:
        """The base's consumer index with the edges of every touched node replaced.

        Only the lists of producers a touched node read or reads are rebuilt, in graph order,
        so the result equals an index built from scratch; the others are shared with the base.
        New nodes come after every base node, so their edges go at the end of a list; a list
        is sorted only when a node changed in place reads its producer.
        """
        base = self.base.consumers
        new_edges = _consumer_index(self.inputs.items(), self.base._names)
        producers = set(new_edges)
        for name in self.touched & self.base._nodes.keys():
            producers.update(parse_input(spec)[0] for spec in self.base.node(name).input)
        index = dict(base)
        position: dict[str, int] = {}
        for src in producers:
            readers = new_edges.get(src, [])
            if src in base:
                kept = [name for name in base[src] if name not in self.touched]
                if kept and any(name in self.base for name in readers):
                    position = position or {name: i for i, name in enumerate(nodes)}
                    readers = sorted(kept + readers, key=position.__getitem__)
                else:
                    readers = kept + readers
            if readers:
                index[src] = readers
            else:
                index.pop(src, None)
        return index


@dataclass
class _InPlaceUndo:
    """What `_assemble_in_place` may have changed: `keys` sort the `total` nodes, the first
    slot the sort changes is `moved` (None: no sort), which held `first_moved`; `stale` the
    nodes the cut takes off; the `library` before (and whether there was one)."""

    keys: list[int]
    total: int
    moved: int | None
    first_moved: NodeDef | None
    stale: list[NodeDef] | None = None
    library: Any = None
    had_library: bool = False


_device_cache: dict[str, Device] = {}


def _parse_device(spec: str) -> Device:
    device = _device_cache.get(spec)
    if device is None:
        device = _device_cache[spec] = Device.parse(spec)
    return device


class Editor:
    """Copy-on-write changes to a Graph; `finish()` returns the new Graph."""

    def __init__(self, base: Graph) -> None:
        self._base = base
        self._nodes = dict(base._nodes)
        self.library = base._library  # set it to give the edited graph another function library
        self._copied: set[str] = set()
        self._removed: set[str] = set()

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def node(self, name: str) -> NodeDef:
        return self._base._node_at(self._nodes[name])

    @staticmethod
    def new_node(**fields: object) -> NodeDef:
        """A NodeDef of its own with `fields` set, to fill in and `add()`: the storage gets a
        copy, which takes less memory than a node filled in there (protobuf arenas never
        free what growing maps and lists leave behind)."""
        return NodeDef(**fields)

    def _store(self, node: NodeDef) -> int:
        """Append a copy of `node` to the storage; its position."""
        stored = self._base._stored
        stored.add().CopyFrom(node)
        return len(stored) - 1

    def add(self, node: NodeDef) -> None:
        name = node.name
        name = self._base._names.setdefault(name, name)
        if name in self._nodes:
            raise GraphValidationError(f"a node named {name!r} already exists")
        self._nodes[name] = self._store(node)
        self._copied.add(name)

    def replace(self, node: NodeDef) -> None:
        """Put `node` where the node of the same name was (keeps its place and name)."""
        if node.name not in self._nodes:
            raise GraphValidationError(f"no node named {node.name!r} to replace")
        self._nodes[node.name] = self._store(node)
        self._copied.add(node.name)

    def remove(self, name: str) -> None:
        del self._nodes[name]
        self._removed.add(name)

    def mutable(self, name: str) -> NodeDef:
        """The node itself, copied first if it still belongs to the base graph."""
        if name not in self._copied:
            self._nodes[name] = self._store(self.node(name))
            self._copied.add(name)
        return self.node(name)

    def unique_name(self, base: str) -> str:
        if base not in self._nodes:
            return base
        i = 1
        while f"{base}_{i}" in self._nodes:
            i += 1
        return f"{base}_{i}"

    def finish(self) -> Graph:
        """The edited graph; the base graph itself when nothing was changed."""
        touched = self._copied | self._removed
        if not touched and self.library is self._base._library:
            return self._base
        touched_in_order = [name for name in self._nodes if name in touched]
        nodes = self._base._all(self._nodes[name] for name in touched_in_order)
        inputs = {name: [parse_input(spec) for spec in node.input] for name, node in zip(touched_in_order, nodes)}
        change = _Change(self._base, touched, self._removed - self._nodes.keys(), inputs)
        consumers = None if self._base._consumers is None else change.updated_consumers(self._nodes)
        base = self._base
        return Graph(self._nodes, base._source, base._storage, base._names, self.library, consumers, change, base._origin)


def copy_fields(source: Any, target: Any, but: str) -> None:
    """Copy every field of protobuf message `source` into `target`, except the field `but`."""
    for field, value in source.ListFields():
        if field.name == but:
            continue
        if field.message_type is None:
            setattr(target, field.name, value)
        else:
            getattr(target, field.name).MergeFrom(value)
