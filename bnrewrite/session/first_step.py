"""`bnrewrite run --verify` / `enable(verify=True)`: the first training step of each synchronized
graph, checked layer by layer (bnrewrite.session.stepcheck) as it runs.

The check ops are added to the session's shadow graph (never to the script's). The step is the
first `run` that trains: its fetches and targets reach every synced batch-norm op the check can
see and a variable update that reads a synced layer's gradient (an optimizer's); a forward-only
fetch (an initial loss, a summary thread's, an evaluation pass through a v1 cond) is not it. A
graph without such an update (no optimizer) is stepped by the first run that reaches its kept
moving-average updates, or failing those, its batch norms. The step runs once, with the check's
fetches added to the script's own; moving statistics are read in read-only runs just before and
just after it. Nothing is trained twice and no variable is written by the check. Invariant: a
graph is checked at most once, on a run the script made anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from bnrewrite.graph.names import parse_input

#: Op types that write a variable's value (optimizers' updates and assigns).
_WRITERS = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply", "Assign", "ScatterUpdate",
            "ScatterAdd", "ScatterSub", "ResourceScatter")


@dataclass
class FirstStep:
    """What to fetch around the first step of one shadow graph, and how to tell that step."""

    check: Any  # bnrewrite.session.stepcheck.StepCheck
    graph: Any  # the shadow tf.Graph, holding the check's ops
    sites: frozenset[str]  # the synced batch-norm ops the check can see
    trains: frozenset[str]  # what a run must reach one of to train (see the module's docstring)
    updates: frozenset[str]  # the kept moving-average updates
    inputs: dict[str, list[str]]  # node -> the nodes it reads (data and control) in the rewritten graph
    reached: dict[frozenset[str], frozenset[str]] = field(default_factory=dict)

    @classmethod
    def build(cls, graph: Any, result: Any) -> "FirstStep":
        from bnrewrite.session import stepcheck

        check = stepcheck.build(graph, result.graph_def, result.report)
        nodes = result.graph_def.node
        inputs = {node.name: [name.lstrip("^").split(":")[0] for name in node.input] for node in nodes}
        sites = frozenset(site for layer in check.layers for site in layer.row.sites)  # the layers it can see
        updates = frozenset(u.node for layer in check.layers for u in layer.updates)
        gradients = {g for layer in check.layers for g in layer.row.gradients if g in inputs}
        readers: dict[str, list[str]] = {}
        for node, sources in inputs.items():
            for source in sources:
                readers.setdefault(source, []).append(node)
        downstream, stack = set(gradients), list(gradients)
        while stack:
            for reader in readers.get(stack.pop(), ()):
                if reader not in downstream:
                    downstream.add(reader)
                    stack.append(reader)
        trains = frozenset(node.name for node in nodes if node.name in downstream and node.op.startswith(_WRITERS))
        return cls(check, graph, sites, trains or updates, updates, inputs)

    def learn(self, inputs: dict[str, list[str]]) -> None:
        """Add nodes copied into the shadow since (node -> the nodes it reads)."""
        self.inputs.update(inputs)
        self.reached.clear()

    def _reach(self, names: Iterable[str]) -> frozenset[str]:
        """The sites, training updates and kept updates that running `names` runs (one walk per
        new set of names)."""
        key = frozenset(names)
        if key not in self.reached:
            wanted = self.sites | self.trains | self.updates
            found, stack, visited = set(), list(key), set(key)
            while stack and len(found) < len(wanted):
                node = stack.pop()
                if node in wanted:
                    found.add(node)
                for source in self.inputs.get(node, ()):
                    if source not in visited:
                        visited.add(source)
                        stack.append(source)
            self.reached[key] = frozenset(found)
        return self.reached[key]

    def trains_with(self, names: Iterable[str]) -> bool:
        """Whether a run of `names` is a training step: it runs every site the check can see and
        one of `trains` (when the graph has any)."""
        reached = self._reach(names)
        return self.sites <= reached and (not self.trains or bool(self.trains & reached))

    def run(self, session: Any, step: Callable[[list[Any], dict[Any, Any]], list[Any]],
            names: Iterable[str]) -> tuple[list[Any], Any]:
        """Read `before`, run `step` (of the script's `names`) with the check's outputs appended to
        its fetches and the check's feeds added (it returns all values, the script's first), read
        `after`; the script's values and the Verdict (evaluate raises PassError on a failed check,
        UnsyncedLayerError on a skipped layer)."""
        ran = self._reach(names) & self.updates
        fetches = self.check.fetches(ran)
        outputs = _Outputs(self.graph)
        before = _read(session, outputs(self.check.before))
        feed = self.check.feed(before)
        values = step(outputs(fetches), dict(zip(outputs(list(feed)), feed.values())))
        script, checked = (values[:-len(fetches)], values[-len(fetches):]) if fetches else (values, [])
        after = _read(session, outputs(self.check.after))
        return script, self.check.evaluate(before, checked, after, ran)


class _Outputs:
    """Tensor names -> TF_Outputs of a graph's C graph (the check's ops have no Python Operations)."""

    def __init__(self, graph: Any) -> None:
        from bnrewrite.graph.c_graph import operations

        self.ops = operations(graph)

    def __call__(self, names: list[str]) -> list[Any]:
        from tensorflow.python.framework import c_api_util

        return [c_api_util.tf_output(self.ops[op], index) for op, index in map(parse_input, names)]


def _read(session: Any, outputs: list[Any]) -> list[Any]:
    """A read-only run of `outputs` in `session` (TensorFlow's own run, by C outputs)."""
    if not outputs:
        return []

    def run() -> list[Any]:
        session._extend_graph()
        return session._call_tf_sessionrun(None, {}, outputs, [], None)

    return session._do_call(run)
