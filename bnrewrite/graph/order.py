"""Order, reachability and validation in the graph model (a mixin of bnrewrite.graph.index.Graph).

`validate()` checks that every input resolves, that names are unique and that there is no cycle
but v1 while-loops' back-edges, and records a topological numbering, spaced so that the nodes
an edit adds later number in between (`_extended_numbering`: only the input is ever sorted).
`depends_on` and `ancestors_among` answer reachability with that numbering.

Invariant: `_numbering` is set only on a valid graph, and orders every edge but loop back-edges.
"""

from __future__ import annotations

import heapq
from functools import cached_property
from typing import Any, Iterable

from bnrewrite.errors import GraphValidationError
from bnrewrite.graph.names import parse_input

#: Spacing of topological numbers (see GraphOrder._extended_numbering).
_GAP = 1 << 20
#: Edges out of these ops close v1 while-loops; they are not cycles.
_LOOP_BACK_OPS = frozenset({"NextIteration", "RefNextIteration"})


class GraphOrder:
    """Topological order, reachability and validation, over a Graph's index (`_nodes`,
    `consumers`, `node`) and the `_change` an edit made it with."""

    _nodes: dict[str, int]
    _numbering: dict[str, int] | None
    _change: Any

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

    def downstream(self, seeds: Iterable[str]) -> set[str]:
        """The seeds and every node that reads one of them, transitively (data or control edges)."""
        consumers = self.consumers
        below = set(seeds)
        stack = list(below)
        while stack:
            for reader in consumers.get(stack.pop(), ()):
                if reader not in below:
                    below.add(reader)
                    stack.append(reader)
        return below

    def upstream(self, ends: Iterable[str], known: set[str] | frozenset[str] = frozenset()) -> set[str]:
        """`ends` and every node they read, transitively (data or control edges); with `known`,
        nodes found before that hold everything they read: in the result, not walked again.

        The walk goes through every node's inputs: names parsed inline (`parse_input` only for
        an input naming an output), nodes looked up by position."""
        nodes, node_at = self._nodes, self._node_at  # type: ignore[attr-defined]
        above = set(known)
        stack = [name for name in ends if name not in above]
        above.update(stack)
        while stack:
            for spec in node_at(nodes[stack.pop()]).input:
                if spec.startswith("^"):
                    src = spec[1:]
                elif ":" in spec:
                    src = parse_input(spec)[0]
                else:
                    src = spec
                if src not in above:
                    above.add(src)
                    stack.append(src)
        return above

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
        below = self.downstream(bits)
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
            top = -1  # the greatest number among its inputs but loop back-edges, where it is >= number
            for src, _ in changed.get(name) or map(parse_input, self.node(name).input):
                src_number = numbering.get(src, -1)  # a back-edge's op looked up only where it would count
                if src_number >= number and src_number > top and self.node(src).op not in _LOOP_BACK_OPS:
                    top = src_number
            least = top + 1
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
