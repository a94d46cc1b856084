"""A graph model back to a GraphDef (a mixin of bnrewrite.graph.index.Graph), and the undo of a
GraphDef assembled in place.

Invariant: a GraphDef rewritten in place is assembled in steps of one protobuf call each, each
recorded before it is taken, so `undo_in_place` puts it back byte for byte from wherever an
exception (a signal handler's included) stopped the assembly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensorflow.core.framework import graph_pb2, node_def_pb2

NodeDef = node_def_pb2.NodeDef


class GraphAssembly:
    """`to_graph_def` and `undo_in_place`, over a Graph's positions (`_nodes`), its source and
    storage GraphDefs and its replacement library."""

    _nodes: dict[str, int]
    _source: graph_pb2.GraphDef
    _storage: graph_pb2.GraphDef
    _stored: Any
    _read: Any
    _library: Any
    _undo: "_InPlaceUndo | None"

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



def copy_fields(source: Any, target: Any, but: str) -> None:
    """Copy every field of protobuf message `source` into `target`, except the field `but`."""
    for field, value in source.ListFields():
        if field.name == but:
            continue
        if field.message_type is None:
            setattr(target, field.name, value)
        else:
            getattr(target, field.name).MergeFrom(value)
