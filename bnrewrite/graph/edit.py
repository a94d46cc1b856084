"""Editing the graph model: an `Editor` over a `Graph` records what it adds, replaces and
removes, and `finish()` returns a new Graph over the same source and storage, with its base's
consumer index carried over and the change recorded for validation (`_Change`).

Invariant: a Graph never changes; every node an edit adds, replaces or changes is appended to
the storage, so every graph made along the way stays readable.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorflow.core.framework import node_def_pb2

from bnrewrite.errors import GraphValidationError
from bnrewrite.graph.index import Graph, _consumer_index
from bnrewrite.graph.names import parse_input

NodeDef = node_def_pb2.NodeDef


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
        # nodes first: zip then runs its generators to their end, none is left to be closed later
        inputs = {name: [parse_input(spec) for spec in node.input] for node, name in zip(nodes, touched_in_order)}
        change = _Change(self._base, touched, self._removed - self._nodes.keys(), inputs)
        consumers = None if self._base._consumers is None else change.updated_consumers(self._nodes)
        base = self._base
        return Graph(self._nodes, base._source, base._storage, base._names, self.library, consumers, change, base._origin)
